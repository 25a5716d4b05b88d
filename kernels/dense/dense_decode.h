// Dense decode attention over a paged bf16 KV cache: the baseline every method is measured
// against and the building block of several. One query token per sequence.
//
// Shapes: q [batch, num_q_heads, head_dim] bf16; GQA maps query head h to kv head
// h / (num_q_heads / num_kv_heads). Output o [batch, num_q_heads, head_dim], lse
// [batch, num_q_heads] fp32 natural log (lse = -inf and o = 0 for an empty sequence).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"

namespace kvs::kernels {

// Exact attention of one query head (q: head_dim fp32 values) over tokens of sequence b in
// kv head kv_head: the listed tokens, or all seq_lens[b] tokens when tokens == nullptr.
// fp64 accumulation; o gets head_dim values, *lse the natural-log sum-exp (-inf if empty).
// Every CPU reference (dense and each method's) attends through this one function.
void attend_cpu(const float* q, const PagedKV& kv, int b, int kv_head, const int32_t* tokens,
                int num_tokens, double scale, double* o, double* lse);

// attend_cpu with a per-token logit shift: token j's logit is q.k * scale + logit_offset[j]
// (logit_offset null: no shift, which is attend_cpu). Importance-weighted estimators
// (MagicPIG: -log u_j) attend through it; attend_cpu is this with a null offset.
void attend_cpu_shifted(const float* q, const PagedKV& kv, int b, int kv_head,
                        const int32_t* tokens, int num_tokens, double scale,
                        const double* logit_offset, double* o, double* lse);

// CPU reference: exact dense decode (fp64 accumulation), any head_dim and group size.
// o [batch, num_q_heads, head_dim] fp32, lse [batch, num_q_heads] fp32 (may be null).
void dense_decode_cpu(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                      float* o, float* lse);

// CUDA split-KV ("flash decoding") decode. The number of splits per sequence is chosen on
// the device from seq_lens, so the call does no host sync and can be captured in a CUDA
// graph. workspace is caller-owned device memory of at least dense_decode_workspace_bytes()
// for the same (max_batch, num_q_heads, head_dim). lse may be null.
// Supports head_dim 64 and 128 and group sizes 1..8.
size_t dense_decode_workspace_bytes(int max_batch, int num_q_heads, int head_dim);

cudaError_t dense_decode_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                              bf16* o, float* lse, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

}  // namespace kvs::kernels
