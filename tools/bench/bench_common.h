// Pieces every kvs-bench* program shares: device buffers, random fills, timers, the median
// they report, parsing of count lists such as --contexts 8K,128K, and the --json report.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/cuda_check.h"
#include "tools/common/cli.h"

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
// (after 3 untimed replays). Instantiated to honour its kernel nodes' priorities, as the
// README asks of a decode graph (AttentionPredictor's step outranks its branches).
template <typename Body>
float time_graph(cudaStream_t stream, int iters, Body body) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  body();
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
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

// Parses the value of --<option>, "8K,32K,1M,1000" (K = 1024, M = 1024 * 1024; empty items
// skipped), into positive counts up to 2^30; throws naming the option and the bad item.
std::vector<int> parse_counts(const std::string& text, const char* option);

// A JSON number (NaN and infinities become null: JSON has neither) or string. Implicit, so
// that fields read {"batch", 8}, {"mode", "gpu"}.
class JsonValue {
 public:
  template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  JsonValue(T number) : text_(number_text(double(number))) {}
  JsonValue(const std::string& s);
  JsonValue(const char* s) : JsonValue(std::string(s)) {}
  const std::string& text() const { return text_; }

 private:
  static std::string number_text(double v);
  std::string text_;
};

// One JSON object whose fields keep the order they were given in:
// JsonObject{{"context", 131072}, {"mode", "gpu"}}.
class JsonObject {
 public:
  struct Field {
    std::string key;
    JsonValue value;
  };
  JsonObject(std::initializer_list<Field> fields = {}) { add(fields); }
  JsonObject& add(std::initializer_list<Field> fields);
  std::string text() const;  ///< {"key": value, ...}

 private:
  std::vector<Field> fields_;
};

// What every kvs-bench* program writes with --json FILE (docs/formats.md, "Benchmark
// results"): {"meta": {...}, "rows": [{...}, ...], "skipped": ["...", ...]}. meta starts with
// impl, device (the current CUDA device's name) and command; the program adds its shapes and
// knobs. Each row and each skipped note rewrites the file (under a temporary name, then
// renamed), so a run cut short by a time limit leaves the rows done so far. With an empty
// path nothing is written.
class BenchReport {
 public:
  BenchReport(const std::string& impl, const std::string& command, std::string path);
  JsonObject& meta() { return meta_; }
  void add_row(const JsonObject& row);
  void add_skipped(const std::string& note);
  void save() const;  ///< throws naming the path when it cannot be written

 private:
  std::string path_;
  JsonObject meta_;
  std::vector<JsonObject> rows_;
  std::vector<std::string> skipped_;
};

}  // namespace kvs::bench
