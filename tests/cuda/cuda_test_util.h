// Helpers shared by the CUDA tests: owning device buffers, NaN poisoning, fresh seeds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.h"

namespace kvs::test {

// A device array of n elements of T; freed on destruction.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { resize(n); }
  explicit DeviceBuffer(const std::vector<T>& host) { upload(host); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void resize(size_t n) {
    release();
    n_ = n;
    if (n > 0) KVS_CUDA_CHECK(cudaMalloc(&ptr_, n * sizeof(T)));
  }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) resize(host.size());
    if (n_ > 0)
      KVS_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0)
      KVS_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // All bits set: a NaN for float and for bf16, so an element nobody wrote is caught.
  void poison() {
    if (n_ > 0) KVS_CUDA_CHECK(cudaMemset(ptr_, 0xff, n_ * sizeof(T)));
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  void release() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = 0;
  }
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// A fresh seed per run (KVS_TEST_SEED=<n> replays one); tests print it on failure.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("KVS_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// Spins for `cycles` clocks (100M: about 50 ms at 2 GHz), then copies x[0] to *out where both
// are given: work queued on a stream ahead of what a test checks waits for it (a kernel that
// reads a buffer late, or one that holds back the calls queued behind it). One copy per test
// file (internal linkage).
static __global__ void spin_then_copy(const int32_t* x, int32_t* out, long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (x && out) *out = x[0];
}

}  // namespace kvs::test

#define KVS_SKIP_WITHOUT_CUDA()                                            \
  do {                                                                     \
    if (!::kvs::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
