// Knobs of Method::MagicPig (spec shared/specs/magicpig.md), reachable as
// EngineConfig::magicpig. Defaults are the paper's settings and the spec's recommended
// resolutions (section 8); runtime/magicpig_engine.h says what each choice means.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvs {

enum class MagicPigMode {
  CpuOffload,  ///< the paper's system: tables and hashed KV in (pinned) host memory, CPU attention
  Gpu,         ///< everything on the GPU (when the KV fits there); same estimator
};

const char* to_string(MagicPigMode mode);
MagicPigMode magicpig_mode_from_string(const std::string& name);  // "cpu_offload" or "gpu"

struct MagicPigConfig {
  int bits = 10;          ///< K, bits per table (1..16)
  int tables = 150;       ///< L, hash tables per (layer, kv head) (>= 2)
  int sink_tokens = 4;    ///< first tokens attended densely
  int local_tokens = 64;  ///< last prompt tokens attended densely (new tokens always are)
  /// Layers attended densely. nullopt: {0, num_layers / 2} (the paper's {0, 16} of 32).
  std::optional<std::vector<int>> dense_layers;
  uint64_t seed = 0x4D414749435049ull;  ///< hyperplane seed ("MAGICPI")
  double epsilon = 1e-4;                ///< logit shift -log(u + epsilon), spec 8.4
  MagicPigMode mode = MagicPigMode::CpuOffload;
  int threads = 0;  ///< CPU worker threads (0: hardware concurrency)
  /// CPU vector unit: "auto" (widest available), "portable", "avx2", "avx512".
  std::string cpu_isa = "auto";
  /// Longest sequence (tokens) decode() will see; sizes the dense part's row table and the
  /// GPU-only mode's hit maps. 0: the model's max_position.
  int max_context = 0;
  /// The hyperplanes [head_dim, K * L] row-major (e.g. from a bundle, load_magicpig_projection).
  /// Empty: generated from `seed`.
  std::vector<float> projection;
};

}  // namespace kvs
