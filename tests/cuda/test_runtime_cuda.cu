// The runtime on the CUDA backend: a whole decode step (begin_step, append for every layer,
// dense decode) captured once in a CUDA graph and replayed step after step, checked against
// the same steps on the CPU backend.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "tests/common/test_util.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

using test::random_bf16;

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), h.size() * sizeof(T)));
  KVS_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// A Llama-like shape: 32 query heads, 8 kv heads, head_dim 128.
ModelShape llama_shape(int layers) {
  ModelShape s;
  s.num_layers = layers;
  s.num_q_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.max_position = 1 << 16;
  return s;
}

TEST(RuntimeCuda, GraphCapturedDecodeStepsMatchCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const ModelShape s = llama_shape(2);
  const std::vector<int> prompt{1000, 77, 4099};
  const int batch = int(prompt.size()), steps = 5, max_len = 4200;
  KVCacheConfig cc;
  cc.num_layers = s.num_layers;
  cc.num_kv_heads = s.num_kv_heads;
  cc.head_dim = s.head_dim;
  cc.page_size = 16;
  cc.max_batch = batch;
  cc.max_seq_len = max_len;
  KVCacheConfig hc = cc;
  hc.device = Device::Cpu;
  KVCache gpu(cc), cpu(hc);
  std::mt19937 gen(11);
  const int row = s.num_kv_heads * s.head_dim;
  for (int b = 0; b < batch; ++b) {
    // Reserve in an interleaved order so page ids are not contiguous per sequence.
    gpu.reserve(b, prompt[b] / 2);
    cpu.reserve(b, prompt[b] / 2);
  }
  for (int b = 0; b < batch; ++b) {
    gpu.reserve(b, prompt[b] + steps);
    cpu.reserve(b, prompt[b] + steps);
    for (int l = 0; l < s.num_layers; ++l) {
      const auto k = random_bf16(size_t(prompt[b]) * row, gen);
      const auto v = random_bf16(size_t(prompt[b]) * row, gen);
      cpu.write(l, b, 0, prompt[b], k.data(), v.data());
      bf16* dk = to_device(k);
      bf16* dv = to_device(v);
      gpu.write(l, b, 0, prompt[b], dk, dv);
      cudaFree(dk);
      cudaFree(dv);
    }
  }
  gpu.set_lengths(prompt);
  cpu.set_lengths(prompt);

  EngineConfig gcfg;
  gcfg.max_batch = batch;
  gcfg.collect_stats = true;
  EngineConfig ccfg = gcfg;
  ccfg.backend = Backend::Cpu;
  auto ge = make_engine(Method::Dense, s, gcfg);
  auto ce = make_engine(Method::Dense, s, ccfg);
  void* ws = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(&ws, ge->workspace_bytes()));
  ge->bind_workspace({ws, ge->workspace_bytes()});

  // Fixed device buffers the graph reads each replay: the step's q, k_new, v_new, out.
  const size_t qn = size_t(batch) * s.num_q_heads * s.head_dim, kn = size_t(batch) * row;
  bf16 *dq, *dk, *dv, *dout;
  KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dq), qn * sizeof(bf16) * s.num_layers));
  KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dk), kn * sizeof(bf16) * s.num_layers));
  KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dv), kn * sizeof(bf16) * s.num_layers));
  KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dout), qn * sizeof(bf16) * s.num_layers));
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  gpu.enqueue_step(stream);
  for (int l = 0; l < s.num_layers; ++l) {
    gpu.append(l, dk + l * kn, dv + l * kn, stream);
    ge->decode(l, dq + l * qn, nullptr, gpu.view(l), dout + l * qn, nullptr, stream);
  }
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<bf16>> q(s.num_layers), k(s.num_layers), v(s.num_layers);
    for (int l = 0; l < s.num_layers; ++l) {
      q[l] = random_bf16(qn, gen);
      k[l] = random_bf16(kn, gen);
      v[l] = random_bf16(kn, gen);
      KVS_CUDA_CHECK(cudaMemcpy(dq + l * qn, q[l].data(), qn * 2, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(cudaMemcpy(dk + l * kn, k[l].data(), kn * 2, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(cudaMemcpy(dv + l * kn, v[l].data(), kn * 2, cudaMemcpyHostToDevice));
    }
    KVS_CUDA_CHECK(cudaMemset(dout, 0xff, qn * 2 * s.num_layers));  // NaN poison
    gpu.commit_step();  // the host half of the step the graph replays
    KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    cpu.begin_step(nullptr);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int l = 0; l < s.num_layers; ++l) {
      cpu.append(l, k[l].data(), v[l].data(), nullptr);
      std::vector<bf16> ref(qn), got(qn);
      ce->decode(l, q[l].data(), nullptr, cpu.view(l), ref.data(), nullptr, nullptr);
      KVS_CUDA_CHECK(cudaMemcpy(got.data(), dout + l * qn, qn * 2, cudaMemcpyDeviceToHost));
      for (int r = 0; r < batch * s.num_q_heads; ++r) {
        double num = 0, den = 0;
        for (int i = 0; i < s.head_dim; ++i) {
          const double a = bf16_to_float(got[size_t(r) * s.head_dim + i]);
          const double e = bf16_to_float(ref[size_t(r) * s.head_dim + i]);
          ASSERT_FALSE(std::isnan(a)) << "step " << step << " layer " << l << " row " << r;
          num += (a - e) * (a - e);
          den += e * e;
        }
        ASSERT_LT(std::sqrt(num / den), 2e-2) << "step " << step << " layer " << l << " row " << r;
      }
    }
  }
  const EngineStats st = ge->stats();
  uint64_t rows = 0;
  for (int step = 1; step <= steps; ++step)
    for (int b = 0; b < batch; ++b) rows += uint64_t(prompt[b] + step) * s.num_kv_heads * s.num_layers;
  EXPECT_EQ(st.kv_rows_read, rows);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* p : {(void*)dq, (void*)dk, (void*)dv, (void*)dout, ws}) cudaFree(p);
}

// A workspace pointer that is not 256-byte aligned is refused with an error that says so, and
// an aligned one inside the same allocation is taken.
TEST(RuntimeCuda, WorkspaceMustBeAligned) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const ModelShape s = llama_shape(1);
  EngineConfig cfg;
  cfg.max_batch = 2;
  for (Method m : {Method::Dense, Method::Tactic}) {
    auto e = make_engine(m, s, cfg);
    const size_t bytes = e->workspace_bytes();
    ASSERT_GT(bytes, 0u);
    char* ws = nullptr;
    KVS_CUDA_CHECK(cudaMalloc(&ws, bytes + Engine::kWorkspaceAlignment));
    try {
      e->bind_workspace({ws + 16, bytes});
      ADD_FAILURE() << to_string(m) << ": a workspace 16 bytes past an allocation was bound";
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find("256-byte aligned"), std::string::npos) << err.what();
    }
    EXPECT_NO_THROW(e->bind_workspace({ws + Engine::kWorkspaceAlignment, bytes}));
    KVS_CUDA_CHECK(cudaFree(ws));
  }
}

// set_lengths and release, called while a kernel queued on a non-blocking stream has yet to
// read what they overwrite, wait for it: the kernel reads the values from before the call.
// (A bare cudaMemcpy on the legacy stream does not wait for a non-blocking stream, so without
// the wait the kernel, spinning for about 50 ms, would read the new values.)
TEST(RuntimeCuda, CacheHostCopiesWaitForWorkQueuedOnAnyStream) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelShape one_layer;
  one_layer.num_layers = 1;
  one_layer.num_kv_heads = 1;
  one_layer.head_dim = 64;
  KVCache cache(test::cache_config(one_layer, 16, 2, 64, Device::Cuda));
  cache.reserve(1, 64);  // pages 0-3: slot 0's first page is then not 0, which release writes
  cache.reserve(0, 64);
  cache.set_lengths({10});
  std::vector<int32_t> table(1);
  KVS_CUDA_CHECK(
      cudaMemcpy(table.data(), cache.view(0).page_table, sizeof(int32_t), cudaMemcpyDeviceToHost));
  ASSERT_NE(table[0], 0) << "the test needs slot 0's first page to be a nonzero page id";
  cudaStream_t s = nullptr;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int32_t* out = to_device(std::vector<int32_t>{-1, -1});
  const long long cycles = 100'000'000;  // about 50 ms
  test::spin_then_copy<<<1, 1, 0, s>>>(cache.view(0).seq_lens, out, cycles);
  KVS_CUDA_CHECK(cudaGetLastError());
  cache.set_lengths({20});
  test::spin_then_copy<<<1, 1, 0, s>>>(cache.view(0).page_table, out + 1, cycles);
  KVS_CUDA_CHECK(cudaGetLastError());
  cache.release(0);
  KVS_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<int32_t> seen(2);
  KVS_CUDA_CHECK(cudaMemcpy(seen.data(), out, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(seen[0], 10) << "set_lengths overwrote the lengths under a kernel queued before it";
  EXPECT_EQ(seen[1], table[0])
      << "release overwrote the page table under a kernel queued before it";
  KVS_CUDA_CHECK(cudaFree(out));
  KVS_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace kvs
