#include "runtime/dense_engine.h"

#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {

DenseEngine::DenseEngine(const ModelShape& shape, const EngineConfig& config)
    : Engine(shape, config) {
  if (config_.backend == Backend::Cuda && config_.collect_stats) device_rows_ = DeviceCounters(1);
}

size_t DenseEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  return kernels::dense_decode_workspace_bytes(config_.max_batch, shape_.num_q_heads,
                                               shape_.head_dim);
}

void DenseEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv,
                         bf16* out, float* lse, cudaStream_t stream) {
  check_decode_args(layer, kv, q, out);
  const float scale = float(shape_.scale());
  ++host_stats_.decode_calls;
  if (config_.backend == Backend::Cuda) {
    KVS_CUDA_CHECK(kernels::dense_decode_cuda(q, shape_.num_q_heads, kv, scale, out, lse,
                                              workspace_.ptr, workspace_.bytes, stream));
    if (device_rows_)
      KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, kv.num_kv_heads,
                                                 device_rows_.get(), stream));
    return;
  }
  const size_t rows = size_t(kv.batch) * shape_.num_q_heads;
  std::vector<float> o(rows * shape_.head_dim), l(rows);
  kernels::dense_decode_cpu(q, shape_.num_q_heads, kv, scale, o.data(), l.data());
  for (size_t i = 0; i < o.size(); ++i) out[i] = float_to_bf16(o[i]);
  if (lse)
    for (size_t i = 0; i < rows; ++i) lse[i] = l[i];
  for (int b = 0; b < kv.batch; ++b) {
    host_stats_.kv_rows_read += uint64_t(kv.seq_lens[b]) * kv.num_kv_heads;
    host_stats_.kv_rows_context += uint64_t(kv.seq_lens[b]) * kv.num_kv_heads;
  }
}

EngineStats DenseEngine::stats() const {
  EngineStats s = host_stats_;
  if (device_rows_) s.kv_rows_read = s.kv_rows_context = device_rows_.read()[0];
  return s;
}

void DenseEngine::reset_stats() {
  host_stats_ = EngineStats{};
  device_rows_.reset();
}

}  // namespace kvs
