#include "runtime/eval/baselines.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>

#include "kernels/common/bf16.h"

namespace kvs::eval {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("kvs::eval: " + what);
}

Selection same_for_all_heads(int num_q_heads, std::vector<int32_t> tokens, int budget) {
  Selection s;
  s.tokens.assign(num_q_heads, std::move(tokens));
  s.budget_tokens = budget;
  return s;
}

std::vector<int32_t> all_tokens(int seq_len) {
  std::vector<int32_t> t(seq_len);
  std::iota(t.begin(), t.end(), 0);
  return t;
}

// Elementwise key minimum and maximum of each page of one kv head: [pages, head_dim] each.
struct PageRanges {
  int pages = 0;
  std::vector<float> lo, hi;
};

PageRanges page_key_ranges(const StepInput& step, int kv_head, int page_tokens) {
  const int T = step.kv.seq_lens[step.seq], d = step.kv.head_dim;
  PageRanges r;
  r.pages = (T + page_tokens - 1) / page_tokens;
  r.lo.assign(int64_t(r.pages) * d, INFINITY);
  r.hi.assign(int64_t(r.pages) * d, -INFINITY);
  for (int t = 0; t < T; ++t) {
    const bf16* k = step.kv.k + step.kv.offset(step.seq, t, kv_head);
    float* lo = r.lo.data() + int64_t(t / page_tokens) * d;
    float* hi = r.hi.data() + int64_t(t / page_tokens) * d;
    for (int i = 0; i < d; ++i) {
      const float x = bf16_to_float(k[i]);
      lo[i] = std::min(lo[i], x);
      hi[i] = std::max(hi[i], x);
    }
  }
  return r;
}

// Per channel the larger of q_i*min_i and q_i*max_i bounds q_i*k_i for every k_i in
// [min_i, max_i] whatever the sign of q_i, so the sum bounds q.k over the page.
std::vector<double> page_bounds(const float* q, const PageRanges& r, int d, double scale) {
  std::vector<double> b(r.pages);
  for (int p = 0; p < r.pages; ++p) {
    const float* lo = r.lo.data() + int64_t(p) * d;
    const float* hi = r.hi.data() + int64_t(p) * d;
    double s = 0.0;
    for (int i = 0; i < d; ++i) s += std::max(double(q[i]) * lo[i], double(q[i]) * hi[i]);
    b[p] = s * scale;
  }
  return b;
}

void check_quest(const QuestConfig& cfg) {
  if (cfg.page_tokens < 1) {
    fail("QuestConfig.page_tokens must be >= 1, got " + std::to_string(cfg.page_tokens));
  }
}

}  // namespace

Budget Budget::of_tokens(int n) {
  Budget b;
  b.tokens = n;
  return b;
}

Budget Budget::of_fraction(double f) {
  Budget b;
  b.fraction = f;
  return b;
}

int Budget::resolve(int seq_len) const {
  if (tokens > 0 && fraction == 0.0) return tokens;
  if (tokens == 0 && fraction > 0.0 && fraction <= 1.0) {
    // Nearest rather than ceiling: 0.07 * 100 is 7.000000000000001 in binary and must
    // not become 8 tokens.
    return std::max(1, int(std::llround(fraction * seq_len)));
  }
  fail("budget needs exactly one of tokens > 0 or fraction in (0, 1]; got tokens=" +
       std::to_string(tokens) + ", fraction=" + std::to_string(fraction));
}

std::string Budget::describe() const {
  char buf[64];
  if (tokens > 0) {
    std::snprintf(buf, sizeof buf, "tokens=%d", tokens);
  } else {
    std::snprintf(buf, sizeof buf, "fraction=%g", fraction);
  }
  return buf;
}

std::vector<int32_t> top_k_indices(const double* values, int n, int k) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  if (k < n) {
    const auto better = [values](int32_t a, int32_t b) {
      return values[a] > values[b] || (values[a] == values[b] && a < b);
    };
    std::nth_element(idx.begin(), idx.begin() + std::max(k, 0), idx.end(), better);
    idx.resize(std::max(k, 0));
  }
  std::sort(idx.begin(), idx.end());
  return idx;
}

Selection select_streaming(const StepInput& step, const Budget& budget,
                           const StreamingConfig& cfg) {
  check_step(step);
  if (cfg.sink_tokens < 0) {
    fail("StreamingConfig.sink_tokens must be >= 0, got " + std::to_string(cfg.sink_tokens));
  }
  const int T = step.kv.seq_lens[step.seq];
  const int B = budget.resolve(T);
  if (B < cfg.sink_tokens) {
    fail("StreamingLLM budget of " + std::to_string(B) + " tokens (" + budget.describe() +
         ", seq_len " + std::to_string(T) + ") is smaller than sink_tokens " +
         std::to_string(cfg.sink_tokens));
  }
  if (B >= T) return same_for_all_heads(step.num_q_heads, all_tokens(T), B);
  // B < T here, so the sinks and the window [T - (B - sinks), T) never overlap.
  std::vector<int32_t> t;
  t.reserve(B);
  for (int i = 0; i < cfg.sink_tokens; ++i) t.push_back(i);
  for (int i = T - (B - cfg.sink_tokens); i < T; ++i) t.push_back(i);
  return same_for_all_heads(step.num_q_heads, std::move(t), B);
}

std::vector<double> quest_page_bounds(const StepInput& step, int h, const QuestConfig& cfg) {
  check_step(step);
  check_quest(cfg);
  if (h < 0 || h >= step.num_q_heads) {
    fail("query head " + std::to_string(h) + " is outside [0, " + std::to_string(step.num_q_heads) +
         ")");
  }
  const int group = step.num_q_heads / step.kv.num_kv_heads;
  const PageRanges r = page_key_ranges(step, h / group, cfg.page_tokens);
  return page_bounds(step.q + int64_t(h) * step.kv.head_dim, r, step.kv.head_dim, step.scale);
}

Selection select_quest(const StepInput& step, const Budget& budget, const QuestConfig& cfg) {
  check_step(step);
  check_quest(cfg);
  const int T = step.kv.seq_lens[step.seq], d = step.kv.head_dim;
  const int B = budget.resolve(T);
  if (B < cfg.page_tokens) {
    fail("Quest budget of " + std::to_string(B) + " tokens (" + budget.describe() + ", seq_len " +
         std::to_string(T) + ") is smaller than one page of " + std::to_string(cfg.page_tokens) +
         " tokens (QuestConfig.page_tokens)");
  }
  const int group = step.num_q_heads / step.kv.num_kv_heads;
  Selection s;
  s.tokens.resize(step.num_q_heads);
  s.budget_tokens = B;
  for (int kvh = 0; kvh < step.kv.num_kv_heads; ++kvh) {
    const PageRanges r = page_key_ranges(step, kvh, cfg.page_tokens);
    const int last = r.pages - 1;
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      const std::vector<double> bound = page_bounds(step.q + int64_t(h) * d, r, d, step.scale);
      // The current page holds the token being decoded: always read, whatever its bound.
      std::vector<int32_t> pages = top_k_indices(bound.data(), last, B / cfg.page_tokens - 1);
      pages.push_back(last);
      for (int32_t p : pages) {
        for (int t = p * cfg.page_tokens; t < std::min(T, (p + 1) * cfg.page_tokens); ++t) {
          s.tokens[h].push_back(t);
        }
      }
    }
  }
  return s;
}

Selection select_topk(const DenseReference& dense, const Budget& budget) {
  const int B = budget.resolve(dense.seq_len);
  Selection s;
  s.budget_tokens = B;
  s.tokens.resize(dense.num_q_heads);
  for (int h = 0; h < dense.num_q_heads; ++h) {
    s.tokens[h] = top_k_indices(dense.head_scores(h), dense.seq_len, B);
  }
  return s;
}

H2OSelector::H2OSelector(int num_q_heads, int num_kv_heads, const H2OConfig& cfg)
    : num_q_heads_(num_q_heads), num_kv_heads_(num_kv_heads), cfg_(cfg) {
  if (num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0) {
    fail("H2OSelector: num_q_heads " + std::to_string(num_q_heads) +
         " must be a positive multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  if (!(cfg.recent_share >= 0.0 && cfg.recent_share <= 1.0)) {
    fail("H2OConfig.recent_share must be in [0, 1], got " + std::to_string(cfg.recent_share));
  }
  reset();
}

void H2OSelector::reset() {
  seq_len_ = 0;
  score_.assign(num_kv_heads_, {});
  evicted_.assign(num_kv_heads_, {});
}

void H2OSelector::grow(int seq_len, const char* who) {
  if (seq_len < seq_len_) {
    fail(std::string("H2OSelector::") + who + ": seq_len " + std::to_string(seq_len) +
         " is shorter than the " + std::to_string(seq_len_) +
         " tokens already seen; call reset() before a new sequence");
  }
  seq_len_ = seq_len;
  for (int g = 0; g < num_kv_heads_; ++g) {
    score_[g].resize(seq_len, 0.0);
    evicted_[g].resize(seq_len, 0);
  }
}

Selection H2OSelector::select(int seq_len, const Budget& budget) {
  if (seq_len < 1)
    fail("H2OSelector::select: seq_len must be >= 1, got " + std::to_string(seq_len));
  grow(seq_len, "select");
  const int T = seq_len;
  const int B = budget.resolve(T);
  // At least the token being decoded is recent: attention always sees the current token.
  const int recent = std::min(B, std::max(1, int(B * cfg_.recent_share)));
  const int heavy = B - recent;
  const int window_start = std::max(0, T - recent);
  const int group = num_q_heads_ / num_kv_heads_;
  Selection s;
  s.tokens.resize(num_q_heads_);
  s.budget_tokens = B;
  for (int g = 0; g < num_kv_heads_; ++g) {
    std::vector<int32_t> cand;
    std::vector<double> cand_score;
    for (int t = 0; t < window_start; ++t) {
      if (!evicted_[g][t]) {
        cand.push_back(t);
        cand_score.push_back(score_[g][t]);
      }
    }
    std::vector<int32_t> keep = top_k_indices(cand_score.data(), int(cand.size()), heavy);
    std::vector<int32_t> tokens;
    tokens.reserve(keep.size() + (T - window_start));
    size_t next = 0;
    for (size_t i = 0; i < cand.size(); ++i) {
      if (next < keep.size() && keep[next] == int32_t(i)) {
        tokens.push_back(cand[i]);
        ++next;
      } else if (cfg_.permanent_eviction) {
        evicted_[g][cand[i]] = 1;
      }
    }
    // The window skips evicted tokens too: a budget raised between steps must not bring
    // back what an earlier step dropped.
    for (int t = window_start; t < T; ++t) {
      if (!evicted_[g][t]) tokens.push_back(t);
    }
    for (int h = g * group; h < (g + 1) * group; ++h) s.tokens[h] = tokens;
  }
  return s;
}

void H2OSelector::observe(const DenseReference& dense) {
  if (dense.num_q_heads != num_q_heads_ || dense.num_kv_heads != num_kv_heads_) {
    fail("H2OSelector::observe: dense reference has Hq " + std::to_string(dense.num_q_heads) +
         ", Hkv " + std::to_string(dense.num_kv_heads) + "; the selector was made for Hq " +
         std::to_string(num_q_heads_) + ", Hkv " + std::to_string(num_kv_heads_));
  }
  grow(dense.seq_len, "observe");
  const int group = num_q_heads_ / num_kv_heads_;
  for (int h = 0; h < num_q_heads_; ++h) {
    const double* p = dense.head_probs(h);
    std::vector<double>& acc = score_[h / group];
    for (int t = 0; t < dense.seq_len; ++t) acc[t] += p[t];
  }
}

}  // namespace kvs::eval
