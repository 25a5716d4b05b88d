#include <cstring>

#include "kernels/common/kv_update.h"

namespace kvs::kernels {

void kv_begin_step_cpu(int32_t* seq_lens, int batch) {
  for (int b = 0; b < batch; ++b) seq_lens[b] += 1;
}

void kv_append_cpu(const PagedKV& kv, const bf16* k_new, const bf16* v_new) {
  const size_t row = size_t(kv.head_dim) * sizeof(bf16);
  for (int b = 0; b < kv.batch; ++b) {
    const int pos = kv.seq_lens[b] - 1;
    if (pos < 0) continue;
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const int64_t src = (int64_t(b) * kv.num_kv_heads + h) * kv.head_dim;
      const int64_t dst = kv.offset(b, pos, h);
      std::memcpy(const_cast<bf16*>(kv.k) + dst, k_new + src, row);
      std::memcpy(const_cast<bf16*>(kv.v) + dst, v_new + src, row);
    }
  }
}

}  // namespace kvs::kernels
