// Baseline selectors the methods are compared against, each at a token budget:
// StreamingLLM (sinks + recent window), Quest (page top-k by a key-range bound), the exact
// TopK oracle, and H2O (accumulated attention mass, stateful across steps).
//
// Every selector returns the tokens each query head reads, ascending. When the context is
// shorter than the budget a selector reads the whole context: the Selection keeps the
// requested budget_tokens and the metrics report the tokens actually read, so a short
// context is visible in the results rather than silently clamped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/eval/metrics.h"

namespace kvs::eval {

// A budget in tokens per head: either a fixed count or a fraction of the step's context.
struct Budget {
  int tokens = 0;         ///< fixed token count when > 0
  double fraction = 0.0;  ///< else this fraction of seq_len, in (0, 1], rounded up

  static Budget of_tokens(int n);
  static Budget of_fraction(double f);

  // Tokens for a context of seq_len (may exceed seq_len: selectors report what they read).
  // Throws std::invalid_argument when neither or both forms are set or a value is out of
  // range.
  int resolve(int seq_len) const;
  // "tokens=256" or "fraction=0.1", for knob strings in result tables.
  std::string describe() const;
};

// Indices of the k largest values, ascending by index; ties go to the earlier index.
// k >= n returns every index. The one top-k of this library.
std::vector<int32_t> top_k_indices(const double* values, int n, int k);

struct StreamingConfig {
  int sink_tokens = 4;  ///< first tokens always kept (StreamingLLM's attention sinks)
};

// StreamingLLM: the first sink_tokens tokens plus the most recent ones, budget tokens in all,
// the same set for every head. Throws if the budget is smaller than sink_tokens.
Selection select_streaming(const StepInput& step, const Budget& budget,
                           const StreamingConfig& cfg = {});

struct QuestConfig {
  int page_tokens = 16;  ///< tokens per page (logical pages over positions, not the cache's)
};

// Quest's page score for each page of query head h's kv head: sum_i max(q_i*min_i,
// q_i*max_i) * scale over the page's elementwise key minimum and maximum, an upper bound of
// the scaled score q.k*scale of every key in the page. Returns ceil(seq_len/page_tokens)
// values; the last page may be partial.
std::vector<double> quest_page_bounds(const StepInput& step, int h, const QuestConfig& cfg = {});

// Quest: per query head, the current (last) page plus the pages with the highest bounds,
// floor(budget / page_tokens) pages in all (at least the current page). Heads of a group
// pick pages independently and attend to their own pages; the kv read fraction counts the
// union the group loads. Throws if the budget is smaller than one page.
Selection select_quest(const StepInput& step, const Budget& budget, const QuestConfig& cfg = {});

// The oracle: per query head, the budget tokens with the highest true scores. No method that
// reads at most budget tokens per head has higher mass recall.
Selection select_topk(const DenseReference& dense, const Budget& budget);

struct H2OConfig {
  /// Share of the budget for the recent window (H2O: half): floor(budget * share) tokens,
  /// at least 1 (the token being decoded); the rest goes to heavy hitters.
  double recent_share = 0.5;
  bool permanent_eviction = true;  ///< H2O proper: a token dropped once never comes back
};

// H2O (heavy hitters): per kv head, the recent window plus the tokens with the largest
// attention mass accumulated over the steps observed so far (summed over the group's query
// heads), the same set for every query head of the group. With permanent_eviction the kept
// set is a cache: a token outside it at one step is gone for good, as in H2O; without it,
// every step picks afresh from all tokens.
//
// Use per step, in order: select() for the step, then observe() with that step's dense
// reference, so a selection never sees its own step. Before anything is observed all
// scores are 0 (ties go to earlier tokens); observe prefill or warm-up steps first to seed
// the history. One selector follows one sequence in one layer; reset() starts another.
class H2OSelector {
 public:
  H2OSelector(int num_q_heads, int num_kv_heads, const H2OConfig& cfg = {});

  Selection select(int seq_len, const Budget& budget);
  void observe(const DenseReference& dense);
  void reset();

 private:
  int num_q_heads_, num_kv_heads_;
  H2OConfig cfg_;
  int seq_len_ = 0;                         // tokens seen so far (grows, never shrinks)
  std::vector<std::vector<double>> score_;  // [kv head][token] accumulated mass
  std::vector<std::vector<char>> evicted_;  // [kv head][token]
  void grow(int seq_len, const char* who);
};

}  // namespace kvs::eval
