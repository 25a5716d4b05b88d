// AttentionPredictor trainer (libtorch, CPU) on a real capture of kvs-tiny-a (8 query heads,
// 2 kv heads): per query head and grouped (a history per kv head, the group's largest rows),
// deterministic under its seed, and the grouped form recorded in the trained file so that the
// engine follows it.
#include <gtest/gtest.h>

#include <cmath>

#include "artifacts/trained_file.h"
#include "runtime/attnpred_engine.h"
#include "tests/torch/tiny_capture.h"
#include "train/attnpred_trainer.h"

namespace kvs {
namespace {

class AttnPredTrainOnCapture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    // Layer 0 dense (not trained on), layer 2 trained.
    testing::record_tiny_capture(capture(), {0, 2}, 16);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string capture() { return dir_->file("capture.h5"); }
  static std::string file(const std::string& name) { return dir_->file(name); }
  static train::AttnPredTrainConfig config(bool grouped) {
    train::AttnPredTrainConfig c;
    c.captures = {capture()};
    c.knobs.history = 8;  // 16 decode steps: 8 samples per (sequence, layer, head)
    c.knobs.dense_layers = {0};
    c.knobs.group_history = grouped;
    c.epochs = 2;
    c.batch_size = 16;
    c.val_fraction = 0.25;
    c.seed = 5;
    return c;
  }
  static testing::TempDir* dir_;
};
testing::TempDir* AttnPredTrainOnCapture::dir_ = nullptr;

TEST_F(AttnPredTrainOnCapture, GroupedRowsTrainOncePerKvHeadAndTheTrainedFileSaysSo) {
  const train::AttnPredTrainResult per_q = train::train_attnpred(config(false));
  const train::AttnPredTrainResult grouped = train::train_attnpred(config(true));
  // 2 sequences x 1 layer x (8 query heads | 2 kv heads) units of 8 samples each.
  EXPECT_EQ(per_q.train_samples + per_q.val_samples, 2 * 8 * 8);
  EXPECT_EQ(grouped.train_samples + grouped.val_samples, 2 * 2 * 8);
  EXPECT_FALSE(per_q.params.group_history);
  EXPECT_TRUE(grouped.params.group_history);
  ASSERT_EQ(grouped.curve.size(), 2u);
  for (const train::AttnPredEpoch& e : grouped.curve) {
    EXPECT_TRUE(std::isfinite(e.train_loss) && std::isfinite(e.val_loss));
    EXPECT_GT(e.val_recovery, 0.0);
  }
  EXPECT_NE(per_q.params.cnn, grouped.params.cnn);
  EXPECT_EQ(train::train_attnpred(config(true)).params.cnn, grouped.params.cnn);  // seeded

  train::write_attnpred_trained(file("attnpred.h5"), config(true), grouped);
  const TrainedFile t = TrainedFile::open(file("attnpred.h5"));
  const AttnPredParams p = load_attnpred_params(t.group(), grouped.shape);
  EXPECT_TRUE(p.group_history);
  EXPECT_EQ(p.cnn, grouped.params.cnn);
  EngineConfig ec;
  ec.backend = Backend::Cpu;
  ec.attnpred.max_context = 1024;
  AttnPredEngine e(grouped.shape, ec, p);
  std::vector<int32_t> table(1, 0), len(1, 1000);
  std::vector<bf16> k(size_t(1024) * 2 * 128), v(k.size());
  PagedKV kv{k.data(), v.data(), table.data(), len.data(), 1, 1, 1024, 2, 128, 1};
  e.prefill(2, kv, nullptr);
  EXPECT_EQ(e.history_rows(2).size(), size_t(2) * 8 * e.max_blocks());  // a history per kv head
}

}  // namespace
}  // namespace kvs
