// A view of one layer's paged KV cache: raw pointers and sizes, no ownership.
//
// K and V are [num_pages, page_size, num_kv_heads, head_dim] bf16, post-RoPE keys. Sequence
// b's token t lives in page page_table[b * max_pages_per_seq + t / page_size] at row
// t % page_size. page_size == capacity is the contiguous special case. All pointers are
// device pointers for CUDA kernels and host pointers for CPU code.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/host_device.h"

namespace kvs {

struct PagedKV {
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  const int32_t* page_table = nullptr;  // [batch, max_pages_per_seq]
  const int32_t* seq_lens = nullptr;    // [batch], tokens in each sequence (new token included)
  int batch = 0;
  int num_pages = 0;
  int page_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_pages_per_seq = 0;

  // Element offset of (sequence b, token t, kv head h, dim 0) in k or v.
  KVS_HOST_DEVICE int64_t offset(int b, int t, int h) const {
    const int64_t page = page_table[int64_t(b) * max_pages_per_seq + t / page_size];
    return ((page * page_size + t % page_size) * num_kv_heads + h) * int64_t(head_dim);
  }
};

}  // namespace kvs
