// Dense decode attention behind the Engine interface: the baseline, and what every method
// falls back to on its dense layers.
#pragma once

#include "runtime/engine.h"
#include "runtime/engine_support.h"

namespace kvs {

class DenseEngine : public Engine {
 public:
  DenseEngine(const ModelShape& shape, const EngineConfig& config);

  Method method() const override { return Method::Dense; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override {}
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
              float* lse, cudaStream_t stream) override;
  EngineStats stats() const override;
  void reset_stats() override;

 private:
  EngineStats host_stats_;      // CPU backend, and call counts on CUDA
  DeviceCounters device_rows_;  // CUDA: rows read, summed on the device
};

}  // namespace kvs
