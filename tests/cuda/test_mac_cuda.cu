// MAC-Attention on the GPU against the CPU reference engine, step by step on the same scene:
// random and captured-like queries (large head means, a sink), hits and misses, ring
// wrap-around (W 8 and 40: partial match tiles), ragged batches, paged caches, GQA groups 1,
// 4 and 8, head dims 64 and 128; the prefill fill; misses against the dense CUDA engine; and a
// decode step captured in a CUDA graph and replayed. Hit decisions must agree exactly (the
// scenes keep distances far from the thresholds), outputs within bf16 tolerance. Last, a
// capture of the real model replayed through kvs-eval's harness with both backends.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/mac/mac.h"
#include "runtime/dense_engine.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "runtime/mac_engine.h"
#include "tests/cpu/mac_scene.h"
#include "tests/cuda/captured_replay.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

using test::DeviceBuffer;
using test::MacScene;
using test::MacSceneConfig;

constexpr double kMaxRelL2 = 2e-2;  // bf16 P in the tensor-core products, bf16 entries

EngineConfig config(Backend backend, int batch, int window, int band, int min_context) {
  EngineConfig c;
  c.backend = backend;
  c.max_batch = batch;
  c.collect_stats = true;
  c.mac.window = window;
  c.mac.band = band;
  c.mac.min_context = min_context;
  c.mac.min_queries = 4;
  return c;
}

// The CPU and CUDA engines side by side on one scene.
struct Twin {
  MacScene& sc;
  KVCache cpu_cache, gpu_cache;
  MacEngine cpu, gpu;
  DeviceBuffer<char> ws;
  DeviceBuffer<bf16> q, qp, out;
  DeviceBuffer<float> lse;

  Twin(MacScene& s, const EngineConfig& c)
      : sc(s),
        cpu_cache(s.cache_config(Device::Cpu)),
        gpu_cache(s.cache_config(Device::Cuda)),
        cpu(s.shape, with_backend(c, Backend::Cpu)),
        gpu(s.shape, with_backend(c, Backend::Cuda)) {
    sc.fill_cache(cpu_cache);
    sc.fill_cache(gpu_cache);
    ws.resize(gpu.workspace_bytes());
    gpu.bind_workspace({ws.get(), ws.size()});
    const size_t n = size_t(sc.batch()) * sc.c.hq * sc.c.d;
    q.resize(n);
    qp.resize(n);
    out.resize(n);
    lse.resize(size_t(sc.batch()) * sc.c.hq);
  }
  static EngineConfig with_backend(EngineConfig c, Backend b) {
    c.backend = b;
    return c;
  }

  void prefill(int fill_queries) {
    cpu_cache.set_lengths(sc.c.prompt);
    gpu_cache.set_lengths(sc.c.prompt);
    cpu.prefill(0, cpu_cache.view(0), nullptr);
    gpu.prefill(0, gpu_cache.view(0), nullptr);
    if (fill_queries == 0) return;
    for (int b = 0; b < sc.batch(); ++b) {
      const int n = std::min(fill_queries, sc.c.prompt[size_t(b)]);
      const std::vector<bf16> hq = sc.prompt_queries(b, n, false), hp = sc.prompt_queries(b, n, true);
      cpu.prefill_queries(0, b, hq.data(), hp.data(), n, cpu_cache.view(0), nullptr);
      DeviceBuffer<bf16> dq(hq), dp(hp);
      gpu.prefill_queries(0, b, dq.get(), dp.get(), n, gpu_cache.view(0), nullptr);
    }
  }

  // One step on both; compares outputs, lse, reads. Returns the number of hit heads.
  int step(int s) {
    cpu_cache.set_lengths(sc.lengths(s));
    gpu_cache.set_lengths(sc.lengths(s));
    const std::vector<bf16> hq = sc.step_queries(s, false), hp = sc.step_queries(s, true);
    std::vector<bf16> ref(hq.size());
    std::vector<float> ref_lse(size_t(sc.batch()) * sc.c.hq);
    cpu.decode(0, hq.data(), hp.data(), cpu_cache.view(0), ref.data(), ref_lse.data(), nullptr);
    q.upload(hq);
    qp.upload(hp);
    out.poison();
    lse.poison();
    gpu.decode(0, q.get(), qp.get(), gpu_cache.view(0), out.get(), lse.get(), nullptr);
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16> got = out.download();
    const std::vector<float> got_lse = lse.download();
    int hits = 0;
    for (int b = 0; b < sc.batch(); ++b) {
      const auto rc = cpu.last_read(0, b), rg = gpu.last_read(0, b);
      for (int h = 0; h < sc.c.hq; ++h) {
        const std::string what = "step " + std::to_string(s) + " seq " + std::to_string(b) +
                                 " head " + std::to_string(h);
        EXPECT_EQ(rg[size_t(h)], rc[size_t(h)]) << what << ": hit decisions differ";
        hits += !rc[size_t(h)].empty() && rc[size_t(h)].front() > 0;
        const size_t row = size_t(b) * sc.c.hq + h;
        double num = 0, den = 0;
        for (int i = 0; i < sc.c.d; ++i) {
          const double a = bf16_to_float(got[row * sc.c.d + i]);
          const double e = bf16_to_float(ref[row * sc.c.d + i]);
          EXPECT_FALSE(std::isnan(a)) << what;
          num += (a - e) * (a - e);
          den += e * e;
        }
        EXPECT_LT(std::sqrt(num / std::max(den, 1e-12)), kMaxRelL2) << what;
        EXPECT_NEAR(got_lse[row], ref_lse[row], 2e-2 + 1e-3 * std::fabs(ref_lse[row])) << what;
      }
    }
    return hits;
  }

  void expect_same_stats() {
    const MacStats a = cpu.mac_stats(), b = gpu.mac_stats();
    EXPECT_EQ(b.head_steps, a.head_steps);
    EXPECT_EQ(b.head_hits, a.head_hits);
    EXPECT_EQ(b.kv_rows_read, a.kv_rows_read);
    EXPECT_EQ(b.kv_rows_context, a.kv_rows_context);
    EXPECT_EQ(gpu.stats().selection_bytes_read, cpu.stats().selection_bytes_read);
  }
};

struct Case {
  int hq, hkv, d;
  std::vector<int> prompt;
  int window, band, page_size;
  bool captured_like;
};

class MacCudaVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(MacCudaVsCpu, StepsAgree) {
  KVS_SKIP_WITHOUT_CUDA();
  const Case& k = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MacSceneConfig c;
  c.hq = k.hq;
  c.hkv = k.hkv;
  c.d = k.d;
  c.prompt = k.prompt;
  c.steps = 3 * k.window / 2 + 10;
  c.page_size = k.page_size;
  c.repeat = 0.5;
  c.max_lag = k.window + 4;  // some repeats fall out of the window
  c.seed = uint32_t(seed);
  if (k.captured_like) {
    c.q_mean = 3.f;
    c.q_scale = 0.3f;
    c.sink = true;
  }
  MacScene sc(c);
  Twin tw(sc, config(Backend::Cuda, sc.batch(), k.window, k.band, 0));
  tw.prefill(k.window / 2);
  int hits = 0;
  for (int s = 0; s < c.steps; ++s) hits += tw.step(s);
  EXPECT_GT(hits, 0);
  tw.expect_same_stats();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MacCudaVsCpu,
    ::testing::Values(Case{4, 4, 128, {300}, 8, 4, 16, false},                // group 1, W 8
                      Case{8, 2, 64, {200, 333, 97}, 40, 16, 16, false},      // group 4, ragged
                      Case{16, 2, 128, {260, 130}, 40, 32, 7, true},          // group 8, odd pages
                      Case{32, 8, 128, {150, 400, 90, 301}, 64, 16, 16, true}));  // Llama-8B heads

// The spec defaults (W 512, B 256, min context 2048) past the gate, on captured-like queries.
TEST(MacCuda, DefaultsPastTheMinimumContext) {
  KVS_SKIP_WITHOUT_CUDA();
  MacSceneConfig c;
  c.hq = 8;
  c.hkv = 2;
  c.d = 128;
  c.prompt = {2040, 2300};
  c.steps = 24;
  c.repeat = 0.6;
  c.max_lag = 40;
  c.q_mean = 3.f;
  c.q_scale = 0.3f;
  c.sink = true;
  MacScene sc(c);
  EngineConfig e;
  e.backend = Backend::Cuda;
  e.max_batch = 2;
  e.collect_stats = true;
  Twin tw(sc, e);
  tw.prefill(512);
  int hits = 0;
  for (int s = 0; s < c.steps; ++s) hits += tw.step(s);
  EXPECT_GT(hits, 0);
  tw.expect_same_stats();
}

// Nothing hits (tau = 1): the output is the dense CUDA engine's.
void expect_misses_match_dense(int hq, int hkv, std::vector<int> prompt) {
  MacSceneConfig c;
  c.hq = hq;
  c.hkv = hkv;
  c.d = 128;
  c.prompt = std::move(prompt);
  c.steps = 4;
  MacScene sc(c);
  const int batch = int(c.prompt.size());
  // W 512: the match scans the ring with a cluster of 8 CTAs (distributed shared memory).
  EngineConfig e = config(Backend::Cuda, batch, 512, 32, 0);
  e.mac.tau = 1.0;
  MacEngine mac(sc.shape, e);
  DenseEngine dense(sc.shape, e);
  KVCache cache(sc.cache_config(Device::Cuda));
  sc.fill_cache(cache);
  DeviceBuffer<char> ws_m(mac.workspace_bytes()), ws_d(dense.workspace_bytes());
  mac.bind_workspace({ws_m.get(), ws_m.size()});
  dense.bind_workspace({ws_d.get(), ws_d.size()});
  cache.set_lengths(sc.c.prompt);
  mac.prefill(0, cache.view(0), nullptr);
  const size_t n = size_t(batch) * c.hq * c.d;
  DeviceBuffer<bf16> q(n), qp(n), om(n), od(n);
  for (int s = 0; s < c.steps; ++s) {
    cache.set_lengths(sc.lengths(s));
    q.upload(sc.step_queries(s, false));
    qp.upload(sc.step_queries(s, true));
    om.poison();
    mac.decode(0, q.get(), qp.get(), cache.view(0), om.get(), nullptr, nullptr);
    dense.decode(0, q.get(), nullptr, cache.view(0), od.get(), nullptr, nullptr);
    const std::vector<bf16> a = om.download(), b = od.download();
    for (int r = 0; r < batch * c.hq; ++r) {
      double num = 0, den = 0;
      for (int i = 0; i < c.d; ++i) {
        const double x = bf16_to_float(a[size_t(r) * c.d + i]), y = bf16_to_float(b[size_t(r) * c.d + i]);
        num += (x - y) * (x - y);
        den += y * y;
      }
      ASSERT_LT(std::sqrt(num / den), 1e-2) << "step " << s << " row " << r;
    }
  }
  EXPECT_EQ(mac.mac_stats().head_hits, 0u);
  EXPECT_EQ(mac.stats().kv_rows_read, mac.stats().kv_rows_context);
}

TEST(MacCuda, MissesMatchTheDenseEngine) {
  KVS_SKIP_WITHOUT_CUDA();
  expect_misses_match_dense(32, 8, {3000, 1200});
}

// One kv head: the long sequence's pair gets most of the wave's chunks (~150 states per
// head), so the completion's warps take several rounds of states.
TEST(MacCuda, MissesOfOneLongPairMatchTheDenseEngine) {
  KVS_SKIP_WITHOUT_CUDA();
  expect_misses_match_dense(8, 1, {20000, 300});
}

// The whole decode step (length += 1 on the device, match, attend, complete) captured once
// and replayed; the CPU engine steps alongside.
TEST(MacCuda, GraphCapturedStepsMatchCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  MacSceneConfig c;
  c.hq = 32;
  c.hkv = 8;
  c.d = 128;
  c.prompt = {700, 520};
  c.steps = 40;
  c.repeat = 0.6;
  c.max_lag = 24;
  MacScene sc(c);
  Twin tw(sc, config(Backend::Cuda, 2, 32, 16, 0));
  tw.prefill(0);
  // The graph starts from the step-0 lengths minus one: its first node adds the token.
  std::vector<int> before = sc.lengths(0);
  for (int& l : before) --l;
  tw.gpu_cache.set_lengths(before);
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  tw.gpu_cache.enqueue_step(stream);
  tw.gpu.decode(0, tw.q.get(), tw.qp.get(), tw.gpu_cache.view(0), tw.out.get(), tw.lse.get(),
                stream);
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  int hits = 0;
  for (int s = 0; s < c.steps; ++s) {
    const std::vector<bf16> hq = sc.step_queries(s, false), hp = sc.step_queries(s, true);
    tw.cpu_cache.set_lengths(sc.lengths(s));
    std::vector<bf16> ref(hq.size());
    tw.cpu.decode(0, hq.data(), hp.data(), tw.cpu_cache.view(0), ref.data(), nullptr, nullptr);
    tw.q.upload(hq);
    tw.qp.upload(hp);
    tw.out.poison();
    tw.gpu_cache.commit_step();
    KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<bf16> got = tw.out.download();
    for (int b = 0; b < 2; ++b) {
      const auto rc = tw.cpu.last_read(0, b), rg = tw.gpu.last_read(0, b);
      for (int h = 0; h < c.hq; ++h) {
        ASSERT_EQ(rg[size_t(h)], rc[size_t(h)]) << "step " << s << " seq " << b << " head " << h;
        hits += rc[size_t(h)].front() > 0;
        const size_t row = size_t(b) * c.hq + h;
        double num = 0, den = 0;
        for (int i = 0; i < c.d; ++i) {
          const double a = bf16_to_float(got[row * c.d + i]), e = bf16_to_float(ref[row * c.d + i]);
          ASSERT_FALSE(std::isnan(a));
          num += (a - e) * (a - e);
          den += e * e;
        }
        ASSERT_LT(std::sqrt(num / den), kMaxRelL2) << "step " << s << " row " << row;
      }
    }
  }
  EXPECT_GT(hits, 0);
  tw.expect_same_stats();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Captured data (tests/cuda/captured_replay.h): both threshold rules, W 64, B 32, no minimum
// context, replayed on the CPU and the CUDA engine.
TEST(MacCuda, CapturedQueriesMatchCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  test::ReplayTolerance tol;
  tol.max_read = 0.6;  // reuse happened: the test compares hits
  EXPECT_EQ(
      test::expect_captured_replays_agree({"mac:window=64,band=32,min_context=0",
                                           "mac:window=64,band=32,min_context=0,threshold=paper"},
                                          "mac", tol),
      2);
}

}  // namespace
}  // namespace kvs
