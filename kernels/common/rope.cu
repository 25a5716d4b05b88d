// CUDA RoPE (rope.h). Same arithmetic as rope_cpu: fp32 angle float(p) * inv_freq[i],
// precise sincosf (not __sinf/__cosf, whose error grows with the angle: positions reach 1e5+
// radians), and products rounded separately (no FMA contraction) as the CPU computes them,
// so the two differ only by the last-ulp differences of the cos/sin implementations.
#include <cuda_bf16.h>

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
    const float angle = __fmul_rn(float(positions[t]), inv_freq[i]);
    float s, c;
    sincosf(angle, &s, &c);
    if (inverse) s = -s;
    __nv_bfloat16* row = x + t * token_stride + int64_t(h) * 2 * half;
    const float a = __bfloat162float(row[i]), b = __bfloat162float(row[i + half]);
    row[i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    row[i + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
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
