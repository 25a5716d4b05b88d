#include <cuda_bf16.h>

#include "kernels/common/kv_update.h"

namespace kvs::kernels {
namespace {

__global__ void begin_step_kernel(int32_t* seq_lens, int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) seq_lens[b] += 1;
}

// One block per sequence; threads copy 16-byte chunks of the [Hkv, d] row pair.
__global__ void append_kernel(PagedKV kv, const uint4* k_new, const uint4* v_new) {
  const int b = blockIdx.x;
  const int pos = kv.seq_lens[b] - 1;
  if (pos < 0) return;
  const int chunks_per_head = kv.head_dim * int(sizeof(bf16)) / 16;
  const int chunks = kv.num_kv_heads * chunks_per_head;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int h = c / chunks_per_head, j = c % chunks_per_head;
    const int64_t dst = kv.offset(b, pos, h) * int64_t(sizeof(bf16)) / 16 + j;
    const int64_t src = int64_t(b) * chunks + c;
    reinterpret_cast<uint4*>(const_cast<bf16*>(kv.k))[dst] = k_new[src];
    reinterpret_cast<uint4*>(const_cast<bf16*>(kv.v))[dst] = v_new[src];
  }
}

__global__ void count_rows_kernel(const int32_t* seq_lens, int batch, int rows_per_token,
                                  unsigned long long* counter) {
  unsigned long long sum = 0;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) sum += unsigned(seq_lens[b]);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
  if (threadIdx.x == 0) atomicAdd(counter, sum * unsigned(rows_per_token));
}

}  // namespace

cudaError_t kv_count_rows_cuda(const int32_t* seq_lens, int batch, int rows_per_token,
                               unsigned long long* counter, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  count_rows_kernel<<<1, 32, 0, stream>>>(seq_lens, batch, rows_per_token, counter);
  return cudaGetLastError();
}

cudaError_t kv_begin_step_cuda(int32_t* seq_lens, int batch, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  begin_step_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(seq_lens, batch);
  return cudaGetLastError();
}

cudaError_t kv_append_cuda(const PagedKV& kv, const bf16* k_new, const bf16* v_new,
                           cudaStream_t stream) {
  if (kv.batch <= 0) return cudaSuccess;
  // Rows are moved as 16-byte chunks: head_dim * 2 bytes must be a multiple of 16.
  if ((kv.head_dim * sizeof(bf16)) % 16 != 0) return cudaErrorInvalidValue;
  append_kernel<<<kv.batch, 128, 0, stream>>>(kv, reinterpret_cast<const uint4*>(k_new),
                                              reinterpret_cast<const uint4*>(v_new));
  return cudaGetLastError();
}

}  // namespace kvs::kernels
