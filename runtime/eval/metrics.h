// Fidelity of one decode step of one sequence in one layer: what a sparse method reads, and
// how far its attention output is from exact fp64 dense attention.
//
// Every attention here goes through kernels::attend_cpu (the one fp64 primitive); this file
// only decides which tokens each query head attends to and compares the results.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/paged_kv.h"

namespace kvs::eval {

// One decode step of sequence `seq` in a layer's cache. The query is the step's post-RoPE
// query (what attention consumes), one row of head_dim values per query head. Query head h
// reads kv head h / (num_q_heads / kv.num_kv_heads), as in the kernels.
struct StepInput {
  const float* q = nullptr;  ///< [num_q_heads, kv.head_dim] fp32
  int num_q_heads = 0;       ///< a multiple of kv.num_kv_heads
  PagedKV kv;                ///< host pointers; the step's token is already appended
  int seq = 0;               ///< sequence index in kv (0 <= seq < kv.batch)
  double scale = 0.0;        ///< softmax scale, > 0 (usually 1/sqrt(head_dim))
};

// The token ids each query head reads, ascending and without duplicates. A method that
// selects per kv head gives the same list to every query head of the group.
struct Selection {
  std::vector<std::vector<int32_t>> tokens;  ///< [num_q_heads][...], ids in [0, seq_len)
  int budget_tokens = -1;  ///< per-head budget the selector was asked for; -1: no budget
};

// Exact dense attention of the step, computed once and shared by every method measured on
// that step (and fed to stateful selectors such as H2O).
struct DenseReference {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int seq_len = 0;
  std::vector<double> o;       ///< [num_q_heads, head_dim] fp64 dense output
  std::vector<double> lse;     ///< [num_q_heads] natural-log sum-exp of all scaled scores
  std::vector<double> scores;  ///< [num_q_heads, seq_len] scaled scores q.k * scale
  std::vector<double> probs;   ///< [num_q_heads, seq_len] dense softmax probabilities

  const double* head_scores(int h) const { return scores.data() + int64_t(h) * seq_len; }
  const double* head_probs(int h) const { return probs.data() + int64_t(h) * seq_len; }
};

// The metrics of one method on one step. rel_l2 is 0 for an exact match; where the dense
// output is exactly zero (no scale to be relative to) any difference gives +inf.
struct StepMetrics {
  std::vector<double> rel_l2;        ///< [num_q_heads] ||o - o_dense|| / ||o_dense||
  std::vector<double> mass_recall;   ///< [num_q_heads] dense probability mass of tokens read
  std::vector<int> tokens_selected;  ///< [num_q_heads] tokens each head read
  int64_t rows_read = 0;          ///< distinct (token, kv head) rows: a group's union counts once
  int64_t rows_total = 0;         ///< seq_len * num_kv_heads
  double kv_read_fraction = 0.0;  ///< rows_read / rows_total
  int budget_tokens = -1;         ///< copied from the selection; -1: none
  /// Of the rows read that the previous step could have read (tokens below its length), the
  /// fraction it did read: what a cache or prefetch of the last step's rows gets right
  /// (read_reuse). NaN: not measured (no previous step).
  double read_reuse = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> o;  ///< [num_q_heads, head_dim] the output that was measured
};

// Checks the step (pointers, shapes, seq, scale) and throws std::invalid_argument naming
// what is wrong. Every function below calls it.
void check_step(const StepInput& step);

// Exact fp64 dense attention: output, lse, per-token scores and probabilities.
DenseReference dense_reference(const StepInput& step);

// Attends each query head over its selected tokens (attend_cpu) and compares with `dense`.
// An empty selection for a head gives o = 0 there (rel_l2 = 1, recall 0).
StepMetrics evaluate_selection(const StepInput& step, const DenseReference& dense,
                               const Selection& selection);

// Measures an output computed elsewhere (an engine; e.g. a sampling estimator that
// reweights what it read), given the rows it read. o is [num_q_heads, head_dim] fp32 and
// must be finite.
StepMetrics evaluate_output(const StepInput& step, const DenseReference& dense, const float* o,
                            const Selection& rows_read);

// StepMetrics::read_reuse of a step that read `now` after a step of prev_len tokens that read
// `prev`, over distinct (token, kv head) rows (a group's union counts once; heads are grouped
// as GQA groups num_q_heads / num_kv_heads wide). NaN when `now` read no row below prev_len.
// Throws std::invalid_argument when a selection has other than one list per query head or a
// token outside [0, prev_len) (prev).
double read_reuse(const Selection& now, const Selection& prev, int prev_len, int num_kv_heads);

}  // namespace kvs::eval
