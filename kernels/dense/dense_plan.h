// The dense decode plan's arithmetic (plan_chunk in dense_decode.cu), on the host too, so that
// tests check it against the 64-bit division it replaces.
//
// The plan counts in rounds of tiles (align = warps x tile tokens, a power of two). There the
// counts fit 32 bits and the divisions are 32-bit: a 64-bit division is a long inlined
// sequence, which both of dense decode's kernels ran ahead of their work.
#pragma once

#include <cstdint>

#include "kernels/common/host_device.h"

namespace kvs::kernels::dense_plan {

// A chunk never exceeds 2^30 tokens, which keeps it an int. KV rows are int32 (the launcher
// checks), so the lengths sum to less than 2^31 unless sequences share pages, and the cap
// does not bind otherwise.
constexpr int kMaxChunkTokens = 1 << 30;

// ceil(rounds / chunks_per_head), at least 1 and at most cap_rounds. It is exactly the 64-bit
// ceil(tokens / chunks_per_head) rounded up to a multiple of align (in rounds), because
// ceil(ceil(t / a) / c) = ceil(t / (a c)). From 2^31 rounds on (2^37 tokens: shared pages only)
// it is cap_rounds, never less than the 64-bit answer, so the plan's bound on the item count
// (dense_decode.cu) holds wherever it did.
KVS_HOST_DEVICE int rounds_per_chunk(int64_t rounds, int chunks_per_head, int cap_rounds) {
  if (rounds >= (int64_t(1) << 31)) return cap_rounds;
  const uint32_t per_head = uint32_t(chunks_per_head);
  const int q = int((uint32_t(rounds) + per_head - 1) / per_head);
  return q < 1 ? 1 : q > cap_rounds ? cap_rounds : q;
}

}  // namespace kvs::kernels::dense_plan
