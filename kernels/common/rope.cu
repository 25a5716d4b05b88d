// CUDA RoPE (rope.h); the arithmetic of a pair is rope_rotate_pair (rope.cuh).
#include <cuda_bf16.h>

#include "kernels/common/rope.cuh"
#include "kernels/common/rope.h"

namespace kvs::kernels {
namespace {

__global__ void rope_kernel(__nv_bfloat16* x, int num_tokens, int num_heads, int half,
                            int64_t token_stride, const int32_t* positions, const float* inv_freq,
                            bool inverse) {
  const int64_t total = int64_t(num_tokens) * num_heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(idx % half);
    const int64_t token_head = idx / half;
    const int h = int(token_head % num_heads);
    const int64_t t = token_head / num_heads;
    __nv_bfloat16* row = x + t * token_stride + int64_t(h) * 2 * half;
    const __nv_bfloat162 r =
        rope_rotate_pair(__bfloat162float(row[i]), __bfloat162float(row[i + half]), positions[t],
                         inv_freq[i], inverse);
    row[i] = r.x;
    row[i + half] = r.y;
  }
}

}  // namespace

cudaError_t rope_cuda(bf16* x, int num_tokens, int num_heads, int head_dim, int64_t token_stride,
                      const int32_t* positions, const float* inv_freq, bool inverse,
                      cudaStream_t stream) {
  if (num_tokens < 0 || num_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0)
    return cudaErrorInvalidValue;
  if (token_stride < int64_t(num_heads) * head_dim) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  if (!x || !positions || !inv_freq) return cudaErrorInvalidValue;
  const int half = head_dim / 2;
  const int64_t total = int64_t(num_tokens) * num_heads * half;
  constexpr int kThreads = 256;
  // Grid-stride: a capped grid still covers any size.
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const int grid = int(blocks < 65536 ? blocks : 65536);
  rope_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(x), num_tokens,
                                             num_heads, half, token_stride, positions, inv_freq,
                                             inverse);
  return cudaGetLastError();
}

}  // namespace kvs::kernels
