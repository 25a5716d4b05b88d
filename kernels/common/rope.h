// Rotary position embedding in the Hugging Face "rotate_half" layout: dimension i pairs
// with i + head_dim/2. The angle for position p and pair i is float(p) * inv_freq[i],
// computed in fp32 as transformers does, then rotated with fp32 cos/sin.
// inv_freq (head_dim/2 values) comes from ModelShape (artifacts/model_shape.h), the one
// place where RoPE theta and scaling (default, linear, llama3) become frequencies.
// RoPE is a rotation, so the inverse (de-RoPE) is the rotation by the negative angle.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/bf16.h"

namespace kvs::kernels {

// In place on x [num_tokens, num_heads, head_dim] (contiguous); positions [num_tokens].
void rope_cpu(float* x, int num_tokens, int num_heads, int head_dim, const int32_t* positions,
              const float* inv_freq, bool inverse);

// CUDA, in place on bf16 x [num_tokens, num_heads, head_dim] with row stride token_stride
// (elements between consecutive tokens); positions and inv_freq are device pointers.
// fp32 math, one rounding to bf16 per element.
cudaError_t rope_cuda(bf16* x, int num_tokens, int num_heads, int head_dim,
                      int64_t token_stride, const int32_t* positions, const float* inv_freq,
                      bool inverse, cudaStream_t stream);

}  // namespace kvs::kernels
