// Kernel launches with Hopper launch attributes, in one place.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

namespace kvs::kernels {

// The current device's SM count, read once per device and cached, so that a captured decode
// step that sizes its grids by it does nothing but launch.
inline cudaError_t sm_count(int* out) {
  static std::mutex mu;
  static std::map<int, int> cache;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it == cache.end()) {
    int sms = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    it = cache.emplace(dev, sms).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// CTAs of `kernel` (threads and dynamic shared memory as given) resident per SM on the current
// device, read once per (device, kernel, smem) and cached; it also lets the kernel take more
// than 48 KB of dynamic shared memory: as much as the device allows, since the attribute is
// the kernel's, not the launch's (set to `smem` itself, a kernel whose size varies by call
// failed to launch at a size cached before a smaller one). None of the calls is stream work,
// so a captured launch may make them.
inline cudaError_t resident_ctas_per_sm(const void* kernel, int threads, size_t smem, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, kernel, smem);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int optin = 0;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes attrs{};
    err = cudaFuncGetAttributes(&attrs, kernel);
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - int(attrs.sharedSizeBytes));
    if (err != cudaSuccess) return err;
    int ctas = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem);
    if (err != cudaSuccess) return err;
    if (ctas < 1) return cudaErrorInvalidConfiguration;
    it = cache.emplace(key, ctas).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch: the
// kernel's CTAs may become resident once every CTA of the kernel before it on the stream has
// executed griddepcontrol.launch_dependents (or exited), and must execute griddepcontrol.wait
// before reading anything that kernel writes. Capturable in a CUDA graph.
template <typename... Params, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

}  // namespace kvs::kernels
