// Error handling for CUDA calls made from host code.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace kvs {

// Throws with the failing call's text, the file and line, and CUDA's own message.
inline void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  // Clear the error state too, or the next launcher's cudaGetLastError() reports it again.
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" +
                           cudaGetErrorName(err) + ") in " + what + " at " + file + ":" +
                           std::to_string(line));
}

// True when a CUDA device can be used; false (never throws) on machines without a GPU or
// driver, so tests and tools can skip or fall back to the CPU backend.
inline bool cuda_device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

}  // namespace kvs

#define KVS_CUDA_CHECK(expr) ::kvs::cuda_check((expr), #expr, __FILE__, __LINE__)
