// Knobs of Method::Tactic (spec shared/specs/tactic.md), reachable as EngineConfig::tactic.
// Defaults are the paper's settings and the spec's recommended resolutions (section 8).
#pragma once

#include <cstdint>
#include <vector>

namespace kvs {

struct TacticConfig {
  double target = 0.9;         ///< P, cumulative attention mass per query head, (0, 1]; 1 = dense
  /// Average tokens per k-means cluster: C = ceil(n / cluster_size). 16 is the paper's (smaller
  /// clusters fit better and cost more). The CUDA decode orders a list of up to 8,192 clusters
  /// in one CTA a query head; longer lists (past 128K tokens at 16) take one radix sort of every
  /// row, which is much slower: on an H200 at batch 1, P 0.9, 256K took 175 us a layer at 16
  /// against 64 at 32, and 512K 282 at 16 against 92 at 64, selecting as many tokens for as
  /// much mass on kvs-bench's synthetic keys (docs/gpu.md, 2026-12-01). At 128K, 32 took 44.8
  /// us against 47.8; on kvs-tiny-a's 4K captures it read 41 % of the KV against 37 %.
  int cluster_size = 16;
  int kmeans_iterations = 10;  ///< Lloyd iterations (>= 1)
  uint64_t seed = 0x7AC71C;    ///< k-means initialisation seed
  double exact_fraction = 0.015;  ///< leading sorted tokens with exact exponentials (N)
  double window_centre1 = 0.10;   ///< fit window centres, fractions of the sorted list
  double window_centre2 = 0.60;
  int window_min = 32;  ///< fit window width w = max(window_min, window_fraction * n)
  double window_fraction = 0.005;
  /// Tokens decoded since the last clustering that trigger clustering them on their own as
  /// one block (recluster_interval / cluster_size clusters appended to the CSR; spec 8.3).
  /// Until then they are attended in full. 0 disables re-clustering (recent tokens are then
  /// always attended in full). A multiple of cluster_size, and at most what the CUDA kernel
  /// holds in shared memory (kernels::tactic::recluster_block_max_tokens: 5136 at head_dim 128
  /// and cluster_size 16, 6912 at head_dim 64).
  int recluster_interval = 2048;
  /// Longest sequence (tokens) the engine must serve; sizes the cluster state and the
  /// workspace. 0: the model's max_position.
  int max_context = 0;
  /// CUDA: keep each cluster member's KV page row beside its token id (kernels::tactic::
  /// ClusterState::member_rows), written by the prefill and the re-clustering from the page
  /// table of their call, so that the decode's sampled keys and the union's rows skip a round
  /// trip through the page table. Needs the pages of a sequence's tokens to stay where they
  /// were once written (pages appended, never moved, as paged KV caches do); a cache that
  /// moves pages of a live sequence must turn this off, or prefill again after the move.
  bool member_rows = true;
  std::vector<int> dense_layers;  ///< layers attended densely (none by default; spec 8.6)
};

}  // namespace kvs
