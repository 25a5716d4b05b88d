// Knobs of Method::Saap (spec shared/specs/saap.md), reachable as EngineConfig::saap.
// Defaults are the paper's settings (spec section 3). The trained parts (centroids, query
// MLPs) come from the bundle's saap group; its attributes record the knobs used in training.
#pragma once

#include <string>
#include <vector>

namespace kvs {

enum class SaapRouter {
  Mlp,              ///< the paper's asymmetric query classifier: summed MLP distributions
  NearestCentroid,  ///< the symmetric IVF baseline: centroids nearest the group's mean
                    ///< pre-RoPE query (spec section 5, "K-means (no rope)")
};

/// How the MLP router's weights are stored and multiplied.
enum class SaapWeights {
  Bf16,  ///< CUDA streams bf16 weights; the CPU reference keeps the trained floats
  Fp8,   ///< e4m3 with a scale per row, half the bytes; both backends use these weights
};

const char* to_string(SaapRouter router);
SaapRouter saap_router_from_string(const std::string& name);  // "mlp" | "nearest_centroid"; throws
const char* to_string(SaapWeights weights);
SaapWeights saap_weights_from_string(const std::string& name);  // "bf16" | "fp8"; throws

struct SaapConfig {
  int probes = 32;                   ///< l: clusters visited per (sequence, kv head) and step
  int sink_tokens = 1;               ///< first tokens always attended
  int recent_tokens = 2047;          ///< last tokens always attended (the new one included)
  std::vector<int> dense_layers{0};  ///< layers attended densely (layer 0: spec 2.0)
  SaapRouter query_router = SaapRouter::Mlp;
  /// The MLP's weights. The batch-1 router streams them (75 MB a layer at the paper's shape in
  /// bf16), so fp8 (e4m3, a scale per row) is the default: it took the SAAP step from 2.54x
  /// to 3.05x dense's speed at 128K on an H100, with mass recall and output error unchanged
  /// on kvs-tiny-a (docs/analysis.md). bf16 keeps the trained weights to bf16 rounding.
  SaapWeights router_weights = SaapWeights::Fp8;
  /// Post-prefill assignments (one per decode step and kv head, the token that leaves the
  /// recent window) are merged into the cluster index once this many have piled up, so that a
  /// decode step's scan of them stays short however long the generation (kernels/saap/saap.h,
  /// "the fold"; docs/gpu.md). 0 never merges; at most 4096. The CUDA attention scans them
  /// in rounds of kernels::saap::kAttendScanRound (1024), and each round past the first
  /// lengthens the step: on an H200 at 128K batch 1 (32 layers) the step took 32.1-32.2 us
  /// with up to 1023 of them and 35.1-37.4 with 1055-2015, while a fold costs a layer about
  /// the same whatever its size (0.33 ms then, about 0.10 ms since its moves were striped and
  /// its sort became a count). So at 1024 the step averages 31.8-31.9 us plus 0.10 of fold
  /// over a fold cycle (docs/gpu.md, 2026-11-30).
  int fold_every = 1024;
  /// Tokens that leave the recent window are assigned to clusters in batches of this many
  /// (kernels/saap/saap.h, index_step_count): the index step does its work on one decode step
  /// in index_every, and until then the dense part keeps up to index_every - 1 more tokens, so
  /// a larger batch reads a few more rows but never fewer. 1 assigns every token as it leaves;
  /// at most 32 and at most fold_every (when it is not 0). On an H200 at 128K batch 1 a
  /// layer's step that indexes took 5.9 us more than the others (31.9) at 4 and 10.7 at 32,
  /// so a step cost 33.4 us on average at 4 and 32.2 at 32 (docs/gpu.md, 2026-11-30); with
  /// the layers' phases (index_phase) every token pays about the average.
  int index_every = 32;
  /// The steps on which a layer indexes: those where (tokens past the window + phase) is a
  /// multiple of index_every (kernels/saap/saap.h, index_step_count). -1: phase l %
  /// index_every for layer l, so that the layers index on different decode steps and every
  /// token costs about the same; 0 .. index_every - 1: every layer at that phase, on the same
  /// steps (the benchmark's --timed-step, to time one kind of step alone).
  int index_phase = -1;
  /// CUDA: keep each cluster member's KV page row beside its token id (IndexState::
  /// member_rows), written by the prefill and the folds from the page table of their call,
  /// so that the attention skips a round trip through the page table. Needs
  /// the pages of a sequence's tokens to stay where they were once written (pages appended,
  /// never moved, as paged KV caches do); a cache that moves pages of a live sequence must
  /// turn this off, or prefill again after the move.
  bool member_rows = true;
  /// Longest sequence (tokens) the engine must serve; sizes the index and the workspace.
  /// 0: the model's max_position.
  int max_context = 0;
};

}  // namespace kvs
