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

// Token t's page row on page `page`: page * page_size + t % page_size, the row of k and v
// before the kv head (its KV row is page_row * num_kv_heads + h). What the SAAP and Tactic
// indexes keep per member (member_rows) so that a decode skips the page table.
KVS_HOST_DEVICE int32_t page_row_on(int32_t page, int page_size, int t) {
  return int32_t(int64_t(page) * page_size + t % page_size);
}

// The same through one sequence's page table (max_pages_per_seq entries from `table`).
KVS_HOST_DEVICE int32_t page_row(const int32_t* table, int page_size, int t) {
  return page_row_on(table[t / page_size], page_size, t);
}

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

  // Page row of sequence b's token t (page_row above).
  KVS_HOST_DEVICE int32_t page_row_of(int b, int t) const {
    return page_row(page_table + int64_t(b) * max_pages_per_seq, page_size, t);
  }

  // Element offset of (page row r, kv head h, dim 0) in k or v.
  KVS_HOST_DEVICE int64_t row_offset(int32_t r, int h) const {
    return (int64_t(r) * num_kv_heads + h) * int64_t(head_dim);
  }

  // Element offset of (sequence b, token t, kv head h, dim 0) in k or v.
  KVS_HOST_DEVICE int64_t offset(int b, int t, int h) const {
    return row_offset(page_row_of(b, t), h);
  }
};

}  // namespace kvs
