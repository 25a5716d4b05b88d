// Device-side bookkeeping the CUDA engines share: counter arrays for EngineStats, device
// allocation, and reading a decode's per-(sequence, kv head) selection back for last_read().
// Implementation support for the engines in runtime/, not part of the engine API
// (runtime/engine.h) that callers program against.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/common/stream_fork.h"
#include "kernels/tactic/tactic.h"
#include "runtime/engine.h"

namespace kvs {

// cudaMalloc of `count` elements (at least one, so a zero-sized array still has an address
// kernels may be handed); throws on failure.
template <typename T>
T* device_alloc(int64_t count) {
  void* p = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(&p, size_t(std::max<int64_t>(count, 1)) * sizeof(T)));
  return static_cast<T*>(p);
}

// The stream and events of a kernels::StreamFork, created at construction (a non-blocking
// stream, at the device's least priority or its greatest; events without timing) and destroyed
// after the side stream drains. Kernels captured from the side stream keep its priority on
// their graph nodes.
class OwnedStreamFork {
 public:
  // greatest_priority: the device's greatest stream priority; else the least, raised by
  // `raise` levels (at most to the greatest).
  explicit OwnedStreamFork(bool greatest_priority = false, int raise = 0);
  ~OwnedStreamFork();
  OwnedStreamFork(const OwnedStreamFork&) = delete;
  OwnedStreamFork& operator=(const OwnedStreamFork&) = delete;

  const kernels::StreamFork& get() const { return fork_; }

 private:
  kernels::StreamFork fork_;
};

// Throws, prefixed by `who` ("tactic engine prefill: "), when a prefill's layer is outside
// the model, its batch outside [1, max_batch], or the cache's kv heads or head dim are not
// the model's.
void check_prefill_args(const std::string& who, int layer, const PagedKV& kv,
                        const ModelShape& shape, int max_batch);

// kv.seq_lens on the host: read on `stream` and synchronized for Backend::Cuda, copied for
// Backend::Cpu.
std::vector<int32_t> host_seq_lens(const PagedKV& kv, Backend backend, cudaStream_t stream);

// Runs launch(ws) with a temporary device workspace of `bytes`, for steps outside any graph
// (prefill): waits for `stream` before the workspace is freed, then throws on the launch's
// error or the wait's. launch returns a cudaError_t and does not throw.
template <typename Launch>
void with_temporary_workspace(size_t bytes, cudaStream_t stream, Launch launch) {
  void* ws = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(&ws, std::max<size_t>(bytes, 1)));
  const cudaError_t err = launch(ws);
  const cudaError_t sync = cudaStreamSynchronize(stream);
  cudaFree(ws);
  KVS_CUDA_CHECK(err);
  KVS_CUDA_CHECK(sync);
}

// The engines' inspection copies (stats, last_read and the other read-backs) from the device:
// waits for the whole device first, so that what a decode queued on any stream has written
// is there. A plain cudaMemcpy waits for the legacy default stream and the blocking streams
// only, and a caller's decode stream may be non-blocking (PyTorch's are), which made stats()
// and last_read() return the values from before that decode. Not for use while a stream is
// being captured.
void copy_to_host(void* dst, const void* src, size_t bytes);

// The engines' uploads outside a step (weights, knobs, a prefill's host-built tables): returns
// once the bytes are in place. A cudaMemcpy from pageable host memory returns once they are
// staged, before the DMA lands, on the legacy stream, which work queued next on a
// non-blocking stream is not ordered after.
void copy_to_device(void* dst, const void* src, size_t bytes);
// Zeroes device memory outside a step (fresh state, counters) and returns once it is zero: a
// cudaMemset of device memory returns before it runs, on the legacy stream, so a prefill or
// decode queued next on a non-blocking stream could run first and be zeroed after.
void zero_on_device(void* dst, size_t bytes);

// A zeroed array of 64-bit counters on the device that decode kernels atomically add to, so
// collecting stats costs no host sync inside a step. Empty (get() null) when stats are off
// or on the CPU backend; kernels take a null pointer as "do not count".
class DeviceCounters {
 public:
  DeviceCounters() = default;
  explicit DeviceCounters(int count);  // allocates and zeroes `count` counters
  ~DeviceCounters();
  DeviceCounters(const DeviceCounters&) = delete;
  DeviceCounters& operator=(const DeviceCounters&) = delete;
  DeviceCounters(DeviceCounters&& o) noexcept;
  DeviceCounters& operator=(DeviceCounters&& o) noexcept;

  explicit operator bool() const { return ptr_ != nullptr; }
  unsigned long long* get() const { return ptr_; }
  int size() const { return count_; }

  // The counters' values, once every stream's work has landed (copy_to_host).
  std::vector<uint64_t> read() const;
  // Copies counters [rows_read], [selection_bytes], [context_rows] into s.
  void read_into(EngineStats* s, int rows_read, int selection_bytes, int context_rows) const;
  void reset();  // zeroes every counter, once no kernel of any stream may still add to them

 private:
  unsigned long long* ptr_ = nullptr;
  int count_ = 0;
};

// The token lists a Selection holds for sequence b, one per kv head ([Hkv][count]), copied
// from the device by copy_to_host.
std::vector<std::vector<int32_t>> read_kv_head_lists(const kernels::tactic::Selection& sel, int b,
                                                     int num_kv_heads);

// last_read()'s per-query-head form of per-kv-head lists: each kv head's list repeated for
// the `group_size` query heads that share it, sorted ascending first when `sort` (methods
// whose lists already ascend pass false).
std::vector<std::vector<int32_t>> per_query_head_lists(
    std::vector<std::vector<int32_t>> per_kv_head, int group_size, bool sort);

}  // namespace kvs
