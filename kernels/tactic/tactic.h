// Tactic (spec shared/specs/tactic.md): k-means clusters of keys per (layer, kv head) at
// prefill; at decode each query head ranks the clusters by q.centroid, fits y = a/x + b to
// sampled exponentials along that order, and takes the fewest whole clusters whose modelled
// mass reaches a target P; the group's selections are united and attended once.
//
// Cluster state (ClusterState) has one layout for both backends, in host memory for the CPU
// reference and device memory for CUDA:
//   centroids     [max_batch, Hkv, max_clusters, d] bf16 (the KV dtype, spec 2.6)
//   offsets       [max_batch, Hkv, max_clusters + 1] int32: cluster c of (b, h) has members
//                 members[offsets[c] .. offsets[c + 1])
//   members       [max_batch, Hkv, max_tokens] int32 token ids, grouped by cluster and
//                 ascending within a cluster (a stable order: the sorted token list, and so
//                 the sampled tokens, are the same on both backends)
//   num_clusters  [max_batch, Hkv] int32
//   clustered_len [max_batch, Hkv] int32: tokens [0, clustered_len) are clustered; later
//                 ones are "recent" and always attended
//   member_rows   [max_batch, Hkv, max_tokens] int32, CUDA only and optional: the page row
//                 (page_row, paged_kv.h) of each member, beside it, written with the members
//                 from the page table of the call that clustered them, so that the decode's
//                 sampled keys and the union's rows skip a round trip through the page
//                 table. It holds while the pages of a sequence's clustered tokens stay where
//                 they were: pages appended, never moved (TacticConfig::member_rows opts out).
// Clustering a token range [start, start + n) appends C = ceil(n / cluster_size) clusters at
// slot num_clusters and fills member positions [start, start + n): clustered tokens are
// always a prefix of the sequence, so member positions and token ids cover the same range.
//
// k-means (both backends): centroids initialised from a stratified random sample of the keys
// (kmeans_init_index), then `iterations` Lloyd steps of {assign each key to argmin_c
// ||mu_c||^2 - 2 k.mu_c (ties to the lowest c); mean of each cluster's members, rounded to
// bf16}. ||k||^2 is the same for every c, so the argmin drops it. An empty cluster keeps its
// previous centroid (it stays empty but addressable; it is never selected for its members
// since it has none). The final CSR is the last assignment and the centroids its means.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"
#include "kernels/tactic/tactic_fit.h"

namespace kvs::kernels::tactic {

struct KMeansParams {
  int cluster_size = 16;     ///< average tokens per cluster: C = ceil(n / cluster_size)
  int iterations = 10;       ///< Lloyd iterations (>= 1), no early stop
  uint64_t seed = 0x7AC71C;  ///< initialisation seed (mixed with layer, kv head, range start)
};

struct ClusterState {
  bf16* centroids = nullptr;
  int32_t* offsets = nullptr;
  int32_t* members = nullptr;
  int32_t* num_clusters = nullptr;
  int32_t* clustered_len = nullptr;
  int32_t* member_rows = nullptr;  ///< CUDA, optional (above); null: through the page table
  int max_batch = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_clusters = 0;
  int max_tokens = 0;

  KVS_HOST_DEVICE int64_t slot(int b, int h) const { return int64_t(b) * num_kv_heads + h; }
  KVS_HOST_DEVICE bf16* centroid(int b, int h, int c) const {
    return centroids + (slot(b, h) * max_clusters + c) * head_dim;
  }
  KVS_HOST_DEVICE int32_t* offsets_of(int b, int h) const {
    return offsets + slot(b, h) * (max_clusters + 1);
  }
  KVS_HOST_DEVICE int32_t* members_of(int b, int h) const {
    return members + slot(b, h) * max_tokens;
  }
  KVS_HOST_DEVICE int32_t* member_rows_of(int b, int h) const {
    return member_rows + slot(b, h) * max_tokens;
  }
};

// Clusters needed for sequences of up to max_tokens tokens: ceil(max_tokens / cluster_size),
// whatever the split into a prefill and blocks of block_tokens (a multiple of cluster_size).
int max_clusters_for(int max_tokens, int cluster_size);

// ---- CPU reference ------------------------------------------------------------------------

// Plain k-means of keys [n, d] (fp32 holding bf16 values) into C clusters as described
// above, from the init of `stream`. centroids [C, d] bf16, offsets [C + 1] and members [n]
// are local (member i is key i). Throws std::invalid_argument on bad sizes.
void kmeans_cpu(const float* keys, int n, int d, int C, int iterations, uint64_t stream,
                bf16* centroids, int32_t* offsets, int32_t* members);

// Within-cluster sum of squares, fp64, of a clustering of keys [n, d] (local members).
double kmeans_wcss_cpu(const float* keys, int n, int d, int C, const bf16* centroids,
                       const int32_t* offsets, const int32_t* members);

// Clusters tokens [clustered_len, clustered_len + n) of sequence b, kv head h of kv into
// ceil(n / cluster_size) new clusters of state (host memory), appended as described above.
void cluster_range_cpu(const PagedKV& kv, int layer, int b, int h, int n, const KMeansParams& km,
                       const ClusterState& state);

// The clusters one query head selects: q (d fp32 values, post-RoPE) of sequence b against
// kv head h. flags [num_clusters] gets 1 for every selected cluster (existing 1s are kept:
// call it for each head of a group on one array to get the union). Returns the selected
// token count after rounding up to whole clusters; *budget (may be null) gets K before it.
int select_clusters_cpu(const float* q, const PagedKV& kv, int b, int h, double scale,
                        const FitParams& fit, const ClusterState& state, uint8_t* flags,
                        int* budget);

// The tokens (b, h) attends: the members of the flagged clusters (in cluster order) followed
// by the recent tokens [clustered_len, seq_len).
std::vector<int32_t> selected_tokens_cpu(const PagedKV& kv, int b, int h, const ClusterState& state,
                                         const uint8_t* flags);

// ---- CUDA ---------------------------------------------------------------------------------

// Sets the kernels' shared-memory limits for head_dim, once per process; engines call it at
// construction so that a captured decode step does nothing but launches.
cudaError_t prepare_cuda(int head_dim);

// Prefill: clusters tokens [0, seq_lens_host[b]) of every (b < kv.batch, h) from scratch,
// replacing what state held for those slots. seq_lens_host are the lengths in kv.seq_lens,
// on the host (the caller reads them once; prefill is not part of a captured step). The
// workspace is caller-owned device memory of cluster_prefill_workspace_bytes(kv.batch,
// kv.num_kv_heads, max over b of seq_lens_host[b], km.cluster_size): about 16 bytes a token
// of every (b, h) (the CSR's sort keys and tokens, double-buffered), plus the sort's own.
// Distances are a fused bf16 tensor-core product (mma.sync) with the argmin in the epilogue: the
// n x C distance matrix never reaches memory. Supports head_dim 64 and 128.
size_t cluster_prefill_workspace_bytes(int batch, int num_kv_heads, int max_len, int cluster_size);
cudaError_t cluster_prefill_cuda(const PagedKV& kv, const int32_t* seq_lens_host, int layer,
                                 const KMeansParams& km, const ClusterState& state, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);

// Decode-time re-clustering (spec 8.3): for every (b < kv.batch, h) with seq_len -
// clustered_len >= block_tokens, clusters tokens [clustered_len, clustered_len +
// block_tokens) into block_tokens / cluster_size new clusters. One launch of a thread-block
// cluster of up to 8 CTAs per (b, h) (tensor-core distances, the CSR and the update shared
// through distributed shared memory) that returns at once when nothing is due: no host sync,
// graph-safe. block_tokens must be a multiple of km.cluster_size and fit a CTA's shared
// memory (recluster_block_max_tokens).
int recluster_block_max_tokens(int head_dim, int cluster_size);
cudaError_t recluster_blocks_cuda(const PagedKV& kv, int layer, int block_tokens,
                                  const KMeansParams& km, const ClusterState& state,
                                  cudaStream_t stream);

// Decode selection output: a page table for the "sub-request" view of the cache (spec 2.5):
// one sequence per (b, h), one kv head, page_size 1, rows [b * Hkv + h][i] = physical row of
// the i-th selected token times Hkv plus h. Attention over it is dense decode on
// subrequest_view() with num_q_heads = group size.
struct Selection {
  int32_t* rows = nullptr;      ///< [max_batch * Hkv, max_tokens]
  int32_t* tokens = nullptr;    ///< [max_batch * Hkv, max_tokens] the same as token ids
  int32_t* counts = nullptr;    ///< [max_batch * Hkv] selected + recent tokens
  int32_t* selected = nullptr;  ///< [max_batch, Hq] tokens each query head selected (rounded)
  int max_tokens = 0;
};

PagedKV subrequest_view(const PagedKV& kv, const Selection& sel);

// Device counters the selection adds to when non-null: [0] rows attended (sum of counts),
// [1] selection bytes read (centroids + sampled keys). ranked_min is the number of clusters
// at the top of each (sequence, query head) order that the order kernel ranks at least, beside
// those of the exact and window samples (-1: 512); the budget's cut past them is found from
// the order kernel's bucket groups and a rank of the cut's group (slower than within the ranked
// top). Every value gives the same selection.
size_t select_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int max_clusters, int max_tokens, const FitParams& fit);
cudaError_t select_tokens_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                               const FitParams& fit, const ClusterState& state,
                               const Selection& sel, unsigned long long* counters, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, int ranked_min = -1);

// Largest number of samples (exact + windows) one head takes for lists of <= max_tokens.
int max_samples(int max_tokens, const FitParams& fit);

}  // namespace kvs::kernels::tactic
