// CPU reference of MAC-Attention (mac.h): exact fp64 attention through attend_cpu, merges
// through merge_state_cpu, ring rounding (bf16 o, fp32 lse) as on the GPU.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/mac/mac.h"

namespace kvs::kernels::mac {
namespace {

// Total variance of the head's queries from the running means (fp32, as on the GPU).
float running_variance(const RingState& st, int b, int h) {
  const float* mean = st.q_mean + st.head(b, h) * st.head_dim;
  float m2 = 0.f;
  for (int i = 0; i < st.head_dim; ++i) m2 += mean[i] * mean[i];
  return st.q_sq[st.head(b, h)] - m2;
}

void update_running_means(const RingState& st, const MatchParams& p, int b, int h,
                          const bf16* q_pre) {
  const int d = st.head_dim;
  float* mean = st.q_mean + st.head(b, h) * d;
  const float w = stats_weight(st.q_count + st.head(b, h), p.stats_horizon);
  float sq = 0.f;
  for (int i = 0; i < d; ++i) {
    const float x = bf16_to_float(q_pre[i]);
    sq += x * x;
    mean[i] += w * (x - mean[i]);
  }
  float& s = st.q_sq[st.head(b, h)];
  s += w * (sq - s);
}

std::vector<int32_t> token_range(int begin, int end) {
  std::vector<int32_t> t(size_t(std::max(end - begin, 0)));
  std::iota(t.begin(), t.end(), begin);
  return t;
}

// Attends query head h (post-RoPE q row) of sequence b over tokens [begin, end).
void attend_range(const bf16* q_row, const PagedKV& kv, int b, int kv_head, int begin, int end,
                  double scale, std::vector<double>& o, double* lse) {
  if (begin >= end) {  // attend_cpu reads a null token list as "every token"
    std::fill(o.begin(), o.end(), 0.0);
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<float> qf(static_cast<size_t>(kv.head_dim));
  for (int i = 0; i < kv.head_dim; ++i) qf[size_t(i)] = bf16_to_float(q_row[i]);
  const std::vector<int32_t> tokens = token_range(begin, end);
  attend_cpu(qf.data(), kv, b, kv_head, tokens.data(), int(tokens.size()), scale, o.data(), lse);
}

void write_entry(const RingState& st, int b, int slot, int h, const std::vector<double>& o,
                 double lse, const bf16* q_pre) {
  const int d = st.head_dim;
  const int64_t r = st.row(b, slot, h);
  for (int i = 0; i < d; ++i) {
    st.o[r * d + i] = float_to_bf16(float(o[size_t(i)]));
    st.q[r * d + i] = q_pre[i];
  }
  st.lse[r] = float(lse);
}

}  // namespace

MatchResult match_cpu(const RingState& st, const MatchParams& p, int b, int h, int t,
                      const bf16* q_pre) {
  const int d = st.head_dim, W = st.window;
  MatchResult r;
  if (t < p.min_context) return r;  // not eligible: the scan is skipped on the GPU too
  for (int j = std::max(0, t - W); j < t; ++j) {
    const int slot = j % W;
    if (st.pos[int64_t(b) * W + slot] != j) continue;
    const bf16* x = st.q + st.row(b, slot, h) * d;
    float d2 = 0.f;
    for (int i = 0; i < d; ++i) {
      const float diff = bf16_to_float(q_pre[i]) - bf16_to_float(x[i]);
      d2 += diff * diff;
    }
    if (d2 < r.d2) {  // ascending positions: a tie keeps the older one
      r.d2 = d2;
      r.pos = j;
    }
  }
  r.threshold = match_threshold(p, h, d, running_variance(st, b, h), st.q_count[st.head(b, h)]);
  r.hit = r.pos >= 0 && r.d2 < r.threshold &&
          std::isfinite(st.lse[st.row(b, r.pos % W, h)]);
  return r;
}

void reset_cpu(const RingState& st, int batch) {
  const int64_t heads = int64_t(batch) * st.num_q_heads;
  std::fill(st.pos, st.pos + int64_t(batch) * st.window, -1);
  std::fill(st.q_mean, st.q_mean + heads * st.head_dim, 0.f);
  std::fill(st.q_sq, st.q_sq + heads, 0.f);
  std::fill(st.q_count, st.q_count + heads, 0);
  std::fill(st.last_start, st.last_start + heads, 0);
  std::fill(st.last_len, st.last_len + batch, 0);
}

void decode_cpu(const RingState& st, const MatchParams& p, const bf16* q, const bf16* q_pre,
                int num_q_heads, const PagedKV& kv, double scale, bf16* out, float* lse,
                uint64_t* counters) {
  const int d = st.head_dim, W = st.window, Hq = num_q_heads;
  const int group = Hq / kv.num_kv_heads;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<MatchResult> match(static_cast<size_t>(Hq));
  std::vector<double> o_new(static_cast<size_t>(d)), o_part(o_new), o_entry(o_new);
  for (int b = 0; b < kv.batch; ++b) {
    const int len = kv.seq_lens[b];
    st.last_len[b] = len;
    if (len == 0) {  // nothing to attend and no position to write
      for (int h = 0; h < Hq; ++h) {
        const int64_t row = st.head(b, h);
        for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(0.f);
        if (lse) lse[row] = -INFINITY;
        st.last_start[row] = 0;
      }
      continue;
    }
    const int t = len - 1, et = cache_end(t, p.band);
    // Every head matches against the ring as it was before this step's writes.
    for (int h = 0; h < Hq; ++h) match[size_t(h)] = match_cpu(st, p, b, h, t, q_pre + st.head(b, h) * d);
    for (int kvh = 0; kvh < kv.num_kv_heads; ++kvh) {
      int span_start = et;
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const MatchResult& m = match[size_t(h)];
        const int start = m.hit ? cache_end(m.pos, p.band) : 0;
        st.last_start[st.head(b, h)] = start;
        span_start = std::min(span_start, start);
        const int64_t row = st.head(b, h);
        const bf16* q_row = q + row * d;
        const bf16* qp_row = q_pre + row * d;
        // new = A_t([start, E(t))) merged with the reused entry on a hit.
        double lse_new;
        attend_range(q_row, kv, b, kvh, start, et, scale, o_new, &lse_new);
        if (m.hit) {
          const int64_t r = st.row(b, m.pos % W, h);
          for (int i = 0; i < d; ++i) o_entry[size_t(i)] = bf16_to_float(st.o[r * d + i]);
          merge_state_cpu(o_new.data(), &lse_new, o_entry.data(), double(st.lse[r]), d);
          if (counters) {
            ++counters[kHeadHits];
            counters[kSelectionBytes] += uint64_t(d) * sizeof(bf16) + sizeof(float);
          }
        }
        // out = merge(new, A_t([E(t), t])), from the unrounded new.
        double lse_tail;
        attend_range(q_row, kv, b, kvh, et, len, scale, o_part, &lse_tail);
        std::vector<double> o_out = o_new;
        double lse_out = lse_new;
        merge_state_cpu(o_out.data(), &lse_out, o_part.data(), lse_tail, d);
        for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(float(o_out[size_t(i)]));
        if (lse) lse[row] = lse_out == neg_inf ? -INFINITY : float(lse_out);
        write_entry(st, b, t % W, h, o_new, lse_new, qp_row);
        update_running_means(st, p, b, h, qp_row);
      }
      if (counters) {
        counters[kRowsRead] += uint64_t(len - span_start);
        counters[kRowsContext] += uint64_t(len);
      }
    }
    if (counters) {
      counters[kHeadSteps] += uint64_t(Hq);
      if (t >= p.min_context) {
        int scanned = 0;
        for (int j = std::max(0, t - W); j < t; ++j) scanned += st.pos[int64_t(b) * W + j % W] == j;
        counters[kSelectionBytes] += uint64_t(scanned) * Hq * d * sizeof(bf16);
      }
    }
    st.pos[int64_t(b) * W + t % W] = t;
  }
}

void fill_entries_cpu(const RingState& st, const MatchParams& p, int b, const bf16* q,
                      const bf16* q_pre, int n, int num_q_heads, const PagedKV& kv,
                      double scale) {
  const int d = st.head_dim, W = st.window;
  const int group = num_q_heads / kv.num_kv_heads;
  const int p0 = kv.seq_lens[b] - n;
  std::vector<double> o(static_cast<size_t>(d));
  for (int i = 0; i < n; ++i) {
    const int pos = p0 + i;
    for (int h = 0; h < num_q_heads; ++h) {
      const int64_t row = int64_t(i) * num_q_heads + h;
      double l;
      attend_range(q + row * d, kv, b, h / group, 0, cache_end(pos, p.band), scale, o, &l);
      write_entry(st, b, pos % W, h, o, l, q_pre + row * d);
      update_running_means(st, p, b, h, q_pre + row * d);
    }
    st.pos[int64_t(b) * W + pos % W] = pos;
  }
}

}  // namespace kvs::kernels::mac
