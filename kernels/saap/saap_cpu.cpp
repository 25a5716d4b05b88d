// CPU reference of SAAP: exact and simple (fp64 scores and MLP accumulation). The oracle of
// the CUDA kernels and the CPU backend of SaapEngine.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/e4m3.h"
#include "kernels/common/rope.h"
#include "kernels/saap/saap.h"

namespace kvs::kernels::saap {
namespace {

double dot(const float* a, const float* b, int n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int j = 0;
  for (; j + 4 <= n; j += 4)
    for (int u = 0; u < 4; ++u) s[u] += double(a[j + u]) * b[j + u];
  for (; j < n; ++j) s[0] += double(a[j]) * b[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void check_slot(const PagedKV& kv, int b, int h, const IndexState& st, const char* who) {
  if (b < 0 || b >= kv.batch || b >= st.max_batch || h < 0 || h >= kv.num_kv_heads ||
      h >= st.num_kv_heads)
    throw std::out_of_range(std::string(who) + ": slot (b " + std::to_string(b) + ", h " +
                            std::to_string(h) + ") outside the batch / kv heads");
  if (kv.seq_lens[b] > st.max_tokens)
    throw std::out_of_range(std::string(who) + ": sequence " + std::to_string(b) + " has " +
                            std::to_string(kv.seq_lens[b]) + " tokens, the index holds " +
                            std::to_string(st.max_tokens));
}

}  // namespace

size_t mma_rows_bytes(int heads, int rows, int K, bool e4m3) {
  const int kc = e4m3 ? 32 : 16;  // columns per 16-byte load
  return size_t(heads) * size_t((rows + 15) / 16 * 16) * size_t((K + kc - 1) / kc * kc) *
         (e4m3 ? 1 : 2);
}

namespace {
// See mma_rows_bytes: T is bf16 (one 16-column tile per lane load) or uint8_t (e4m3, two).
template <class T>
void pack_fragments(const T* w, int heads, int rows, int K, T zero, T* out) {
  constexpr int kPerLane = 16 / int(sizeof(T));  // values per lane load: 8 per 16 columns
  constexpr int kc = 2 * kPerLane;               // columns per load
  const int blocks = (rows + 15) / 16, loads = (K + kc - 1) / kc;
  size_t o = 0;
  for (int h = 0; h < heads; ++h)
    for (int rb = 0; rb < blocks; ++rb)
      for (int l = 0; l < loads; ++l)
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, c = lane % 4;
          for (int j = 0; j < kPerLane; ++j) {  // tile j / 8 of the load, its word (j % 8) / 2
            const int word = (j % 8) / 2;
            const int r = rb * 16 + g + 8 * (word & 1);
            const int k = l * kc + (j / 8) * 16 + 2 * c + j % 2 + 8 * (word >> 1);
            out[o++] = r < rows && k < K ? w[(int64_t(h) * rows + r) * K + k] : zero;
          }
        }
}

// The weights of `heads` heads of rows x K, rounded to bf16 (both bf16 layouts pack these).
std::vector<bf16> rows_to_bf16(const float* w, int heads, int rows, int K) {
  std::vector<bf16> b(size_t(heads) * rows * K);
  for (size_t i = 0; i < b.size(); ++i) b[i] = float_to_bf16(w[i]);
  return b;
}
}  // namespace

void pack_mma_rows(const float* w, int heads, int rows, int K, bf16* out) {
  pack_fragments<bf16>(rows_to_bf16(w, heads, rows, K).data(), heads, rows, K, float_to_bf16(0.f),
                       out);
}

void pack_mma_rows_e4m3(const uint8_t* q, int heads, int rows, int K, uint8_t* out) {
  pack_fragments<uint8_t>(q, heads, rows, K, 0, out);
}

size_t column_blocks_bytes(int heads, int rows, int K, bool e4m3) {
  return size_t(heads) * size_t((rows + kColumnBlock - 1) / kColumnBlock * kColumnBlock) *
         size_t(K) * (e4m3 ? 1 : 2);
}

namespace {
template <class T>
void pack_columns(const T* w, int heads, int rows, int K, T zero, T* out) {
  const int blocks = (rows + kColumnBlock - 1) / kColumnBlock;
  size_t o = 0;
  for (int h = 0; h < heads; ++h)
    for (int blk = 0; blk < blocks; ++blk)
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < kColumnBlock; ++i) {
          const int r = blk * kColumnBlock + column_block_row(i);
          out[o++] = r < rows ? w[(int64_t(h) * rows + r) * K + k] : zero;
        }
}
}  // namespace

void pack_column_blocks(const float* w, int heads, int rows, int K, bf16* out) {
  pack_columns<bf16>(rows_to_bf16(w, heads, rows, K).data(), heads, rows, K, float_to_bf16(0.f),
                     out);
}

void pack_column_blocks_e4m3(const uint8_t* q, int heads, int rows, int K, uint8_t* out) {
  pack_columns<uint8_t>(q, heads, rows, K, 0, out);
}

void quantize_rows_e4m3(const float* w, int64_t rows, int K, uint8_t* q, float* scale,
                        float* dequantized) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * K;
    float amax = 0.f;
    for (int k = 0; k < K; ++k) {
      if (!std::isfinite(row[k]))
        throw std::invalid_argument("quantize_rows_e4m3: weight " + std::to_string(k) + " of row " +
                                    std::to_string(r) + " is not finite");
      amax = std::max(amax, std::fabs(row[k]));
    }
    const float s = e4m3_row_scale(amax);
    scale[r] = s;
    for (int k = 0; k < K; ++k) {
      const uint8_t v = to_e4m3(row[k], s);
      q[r * K + k] = v;
      dequantized[r * K + k] = s * from_e4m3(v);
    }
  }
}

int nearest_centroid_cpu(const float* x, const float* centroids, const float* norms, int C, int d) {
  int best = -1;
  double best_score = 0.0;
  for (int c = 0; c < C; ++c) {
    const double s = 2.0 * dot(x, centroids + size_t(c) * d, d) - double(norms[c]);
    // A score below -FLT_MAX (or NaN) wins no cluster: the GPU's rule (index_best_key).
    if (s >= -double(FLT_MAX) && (best < 0 || s > best_score)) {
      best_score = s;
      best = c;
    }
  }
  return best;
}

void deroped_key_cpu(const PagedKV& kv, int b, int h, int t, const float* inv_freq, float* out) {
  const bf16* k = kv.k + kv.offset(b, t, h);
  for (int i = 0; i < kv.head_dim; ++i) out[i] = bf16_to_float(k[i]);
  const int32_t pos = t;
  rope_cpu(out, 1, 1, kv.head_dim, &pos, inv_freq, true);
  for (int i = 0; i < kv.head_dim; ++i) out[i] = bf16_to_float(float_to_bf16(out[i]));
}

Unassigned index_prefill_cpu(const PagedKV& kv, int b, int h, const float* inv_freq,
                             const Window& w, const Router<float>& router, const IndexState& st) {
  check_slot(kv, b, h, st, "saap index_prefill_cpu");
  const int n = kv.seq_lens[b], d = kv.head_dim, C = st.num_clusters;
  const int end = std::max(w.sink, n - w.recent);
  const float* cent = router.centroids + size_t(h) * C * d;
  const float* norms = router.centroid_norms + size_t(h) * C;
  int32_t* assign = st.assign_of(b, h);
  std::vector<float> key(static_cast<size_t>(d));
  std::vector<int32_t> count(static_cast<size_t>(C) + 1, 0);
  Unassigned none;
  for (int t = w.sink; t < end; ++t) {
    deroped_key_cpu(kv, b, h, t, inv_freq, key.data());
    assign[t] = nearest_centroid_cpu(key.data(), cent, norms, C, d);
    if (assign[t] >= 0) {
      ++count[size_t(assign[t]) + 1];
    } else if (none.count++ == 0) {
      none.b = b, none.h = h, none.t = t;
    }
  }
  // Stable counting sort: members ascending within a cluster.
  for (int c = 0; c < C; ++c) count[size_t(c) + 1] += count[size_t(c)];
  int32_t* offsets = st.offsets_of(b, h);
  std::copy(count.begin(), count.end(), offsets);
  int32_t* members = st.members_of(b, h);
  for (int t = w.sink; t < end; ++t)
    if (assign[t] >= 0) members[count[size_t(assign[t])]++] = t;
  st.indexed_len[st.slot(b, h)] = end;
  st.csr_len[st.slot(b, h)] = end;
  return none;
}

bool index_step_cpu(const PagedKV& kv, int b, int h, const float* inv_freq, const Window& w,
                    const Router<float>& router, const IndexState& st) {
  check_slot(kv, b, h, st, "saap index_step_cpu");
  const int n = kv.seq_lens[b], d = kv.head_dim, C = st.num_clusters;
  int32_t& indexed = st.indexed_len[st.slot(b, h)];
  const int count = index_step_count(n, w.recent, indexed, st.index_every, st.index_phase);
  std::vector<float> key(static_cast<size_t>(d));
  for (int e = 0; e < count; ++e) {
    deroped_key_cpu(kv, b, h, indexed + e, inv_freq, key.data());
    st.assign_of(b, h)[indexed + e] =
        nearest_centroid_cpu(key.data(), router.centroids + size_t(h) * C * d,
                             router.centroid_norms + size_t(h) * C, C, d);
  }
  indexed += count;
  if (fold_due(st.fold_every, indexed, st.csr_len[st.slot(b, h)])) fold_cpu(b, h, st);
  return count > 0;
}

void fold_cpu(int b, int h, const IndexState& st) {
  const int64_t slot = st.slot(b, h);
  const int C = st.num_clusters, csr = st.csr_len[slot], F = st.fold_every;
  if (F < 1 || csr + F > st.indexed_len[slot])
    throw std::logic_error("saap fold_cpu: slot (" + std::to_string(b) + ", " + std::to_string(h) +
                           ") has " + std::to_string(st.indexed_len[slot] - csr) +
                           " post-prefill assignments, fewer than fold_every " + std::to_string(F));
  int32_t* offsets = st.offsets_of(b, h);
  int32_t* members = st.members_of(b, h);
  const int32_t* assign = st.assign_of(b, h);
  const std::vector<int32_t> old_offsets(offsets, offsets + C + 1);
  const std::vector<int32_t> old_members(members, members + old_offsets[size_t(C)]);
  std::vector<std::vector<int32_t>> fresh(static_cast<size_t>(C));
  for (int t = csr; t < csr + F; ++t)
    if (assign[t] >= 0) fresh[size_t(assign[t])].push_back(t);
  int pos = 0;
  for (int c = 0; c < C; ++c) {
    offsets[c] = pos;
    for (int i = old_offsets[size_t(c)]; i < old_offsets[size_t(c) + 1]; ++i)
      members[pos++] = old_members[size_t(i)];
    for (int t : fresh[size_t(c)]) members[pos++] = t;
  }
  offsets[C] = pos;
  st.csr_len[slot] = csr + F;
}

void mlp_probs_cpu(const Router<float>& r, int q_head, const float* q, double* probs) {
  const int d = r.head_dim, H = r.hidden, C = r.num_clusters;
  std::vector<float> hid(static_cast<size_t>(H));
  const float* w1 = r.w1 + size_t(q_head) * H * d;
  const float* b1 = r.b1 + size_t(q_head) * H;
  for (int j = 0; j < H; ++j)
    hid[size_t(j)] = float(std::max(0.0, dot(w1 + size_t(j) * d, q, d) + double(b1[j])));
  const float* w2 = r.w2 + size_t(q_head) * C * H;
  const float* b2 = r.b2 + size_t(q_head) * C;
  double m = -std::numeric_limits<double>::infinity();
  for (int c = 0; c < C; ++c) {
    probs[c] = dot(w2 + size_t(c) * H, hid.data(), H) + double(b2[c]);
    m = std::max(m, probs[c]);
  }
  double sum = 0.0;
  for (int c = 0; c < C; ++c) sum += (probs[c] = std::exp(probs[c] - m));
  for (int c = 0; c < C; ++c) probs[c] /= sum;
}

void route_scores_cpu(const Router<float>& r, int kv_head, const float* q_group, double* scores) {
  const int d = r.head_dim, C = r.num_clusters, g = r.group_size();
  std::fill(scores, scores + C, 0.0);
  if (r.use_mlp) {
    std::vector<double> p(static_cast<size_t>(C));
    for (int j = 0; j < g; ++j) {
      mlp_probs_cpu(r, kv_head * g + j, q_group + size_t(j) * d, p.data());
      for (int c = 0; c < C; ++c) scores[c] += p[size_t(c)];
    }
    return;
  }
  std::vector<float> mean(static_cast<size_t>(d), 0.0f);
  for (int i = 0; i < d; ++i) {
    double s = 0.0;
    for (int j = 0; j < g; ++j) s += q_group[size_t(j) * d + i];
    mean[size_t(i)] = float(s / g);
  }
  const float* cent = r.centroids + size_t(kv_head) * C * d;
  const float* norms = r.centroid_norms + size_t(kv_head) * C;
  for (int c = 0; c < C; ++c)
    scores[c] = 2.0 * dot(mean.data(), cent + size_t(c) * d, d) - double(norms[c]);
}

void top_clusters_cpu(const double* scores, int C, int l, int32_t* out) {
  if (l < 0 || l > C)
    throw std::invalid_argument("saap top_clusters_cpu: l = " + std::to_string(l) +
                                " outside [0, C = " + std::to_string(C) + "]");
  std::vector<int32_t> idx(static_cast<size_t>(C));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + l, idx.end(), [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + l, out);
}

std::vector<int32_t> selected_tokens_cpu(const PagedKV& kv, int b, int h, const Window& w,
                                         const IndexState& st, const int32_t* clusters, int l) {
  check_slot(kv, b, h, st, "saap selected_tokens_cpu");
  const int n = kv.seq_lens[b];
  const int indexed = st.indexed_len[st.slot(b, h)], csr = st.csr_len[st.slot(b, h)];
  std::vector<int32_t> tokens;
  for (int t = 0; t < std::min(w.sink, n); ++t) tokens.push_back(t);
  std::vector<uint8_t> chosen(static_cast<size_t>(st.num_clusters), 0);
  const int32_t* offsets = st.offsets_of(b, h);
  const int32_t* members = st.members_of(b, h);
  for (int i = 0; i < l; ++i) {
    const int c = clusters[i];
    chosen[size_t(c)] = 1;
    tokens.insert(tokens.end(), members + offsets[c], members + offsets[c + 1]);
  }
  const int32_t* assign = st.assign_of(b, h);
  for (int t = csr; t < indexed; ++t)
    if (assign[t] >= 0 && chosen[size_t(assign[t])]) tokens.push_back(t);
  for (int t = std::max(indexed, std::min(w.sink, n)); t < n; ++t) tokens.push_back(t);
  return tokens;
}

}  // namespace kvs::kernels::saap
