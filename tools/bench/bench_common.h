// Pieces every kvs-bench* program shares: device buffers, random fills, timers, the median
// they report, and parsing of count lists such as --contexts 8K,128K.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/cuda_check.h"

namespace kvs::bench {

// Device memory for `n` elements of T (at least one, so empty buffers still have an
// address), freed on destruction.
template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> get() const {  // copies to the host (synchronizes)
    std::vector<T> h(n);
    KVS_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Fills x[0, n) with bf16 uniform in [-2, 2) from a per-element hash of (index, seed): cheap
// enough for many GB and never zero. Runs on the legacy default stream.
void fill_random(bf16* x, size_t n, uint32_t seed);

#ifdef __CUDACC__
// MurmurHash3's 32-bit finalizer: well mixed and cheap, for per-element synthetic data.
__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

// A hash of element index i (all 64 bits) under `seed`.
__device__ __forceinline__ uint32_t hash_index(uint64_t i, uint32_t seed) {
  return fmix32(uint32_t(i) * 0x9E3779B1u ^ uint32_t(i >> 32) * 0x85EBCA77u ^ seed);
}
#endif

float median(std::vector<float> v);

// Median milliseconds of `iters` calls of launch(), each between two events on `stream`.
template <typename F>
float median_event_ms(cudaStream_t stream, int iters, F&& launch) {
  cudaEvent_t e0, e1;
  KVS_CUDA_CHECK(cudaEventCreate(&e0));
  KVS_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    KVS_CUDA_CHECK(cudaEventRecord(e0, stream));
    launch();
    KVS_CUDA_CHECK(cudaEventRecord(e1, stream));
    KVS_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0.f;
    KVS_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(ms);
}

// Median milliseconds of `iters` replays of a CUDA graph captured from `body` on `stream`
// (after 3 untimed replays).
template <typename Body>
float time_graph(cudaStream_t stream, int iters, Body body) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  body();
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  const float ms =
      median_event_ms(stream, iters, [&] { KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms;
}

// Median milliseconds of `iters` eager calls of fn after `warmup` untimed ones. For work a
// graph cannot capture (host threads, host syncs).
template <typename F>
float time_calls(F&& fn, int warmup, int iters, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  return median_event_ms(stream, iters, fn);
}

// Parses the command line into the variables `desc` binds. Prints `desc` and returns false
// when --help was given (the caller then exits 0); throws on an unknown or bad option.
bool parse_options(int argc, char** argv, const boost::program_options::options_description& desc);

// Parses the value of --<option>, "8K,32K,1M,1000" (K = 1024, M = 1024 * 1024; empty items
// skipped), into positive counts up to 2^30; throws naming the option and the bad item.
std::vector<int> parse_counts(const std::string& text, const char* option);

}  // namespace kvs::bench
