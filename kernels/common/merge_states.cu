// Host launchers of merge_states.h; the merge math itself is in merge_states.cuh.
#include <cstdint>

#include "kernels/common/merge_states.cuh"
#include "kernels/common/merge_states.h"

namespace kvs::kernels {
namespace {

constexpr int kWarpsPerBlock = 4;

// One warp per row: lanes split the states to build the merged lse, then split the dims.
__global__ void merge_states_kernel(const float* v, const float* s, int num_states, int rows,
                                    int head_dim, float* v_out, float* s_out) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // warp-uniform
  LseAccumulator acc;
  for (int i = lane; i < num_states; i += 32) acc.add(s[int64_t(i) * rows + row]);
  const float lse = warp_merge_lse(acc).lse();
  for (int d = lane; d < head_dim; d += 32) {
    float o = 0.f;
    for (int i = 0; i < num_states; ++i) {
      const int64_t state_row = int64_t(i) * rows + row;
      const float w = merge_weight(s[state_row], lse);
      if (w > 0.f) o = fmaf(w, v[state_row * head_dim + d], o);
    }
    v_out[int64_t(row) * head_dim + d] = o;
  }
  if (s_out && lane == 0) s_out[row] = lse;
}

// One warp per row; s[row] is overwritten only after every lane has read it.
__global__ void merge_state_in_place_kernel(float* v, float* s, const float* v_other,
                                            const float* s_other, int rows, int head_dim) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float lse_a = s[row], lse_b = s_other[row];
  if (lse_b == -INFINITY) return;  // merging an empty state changes nothing
  LseAccumulator acc;
  acc.add(lse_a);
  acc.add(lse_b);
  const float lse = acc.lse();
  const float wa = merge_weight(lse_a, lse), wb = merge_weight(lse_b, lse);
  float* o = v + int64_t(row) * head_dim;
  const float* o_b = v_other + int64_t(row) * head_dim;
  for (int d = lane; d < head_dim; d += 32) o[d] = (wa > 0.f ? wa * o[d] : 0.f) + wb * o_b[d];
  __syncwarp();
  if (lane == 0) s[row] = lse;
}

}  // namespace

cudaError_t merge_states_cuda(const float* v, const float* s, int num_states, int rows,
                              int head_dim, float* v_out, float* s_out, cudaStream_t stream) {
  if (num_states < 0 || rows < 0 || head_dim <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!v_out || (num_states > 0 && (!v || !s))) return cudaErrorInvalidValue;
  const int blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  merge_states_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(v, s, num_states, rows, head_dim,
                                                                  v_out, s_out);
  return cudaGetLastError();
}

cudaError_t merge_state_in_place_cuda(float* v, float* s, const float* v_other,
                                      const float* s_other, int rows, int head_dim,
                                      cudaStream_t stream) {
  if (rows < 0 || head_dim <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!v || !s || !v_other || !s_other) return cudaErrorInvalidValue;
  const int blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  merge_state_in_place_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(v, s, v_other, s_other,
                                                                          rows, head_dim);
  return cudaGetLastError();
}

}  // namespace kvs::kernels
