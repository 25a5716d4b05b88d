// The CUDA engines against the CPU engines on captured data: the embedded model's capture
// fixture, tests/fixtures/kvs_tiny_a_capture_l1.h5 (layer 1, kv head 0 with its 4 query
// heads, 640 tokens, 96 recorded decode steps), made by
//   kvs-capture --text data/corpus/docs.val.txt.gz --context 640 --decode-steps 96
//               --layers 1 --kv-heads 0 --device cpu -o tests/fixtures/kvs_tiny_a_capture_l1.h5
// replayed through the same method settings on both backends (no baselines).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "runtime/eval/replay.h"

namespace kvs::test {

// How far the CUDA rows may sit from the CPU rows. Real queries can sit near a selection's
// threshold, where the engines' sums (in different precisions and orders) may decide
// differently, so the means are compared with room for a flip or two rather than exactly.
struct ReplayTolerance {
  double read = 0.02;      ///< kv_read_fraction_mean
  double rel_l2 = 0.01;    ///< rel_l2_mean
  double mass = 0.02;      ///< mass_recall_mean
  double max_read = 0.95;  ///< the CPU rows must read less than this: a selection happened
};

// Replays the fixture through `methods` on the CPU and the CUDA engines and compares the
// rows of `method`; returns how many rows were compared.
inline int expect_captured_replays_agree(const std::vector<std::string>& methods,
                                         const std::string& method, const ReplayTolerance& tol) {
  const CaptureFile capture =
      CaptureFile::open(std::string(KVS_SOURCE_DIR) + "/tests/fixtures/kvs_tiny_a_capture_l1.h5");
  eval::ReplayConfig rc;
  rc.methods = methods;
  rc.budget_fractions.clear();
  rc.baselines_at_method_read = false;
  rc.engine.backend = Backend::Cpu;
  const std::vector<eval::ResultRow> cpu = eval::replay_capture(capture, rc).rows_over_layers();
  rc.engine.backend = Backend::Cuda;
  const std::vector<eval::ResultRow> gpu = eval::replay_capture(capture, rc).rows_over_layers();
  EXPECT_EQ(cpu.size(), gpu.size());
  if (cpu.size() != gpu.size()) return 0;
  int compared = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cpu[i].method != method) continue;
    SCOPED_TRACE(cpu[i].knob);
    EXPECT_EQ(gpu[i].method, cpu[i].method);
    EXPECT_EQ(gpu[i].knob, cpu[i].knob);
    EXPECT_EQ(gpu[i].steps, cpu[i].steps);
    EXPECT_GT(cpu[i].steps, 0);
    EXPECT_LT(cpu[i].kv_read_fraction_mean, tol.max_read);
    EXPECT_NEAR(gpu[i].kv_read_fraction_mean, cpu[i].kv_read_fraction_mean, tol.read);
    EXPECT_NEAR(gpu[i].rel_l2_mean, cpu[i].rel_l2_mean, tol.rel_l2);
    EXPECT_NEAR(gpu[i].mass_recall_mean, cpu[i].mass_recall_mean, tol.mass);
    ++compared;
  }
  return compared;
}

}  // namespace kvs::test
