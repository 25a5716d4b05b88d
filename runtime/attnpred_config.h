// Knobs of Method::AttnPred (spec shared/specs/attnpred.md), reachable as
// EngineConfig::attnpred. The trained geometry (history rows, block size) comes from the
// bundle and must not change; the other knobs default to the values the bundle's attnpred
// group carries (written by kvs-train attnpred: the paper's settings) and may be overridden
// here, e.g. to sweep budgets.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kvs {

/// The keys a calibration row scores (AttnPredConfig::calibration_keys).
enum class CalibrationKeys {
  Bf16,  ///< the cache's own keys
  E4m3,  ///< a per-layer e4m3 copy (kernels/attnpred/attnpred.h KeyCopy): half the bytes
  Int4,  ///< a per-layer int4 copy, q rounded to int8 for the rows: a quarter of the bytes
};
const char* to_string(CalibrationKeys keys);
// "bf16" | "e4m3" | "int4"; throws
CalibrationKeys calibration_keys_from_string(const std::string& name);

struct AttnPredConfig {
  /// K_bud: tokens attended per query head, sink and recent included (paper 512..4096).
  /// 0: the bundle's budget_tokens. (budget - sink - recent) / block blocks are predicted.
  int budget_tokens = 0;
  int sink_tokens = -1;        ///< S (a multiple of the block); -1: the bundle's (64)
  int recent_tokens = -1;      ///< R (a multiple of the block); -1: the bundle's (64)
  int calibration_period = 0;  ///< M: every M-th step appends a full row; 0: the bundle's (5)
  /// P: the CNN predicts (and the selection changes) every P-th step; the steps between
  /// attend the last selection (its sink and recent tokens follow the context) and still
  /// append their history rows. 1 (the paper's code): every step. The paper predicts "every
  /// several steps for efficiency" without giving P; its cost is measured in docs/gpu.md.
  int predict_interval = 1;
  /// GQA. false (the paper's code): a history and a top-K per query head; a kv head attends
  /// the union of its query heads' blocks, up to group size x the budget. true: one history
  /// per kv head, whose row is the largest of its query heads' pooled probabilities, one CNN
  /// input and one top-K per kv head, so every query head attends exactly the budget (a
  /// group-size times cheaper predictor and a smaller read; its fidelity is in docs/results.md).
  /// 1 / 0 as above; -1: the bundle's (true when its CNN was trained on grouped rows,
  /// kvs-train attnpred --group-history).
  int group_history = -1;
  /// Layers attended densely with no history (paper: {0, 1}); unset: the bundle's.
  std::optional<std::vector<int>> dense_layers;
  /// Decode steps after a prefill attended densely (full rows) before the first prediction:
  /// the engine gets no prefill queries, so it builds its history from these rows on.
  int warmup_steps = 1;
  /// Offload mode (CUDA only): the caller's KV (the PagedKV passed to prefill/decode) lives
  /// in pinned, mapped host memory (cudaHostAlloc; page table and lengths device-readable);
  /// the engine keeps a per-layer device block cache of the selected blocks and prefetches
  /// the next step's blocks on a side stream (cross-token prefetch).
  bool offload = false;
  /// The keys the calibration rows score. E4m3 (GPU-resident mode): each sparse layer keeps
  /// an e4m3 copy of its keys with a scale per key, (head_dim + 4) bytes per token and kv
  /// head (about half the KV cache's K; 138 MB a layer at 128K, 8 kv heads, d 128), filled at
  /// prefill and brought up to date by each row; a row then reads half the bytes (all of K every
  /// calibration_period steps: the largest share of what the predictor's branches take from
  /// the sparse steps beside them). Int4: the same with (head_dim / 2 + 4) bytes (a quarter of
  /// K; 71 MB a layer at 128K), and the rows score each query head rounded to int8 (a scale a
  /// head) against it, in exact integer sums. Only the rows change: the history's calibrated
  /// rows come from the rounded keys (and, int4, queries), the attention never does. The
  /// fidelity of each against Bf16 is in docs/results.md. The CPU backend rounds the same
  /// way, for kvs-eval.
  CalibrationKeys calibration_keys = CalibrationKeys::Bf16;
  /// Longest sequence served (sizes history and workspace). 0: the model's max_position. A
  /// prefill past it is an error; a CUDA decode does not read the lengths back (no sync), so a
  /// sequence must not grow past it (the CPU backend's decode checks).
  int max_context = 0;
};

}  // namespace kvs
