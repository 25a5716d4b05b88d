// SAAP trainer (Faiss + libtorch, CPU): the k-means wrapper against Faiss used directly, the
// runtime's MLP forward against libtorch on the same weights, and training on a real capture of
// kvs-tiny-a, two 1024-byte prompts (validation KL goes down, the run is deterministic), then
// trained file -> kvs-indexbuild's bundle -> the CPU engine through kvs-eval's replay with both
// routers.
#include <cstdint>  // before Faiss: its 1.7 headers use uint8_t without including <cstdint>
#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>
#include <gtest/gtest.h>

#include <random>

#include "artifacts/bundle.h"
#include "indexbuild/indexbuild.h"
#include "kernels/saap/saap.h"
#include "runtime/eval/replay.h"
#include "runtime/saap_engine.h"
#include "tests/torch/tiny_capture.h"
#include "train/saap_trainer.h"

namespace kvs {
namespace {

std::vector<float> random_points(int64_t n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(size_t(n) * d);
  for (int64_t i = 0; i < n; ++i) {
    const float shift = float(i % 7);  // a few loose blobs
    for (int j = 0; j < d; ++j) x[size_t(i) * d + j] = normal(rng) + (j == 0 ? shift : 0.f);
  }
  return x;
}

TEST(SaapKMeans, WrapperMatchesFaissUsedDirectly) {
  const int d = 32, C = 24;
  const int64_t n = 3000;
  const std::vector<float> x = random_points(n, d, 1);
  for (bool spherical : {true, false}) {
    train::KMeansOptions o;
    o.num_clusters = C;
    o.iterations = 10;
    o.spherical = spherical;
    o.seed = 77;
    const std::vector<float> ours = train::kmeans(x.data(), n, d, o, "test points");
    faiss::ClusteringParameters cp;
    cp.niter = 10;
    cp.spherical = spherical;
    cp.seed = 77;
    faiss::Clustering ref(d, C, cp);
    faiss::IndexFlatL2 l2(d);
    faiss::IndexFlatIP ip(d);
    ref.train(n, x.data(), spherical ? static_cast<faiss::Index&>(ip) : l2);
    ASSERT_EQ(ours.size(), ref.centroids.size());
    for (size_t i = 0; i < ours.size(); ++i) ASSERT_EQ(ours[i], ref.centroids[i]) << i;
    // The runtime's assignment rule agrees with Faiss's L2 search on those centroids.
    faiss::IndexFlatL2 search(d);
    search.add(C, ours.data());
    std::vector<float> dist(static_cast<size_t>(n));
    std::vector<int64_t> label(static_cast<size_t>(n));
    search.search(n, x.data(), 1, dist.data(), label.data());
    std::vector<float> norms(static_cast<size_t>(C));
    for (int c = 0; c < C; ++c) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += double(ours[size_t(c) * d + j]) * ours[size_t(c) * d + j];
      norms[size_t(c)] = float(s);
    }
    int agree = 0;
    for (int64_t i = 0; i < n; ++i)
      agree += kernels::saap::nearest_centroid_cpu(x.data() + i * d, ours.data(), norms.data(), C,
                                                   d) == int(label[size_t(i)]);
    EXPECT_GE(agree, n - 3) << "spherical " << spherical;  // fp32 near-ties at most
  }
  train::KMeansOptions o;
  o.num_clusters = 5000;
  try {
    train::kmeans(x.data(), n, d, o, "layer 3 kv head 1");
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 3 kv head 1: 3000 training keys for 5000"),
              std::string::npos)
        << e.what();
  }
}

TEST(SaapMlp, RuntimeForwardMatchesLibtorch) {
  const int d = 128, H = 64, C = 48;
  torch::manual_seed(3);
  torch::nn::Sequential m = train::make_query_model(d, H, C);
  auto* bn = m[1]->as<torch::nn::BatchNorm1d>();
  {
    torch::NoGradGuard ng;
    bn->running_mean.copy_(torch::randn({H}) * 0.3);
    bn->running_var.copy_(torch::rand({H}) + 0.5);
    bn->weight.copy_(torch::rand({H}) + 0.5);
    bn->bias.copy_(torch::randn({H}) * 0.1);
  }
  m->eval();
  ModelShape shape;
  shape.num_layers = 2;
  shape.num_q_heads = 2;
  shape.num_kv_heads = 1;
  shape.head_dim = d;
  shape.max_position = 1024;
  SaapParts p;
  p.num_clusters = C;
  p.hidden_dim = H;
  p.head_dim = d;
  p.num_q_heads = 2;
  p.num_kv_heads = 1;
  p.probes = 4;
  p.layers = {1};
  p.allocate();
  train::export_query_model(m, p, 0, 1);  // query head 1
  const FoldedMlp f = fold_batch_norm(p, 0);
  std::vector<float> cent(size_t(C) * d, 0.f), norms(static_cast<size_t>(C), 0.f);
  kernels::saap::Router<float> r;
  r.centroids = cent.data();
  r.centroid_norms = norms.data();
  r.w1 = f.w1.data();
  r.b1 = f.b1.data();
  r.w2 = f.w2.data();
  r.b2 = f.b2.data();
  r.num_q_heads = 2;
  r.num_kv_heads = 1;
  r.head_dim = d;
  r.hidden = H;
  r.num_clusters = C;
  const torch::Tensor q = torch::randn({16, d});
  const torch::Tensor ref = torch::softmax(m->forward(q), 1).to(torch::kFloat64);
  std::vector<double> probs(static_cast<size_t>(C));
  for (int i = 0; i < 16; ++i) {
    const torch::Tensor row = q[i].contiguous();
    kernels::saap::mlp_probs_cpu(r, 1, row.data_ptr<float>(), probs.data());
    for (int c = 0; c < C; ++c)
      EXPECT_NEAR(probs[size_t(c)], ref[i][c].item<double>(),
                  1e-5 + 1e-4 * ref[i][c].item<double>());
  }
}

class SaapTrainOnCapture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    testing::record_tiny_capture(capture(), {0, 1}, 12);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string capture() { return dir_->file("capture.h5"); }
  static std::string file(const std::string& name) { return dir_->file(name); }

  static train::SaapTrainOptions options() {
    train::SaapTrainOptions o;
    o.kmeans.num_clusters = 16;
    o.hidden = 64;
    o.iterations = 100;
    o.batch = 128;
    o.lr = 1e-3;
    o.recent = 32;
    o.probes = 4;
    o.eval_every = 20;
    return o;
  }
  static testing::TempDir* dir_;
};
testing::TempDir* SaapTrainOnCapture::dir_ = nullptr;

TEST_F(SaapTrainOnCapture, LowersValidationKlDeterministicallyAndRunsFromABundle) {
  const train::SaapTrainOptions o = options();
  const train::SaapTrainResult a = train::train_saap({capture()}, o);
  ASSERT_EQ(a.parts.layers, std::vector<int>{1});
  ASSERT_EQ(a.heads.size(), 8u);
  for (const train::SaapHeadReport& h : a.heads) {
    EXPECT_GT(h.val_queries, 0);
    EXPECT_EQ(h.loss.size(), size_t(o.iterations));
    EXPECT_EQ(h.val_kl.size(), a.val_steps.size());
    EXPECT_LT(h.val_kl_final, 0.8 * h.val_kl_init) << "layer " << h.layer << " head " << h.q_head;
  }
  const train::SaapTrainResult b = train::train_saap({capture()}, o);
  EXPECT_EQ(a.parts.per_layer[0].w2, b.parts.per_layer[0].w2);
  EXPECT_EQ(a.parts.per_layer[0].centroids, b.parts.per_layer[0].centroids);

  train::write_saap_trained(file("saap.h5"), a, o);
  IndexbuildInputs in;
  in.shape = a.shape;
  in.trained_files = {file("saap.h5")};
  build_bundle(file("bundle.h5"), in);
  const Bundle bundle = Bundle::open(file("bundle.h5"));
  const SaapParts back = read_saap_parts(bundle.method_group("saap"), a.shape);
  EXPECT_EQ(back.per_layer[0].w1, a.parts.per_layer[0].w1);
  EXPECT_EQ(back.recent_tokens, 32);

  const CaptureFile cap = CaptureFile::open(capture());
  double recall[2] = {0, 0};
  for (int router = 0; router < 2; ++router) {
    eval::ReplayConfig rc;
    rc.methods = {"saap"};
    rc.bundle = file("bundle.h5");
    rc.engine.backend = Backend::Cpu;
    rc.engine.saap.recent_tokens = 32;
    rc.engine.saap.probes = 4;
    rc.engine.saap.query_router = router == 0 ? SaapRouter::Mlp : SaapRouter::NearestCentroid;
    rc.budget_fractions = {};
    rc.baselines_at_method_read = false;
    const eval::Aggregator agg = eval::replay_capture(cap, rc);
    for (const eval::ResultRow& r : agg.rows())
      if (r.method == "saap" && r.layer == 1) {
        EXPECT_EQ(r.steps, 24);  // 12 per sequence
        EXPECT_LT(r.kv_read_fraction_mean, 1.0);
        recall[router] = r.mass_recall_mean;
      }
  }
  EXPECT_GT(recall[0], 0.0);
  EXPECT_GT(recall[1], 0.0);
}

TEST_F(SaapTrainOnCapture, RejectsSequencesWithoutLongRangeQueries) {
  train::SaapTrainOptions o = options();
  o.recent = 5000;
  try {
    train::train_saap({capture()}, o);
    FAIL() << "expected an exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("beyond the dense window"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvs
