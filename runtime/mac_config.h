// Knobs of Method::Mac (spec shared/specs/mac.md), reachable as EngineConfig::mac.
// Defaults are the paper's and the authors' repo settings (spec section 3), except the
// acceptance threshold: see MacThreshold.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace kvs {

// How the squared pre-RoPE distance d2 of the nearest ring query is judged (hit iff d2 < thr).
enum class MacThreshold {
  /// The paper's Eq. 3: thr = 2 d (1 - tau)^2. Absolute: it assumes unit-variance pre-RoPE
  /// query components, so on a model whose queries are smaller it accepts almost anything.
  Paper,
  /// The same null model fitted to the head: thr = 2 (1 - tau)^2 v, with v a running estimate
  /// of the head's total query variance E||q - mean||^2 (per sequence, layer and query head;
  /// E||q_t - q_j||^2 = 2 v for two independent queries of the head). Equals Paper when the
  /// queries are zero-mean unit-variance. No hit before min_queries queries were seen.
  Relative,
  /// Explicit squared-distance thresholds per (layer, query head), e.g. calibrated from a
  /// capture: per_head_threshold[layer * Hq + h]; tau is not used.
  PerHead,
};

inline const char* to_string(MacThreshold t) {
  switch (t) {
    case MacThreshold::Paper: return "paper";
    case MacThreshold::Relative: return "relative";
    case MacThreshold::PerHead: return "per-head";
  }
  return "?";
}

inline MacThreshold mac_threshold_from_string(const std::string& name) {
  if (name == "paper") return MacThreshold::Paper;
  if (name == "relative") return MacThreshold::Relative;
  if (name == "per-head") return MacThreshold::PerHead;
  throw std::invalid_argument("unknown MAC threshold rule '" + name +
                              "' (known: paper, relative, per-head)");
}

struct MacConfig {
  double tau = 0.45;     ///< tolerance of the acceptance rule, [0, 1]; 1 accepts nothing
  int window = 512;      ///< W: ring slots = candidate positions [t - W, t) per query head
  int band = 256;        ///< B: keys recomputed under the current query before the boundary
  int min_context = 2048;  ///< no reuse before position t (tokens before the query) reaches it
  MacThreshold threshold = MacThreshold::Relative;
  int min_queries = 64;  ///< Relative: queries a head must have seen before it may hit (>= 2)
  /// Relative: the running means weigh the last ~stats_horizon queries (1/n up to it, then an
  /// exponential average of that length), so they follow a drifting query distribution.
  int stats_horizon = 4096;
  /// PerHead: [num_layers * Hq] squared-distance thresholds (>= 0; 0 never hits).
  std::vector<float> per_head_threshold;
};

}  // namespace kvs
