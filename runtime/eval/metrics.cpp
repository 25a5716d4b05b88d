#include "runtime/eval/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/dense/dense_decode.h"

namespace kvs::eval {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("kvs::eval: " + what);
}

int seq_len_of(const StepInput& step) { return step.kv.seq_lens[step.seq]; }

int kv_head_of(const StepInput& step, int h) {
  return h / (step.num_q_heads / step.kv.num_kv_heads);
}

void check_dense_matches(const StepInput& step, const DenseReference& dense) {
  if (dense.num_q_heads != step.num_q_heads || dense.num_kv_heads != step.kv.num_kv_heads ||
      dense.head_dim != step.kv.head_dim || dense.seq_len != seq_len_of(step)) {
    fail("dense reference is for (Hq " + std::to_string(dense.num_q_heads) + ", Hkv " +
         std::to_string(dense.num_kv_heads) + ", d " + std::to_string(dense.head_dim) +
         ", seq_len " + std::to_string(dense.seq_len) + ") but the step has (Hq " +
         std::to_string(step.num_q_heads) + ", Hkv " + std::to_string(step.kv.num_kv_heads) +
         ", d " + std::to_string(step.kv.head_dim) + ", seq_len " +
         std::to_string(seq_len_of(step)) + ")");
  }
}

// Validates the selection against the step and fills the per-head counts and the number of
// distinct (token, kv head) rows. Query heads of one group share their kv head's rows, so a
// row that several heads of a group read is loaded once.
void count_rows(const StepInput& step, const Selection& sel, StepMetrics& m) {
  const int T = seq_len_of(step);
  const int Hkv = step.kv.num_kv_heads;
  const int group = step.num_q_heads / Hkv;
  if (int(sel.tokens.size()) != step.num_q_heads) {
    fail("selection has " + std::to_string(sel.tokens.size()) +
         " token lists, expected one per "
         "query head (" +
         std::to_string(step.num_q_heads) + ")");
  }
  // Marks hold the last head (and last group) that touched a token, so one pass per head
  // detects duplicates and counts the group union without clearing between heads.
  std::vector<int> head_mark(T, -1), group_mark(T, -1);
  m.tokens_selected.assign(step.num_q_heads, 0);
  m.rows_read = 0;
  for (int h = 0; h < step.num_q_heads; ++h) {
    const int g = h / group;
    for (int32_t t : sel.tokens[h]) {
      if (t < 0 || t >= T) {
        fail("selection for query head " + std::to_string(h) + " has token " + std::to_string(t) +
             ", outside the context [0, " + std::to_string(T) + ")");
      }
      if (head_mark[t] == h) {
        fail("selection for query head " + std::to_string(h) + " lists token " + std::to_string(t) +
             " twice");
      }
      head_mark[t] = h;
      if (group_mark[t] != g) {
        group_mark[t] = g;
        ++m.rows_read;
      }
    }
    m.tokens_selected[h] = int(sel.tokens[h].size());
  }
  m.rows_total = int64_t(T) * Hkv;
  m.kv_read_fraction = double(m.rows_read) / double(m.rows_total);
  m.budget_tokens = sel.budget_tokens;
}

// Relative error against the dense output. A zero dense output (all values zero) has no
// scale to be relative to: an exact match is 0 and anything else is +inf.
double relative_l2(const double* o, const double* ref, int d) {
  double diff = 0.0, norm = 0.0;
  for (int i = 0; i < d; ++i) {
    diff += (o[i] - ref[i]) * (o[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

void fill_errors(const StepInput& step, const DenseReference& dense, const Selection& sel,
                 StepMetrics& m) {
  const int d = step.kv.head_dim;
  m.rel_l2.resize(step.num_q_heads);
  m.mass_recall.resize(step.num_q_heads);
  for (int h = 0; h < step.num_q_heads; ++h) {
    m.rel_l2[h] = relative_l2(m.o.data() + int64_t(h) * d, dense.o.data() + int64_t(h) * d, d);
    const double* p = dense.head_probs(h);
    double mass = 0.0;
    for (int32_t t : sel.tokens[h]) mass += p[t];
    m.mass_recall[h] = mass;
  }
}

}  // namespace

void check_step(const StepInput& step) {
  const PagedKV& kv = step.kv;
  if (!step.q) fail("step has no query (q is null)");
  if (!kv.k || !kv.v || !kv.page_table || !kv.seq_lens) {
    fail("step's PagedKV has a null k, v, page_table or seq_lens pointer");
  }
  if (kv.num_kv_heads <= 0 || kv.head_dim <= 0 || kv.page_size <= 0) {
    fail("PagedKV needs num_kv_heads, head_dim and page_size > 0 (got " +
         std::to_string(kv.num_kv_heads) + ", " + std::to_string(kv.head_dim) + ", " +
         std::to_string(kv.page_size) + ")");
  }
  if (step.num_q_heads <= 0 || step.num_q_heads % kv.num_kv_heads != 0) {
    fail("num_q_heads " + std::to_string(step.num_q_heads) + " is not a positive multiple of " +
         "num_kv_heads " + std::to_string(kv.num_kv_heads));
  }
  if (step.seq < 0 || step.seq >= kv.batch) {
    fail("seq " + std::to_string(step.seq) + " is outside the batch of " +
         std::to_string(kv.batch));
  }
  const int T = kv.seq_lens[step.seq];
  if (T < 1 || int64_t(T) > int64_t(kv.max_pages_per_seq) * kv.page_size) {
    fail("sequence " + std::to_string(step.seq) + " has seq_len " + std::to_string(T) +
         ", expected 1.." + std::to_string(int64_t(kv.max_pages_per_seq) * kv.page_size) +
         " (max_pages_per_seq * page_size)");
  }
  if (!(step.scale > 0.0) || !std::isfinite(step.scale)) {
    fail("softmax scale must be finite and > 0, got " + std::to_string(step.scale));
  }
}

DenseReference dense_reference(const StepInput& step) {
  check_step(step);
  const int d = step.kv.head_dim, T = seq_len_of(step), Hq = step.num_q_heads;
  DenseReference r;
  r.num_q_heads = Hq;
  r.num_kv_heads = step.kv.num_kv_heads;
  r.head_dim = d;
  r.seq_len = T;
  r.o.resize(int64_t(Hq) * d);
  r.lse.resize(Hq);
  r.scores.resize(int64_t(Hq) * T);
  r.probs.resize(int64_t(Hq) * T);
  std::vector<double> o_one(d);
  for (int h = 0; h < Hq; ++h) {
    const float* q = step.q + int64_t(h) * d;
    const int kvh = kv_head_of(step, h);
    kernels::attend_cpu(q, step.kv, step.seq, kvh, nullptr, 0, step.scale,
                        r.o.data() + int64_t(h) * d, &r.lse[h]);
    // The lse of a one-token set is that token's scaled score exactly (max + log(1)), so
    // per-token scores come from the same primitive and q.k is written in one place only.
    double* s = r.scores.data() + int64_t(h) * T;
    double* p = r.probs.data() + int64_t(h) * T;
    for (int32_t t = 0; t < T; ++t) {
      kernels::attend_cpu(q, step.kv, step.seq, kvh, &t, 1, step.scale, o_one.data(), &s[t]);
      p[t] = std::exp(s[t] - r.lse[h]);
    }
  }
  return r;
}

StepMetrics evaluate_selection(const StepInput& step, const DenseReference& dense,
                               const Selection& selection) {
  check_step(step);
  check_dense_matches(step, dense);
  StepMetrics m;
  count_rows(step, selection, m);
  const int d = step.kv.head_dim;
  m.o.resize(int64_t(step.num_q_heads) * d);
  for (int h = 0; h < step.num_q_heads; ++h) {
    const auto& toks = selection.tokens[h];
    double lse;
    // attend_cpu reads all tokens when the list pointer is null; an empty list must stay
    // empty, so it gets a valid pointer and a count of 0.
    const int32_t none = 0;
    kernels::attend_cpu(step.q + int64_t(h) * d, step.kv, step.seq, kv_head_of(step, h),
                        toks.empty() ? &none : toks.data(), int(toks.size()), step.scale,
                        m.o.data() + int64_t(h) * d, &lse);
  }
  fill_errors(step, dense, selection, m);
  return m;
}

StepMetrics evaluate_output(const StepInput& step, const DenseReference& dense, const float* o,
                            const Selection& rows_read) {
  check_step(step);
  check_dense_matches(step, dense);
  if (!o) fail("method output o is null");
  StepMetrics m;
  count_rows(step, rows_read, m);
  const int d = step.kv.head_dim;
  const int64_t n = int64_t(step.num_q_heads) * d;
  m.o.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(o[i])) {
      fail("method output is not finite at query head " + std::to_string(i / d) + ", dim " +
           std::to_string(i % d));
    }
    m.o[i] = o[i];
  }
  fill_errors(step, dense, rows_read, m);
  return m;
}

double read_reuse(const Selection& now, const Selection& prev, int prev_len, int num_kv_heads) {
  const int hq = int(now.tokens.size());
  if (num_kv_heads < 1 || hq % num_kv_heads != 0 || int(prev.tokens.size()) != hq || prev_len < 0)
    throw std::invalid_argument(
        "kvs::eval::read_reuse: " + std::to_string(hq) + " and " +
        std::to_string(prev.tokens.size()) + " token lists for " + std::to_string(num_kv_heads) +
        " kv heads and a previous length of " + std::to_string(prev_len) +
        "; expected one list per query head in both, a multiple of the kv heads");
  const int group = hq / num_kv_heads;
  // Per kv head: 1 where the previous step read the row, 2 once this step counted it.
  std::vector<unsigned char> mark(static_cast<size_t>(prev_len));
  int64_t older = 0, again = 0;
  for (int g = 0; g < num_kv_heads; ++g) {
    std::fill(mark.begin(), mark.end(), 0);
    for (int h = g * group; h < (g + 1) * group; ++h)
      for (int32_t t : prev.tokens[size_t(h)]) {
        if (t < 0 || t >= prev_len)
          throw std::invalid_argument(
              "kvs::eval::read_reuse: the previous selection of query head " + std::to_string(h) +
              " has token " + std::to_string(t) + ", outside [0, " + std::to_string(prev_len) +
              ")");
        mark[size_t(t)] = 1;
      }
    for (int h = g * group; h < (g + 1) * group; ++h)
      for (int32_t t : now.tokens[size_t(h)]) {
        if (t < 0 || t >= prev_len || mark[size_t(t)] == 2) continue;
        ++older;
        if (mark[size_t(t)] == 1) ++again;
        mark[size_t(t)] = 2;
      }
  }
  return older == 0 ? std::numeric_limits<double>::quiet_NaN() : double(again) / double(older);
}

}  // namespace kvs::eval
