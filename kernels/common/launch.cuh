// Kernel launches with Hopper launch attributes, in one place.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

namespace kvs::kernels {

// A per-device integer, read by read(dev, &value) once per device and cached in `cache`.
template <typename Read>
cudaError_t read_per_device(std::mutex& mu, std::map<int, int>& cache, int* out, Read read) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it == cache.end()) {
    int value = 0;
    err = read(dev, &value);
    if (err != cudaSuccess) return err;
    it = cache.emplace(dev, value).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// A device's SM figures, queried once per device (a process may drive several); attribute
// queries are not stream work, so a captured call may make them.
struct SmInfo {
  int sms = 0;
  int smem_per_sm = 0;  ///< shared memory of an SM, bytes
  int reserved = 0;     ///< shared memory the system reserves per resident CTA, bytes
  int optin = 0;        ///< the most one CTA may take, bytes
};
inline cudaError_t sm_info(SmInfo* out) {
  static std::mutex mu;
  static std::map<int, SmInfo> devices;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  SmInfo& known = devices[dev];
  if (known.sms == 0) {
    SmInfo q;
    e = cudaDeviceGetAttribute(&q.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&q.reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&q.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&q.sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    known = q;
  }
  *out = known;
  return cudaSuccess;
}

// The current device's SM count, read once per device and cached, so that a captured decode
// step that sizes its grids by it does nothing but launch.
inline cudaError_t sm_count(int* out) {
  static std::mutex mu;
  static std::map<int, int> cache;
  return read_per_device(mu, cache, out, [](int dev, int* sms) {
    return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  });
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

// The current device's greatest (most urgent) stream priority, read once per device and cached.
inline cudaError_t greatest_priority(int* out) {
  static std::mutex mu;
  static std::map<int, int> cache;
  return read_per_device(mu, cache, out, [](int, int* greatest) {
    int least = 0;
    return cudaDeviceGetStreamPriorityRange(&least, greatest);
  });
}

// How launch_ex launches.
struct LaunchHow {
  // A programmatic dependent launch: the kernel's CTAs may become resident once every CTA of
  // the kernel before it on the stream has executed griddepcontrol.launch_dependents (or
  // exited), and must execute griddepcontrol.wait before reading anything that kernel writes.
  bool programmatic = false;
  // At the device's greatest priority, whatever the stream's: where other streams' kernels
  // run beside it, the block scheduler gives the SMs that free up to this kernel's CTAs first.
  // A captured launch keeps the priority on its graph node, which only a graph instantiated
  // with cudaGraphInstantiateFlagUseNodePriority honours.
  bool urgent = false;
};

// kernel<<<grid, block, smem, stream>>>(args...) with the launch attributes of `how`.
// Capturable in a CUDA graph.
template <typename... Params, typename... Args>
cudaError_t launch_ex(LaunchHow how, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (how.programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (how.urgent) {
    int priority = 0;
    if (const cudaError_t e = greatest_priority(&priority); e != cudaSuccess) return e;
    attr[n].id = cudaLaunchAttributePriority;
    attr[n++].val.priority = priority;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

// launch_ex as a programmatic dependent launch (LaunchHow::programmatic).
template <typename... Params, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  return launch_ex(LaunchHow{true, false}, kernel, grid, block, smem, stream,
                   static_cast<Args&&>(args)...);
}

}  // namespace kvs::kernels
