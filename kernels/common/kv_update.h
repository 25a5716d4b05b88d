// Device-side updates of a paged KV cache during decode: grow every sequence by one token,
// then write that token's K and V rows through the page table. No host sync, so the step
// can be captured in a CUDA graph; the CPU versions do the same on host memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"

namespace kvs::kernels {

// seq_lens[b] += 1 for b < batch.
cudaError_t kv_begin_step_cuda(int32_t* seq_lens, int batch, cudaStream_t stream);
void kv_begin_step_cpu(int32_t* seq_lens, int batch);

// For b < kv.batch: writes k_new[b], v_new[b] ([batch, Hkv, d]) at token seq_lens[b] - 1.
// kv.k / kv.v are written through (the view is const only for readers).
cudaError_t kv_append_cuda(const PagedKV& kv, const bf16* k_new, const bf16* v_new,
                           cudaStream_t stream);
void kv_append_cpu(const PagedKV& kv, const bf16* k_new, const bf16* v_new);

// counter += sum over b < batch of seq_lens[b] * rows_per_token, on the device: engines'
// statistics without a device-to-host copy inside a step.
cudaError_t kv_count_rows_cuda(const int32_t* seq_lens, int batch, int rows_per_token,
                               unsigned long long* counter, cudaStream_t stream);

}  // namespace kvs::kernels
