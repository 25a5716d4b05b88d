// MagicPIG behind the Engine interface (spec shared/specs/magicpig.md; kernels in
// kernels/magicpig/magicpig.h).
//
// Estimator. Per sparse layer, sequence b and kv head h, the prompt's tokens split into the
// sink [0, sink), the hashed range [sink, n - local) and the local window; every token
// decoded after prefill is "new". Sink, local and new tokens are attended exactly; a hashed
// key is attended iff it shares a SimHash bucket with the query in >= 2 of L tables, with
// its logit shifted by -log(u + epsilon), u = P[Binomial(L, p^K) >= 2], p = 1 - angle/pi
// between the query and the centred key. The two partial results (o, lse) merge exactly
// (merge_states). The estimator is consistent, not unbiased (spec 8.18): its randomness is
// the hyperplane draw, fixed for a run.
//
// Modes (MagicPigConfig::mode), one engine:
//   Backend::Cpu               the fp64 reference: candidates counted from stored key codes
//                              (no tables), attention through attend_cpu_shifted.
//   Backend::Cuda, cpu_offload the paper's system. Per decode(): the query codes are computed
//                              on the GPU and copied with q to pinned host buffers; a host
//                              function (cudaLaunchHostFunc on the engine's side stream) runs
//                              retrieval + sampled attention on the thread pool (AVX-512 /
//                              AVX2 / portable, chosen at run time) and its (o, lse) is copied
//                              back; meanwhile the main stream runs the dense part
//                              (dense_decode_cuda over a sub-request view of sink + local +
//                              new tokens); an event joins the two before the merge kernel.
//   Backend::Cuda, gpu         tables, norms and centre on the device; each (b, query head)
//                              has up to kMaxSplits CTAs (enough to fill the device), each
//                              owning a contiguous range of hashed ids: it retrieves its
//                              part of every bucket into 2-bit hit maps in shared memory,
//                              attends its keys hit twice straight from the paged cache and
//                              leaves a partial (o, lse); the merge kernel folds the splits
//                              and the dense part together.
//
// CUDA graphs. GPU-only mode: decode() is launches only (no sync, no allocation, no host
// copy): capturable like the dense engine. cpu_offload: decode() is kernels, async copies
// to/from fixed pinned buffers, event record/wait across the side stream and a host
// function, all of which stream capture records (the side stream forks from the captured
// stream through the event), so it is capturable too, with two differences from a GPU-only
// graph: the host node runs on the driver's callback thread and blocks that stream until
// the CPU work is done (graph replays of different layers serialise on it), and the CPU
// part sees the batch fixed at capture. The engine's own host statistics are updated in
// the host function.
//
// Choices where the paper is silent (spec section 8) or where this runtime differs:
// - Centre (8.2): mean of the hashed keys only, fp64 sums in fixed 1024-token blocks (same
//   order on host and device), frozen after prefill. Keys in the cache are never modified:
//   the logits use the raw keys (so the dense and sampled parts share one softmax without
//   centring the GPU keys), and only the angle for u uses q.(k - c) = q.k - q.c with the
//   stored fp32 norm |k - c| (8.3). Queries are not centred.
// - Hashing (8.8, 8.9): one fp32 [d, K L] projection from `seed` for all heads and layers
//   (fp32, not the paper's bf16: u assumes exact Gaussian hyperplanes; 768 KB at (10, 150)).
//   Projections are sequential fp32 FMA chains, identical on host and device, so every mode
//   retrieves the same candidates. Bit j of table l is column l K + j, weight 2^j, test > 0.
// - Tables: per (layer, b, kv head, table) CSR with int32 ids and 2^K + 1 offsets, built on
//   the CPU by counting sort from GPU codes (GPU-only mode uploads them). int32 ids always
//   (8.11's uint16 halving is not done): L * 4 bytes per token per kv head.
// - Capacity: a layer's arrays are sized by the longest hashed range of the batch at
//   prefill ([B, Hkv, ..., cap]); shorter sequences waste the difference.
// - Candidates are per query head (8.20); retrieval counts hits with saturating counters.
// - No candidate (8.5): the sampled part is empty (lse = -inf): the output is the dense
//   part alone. Prompts shorter than sink + local hash nothing: exact dense attention.
// - New tokens (8.6, 8.7): stay dense for the rest of the sequence (never hashed); the
//   local window does not slide. decode() needs seq_len <= max_context.
// - Offload: the hashed rows are copied to host memory at prefill and never read from the
//   GPU again by this engine (the dense part reads only sink, local and new rows), so a
//   caller that owns its pages may reuse those. The engine cannot free them itself.
// - Dense layers: {0, num_layers / 2} by default (8.10's "every 16th" fits 32 layers only).
// - u in fp32 on the production paths, fp64 in the reference; a zero centred key gets
//   cos = 0.
// - Limits: CUDA backend L <= 768 (key hashing keeps a tile's codes in 48 KB of shared
//   memory); GPU-only mode needs 2 bits of shared memory per hashed token (its hit maps)
//   for the case of one split, about 880K tokens on an H100; head_dim 64 or 128, group
//   size <= 8 (dense_decode_cuda).
// - Prefill (CUDA): centre, norms and codes on the GPU (CUDA cores, fp32: tensor cores
//   would round the inputs and break the CPU/GPU bit agreement), one sequence at a time;
//   codes go to pinned memory and the tables are built by counting sort on the thread pool.
//   It synchronises and allocates; it is not part of a captured step.
//
// last_read (CUDA backend) reads the last decode's dense counts and (gpu mode) hit maps from
// the bound workspace: the workspace must still be bound and not reused since that decode.
//
// Stats: kv_rows_read = dense rows (once per kv head) + candidates (per query head, as the
// CPU path reads them per head); selection_bytes_read = table ids scanned * 4; kv_rows_context
// = seq_len * Hkv. magicpig_stats() adds the retrieval rate (candidates / hashed keys, per
// query head).
#pragma once

#include <memory>
#include <vector>

#include "kernels/common/thread_pool.h"
#include "kernels/magicpig/magicpig.h"
#include "runtime/engine.h"
#include "runtime/engine_support.h"

namespace kvs {

namespace h5 {
class Group;
}

// The projection in a bundle's magicpig group: dataset "projection" [head_dim, K * L] fp32,
// attributes bits, tables, seed, head_dim.
void save_magicpig_projection(const h5::Group& group, const kernels::magicpig::Projection& p);
kernels::magicpig::Projection load_magicpig_projection(const h5::Group& group);
// validate_stored_parts for Method::MagicPig: a loadable projection of the model's head_dim.
void check_magicpig_projection(const h5::Group& group, const ModelShape& shape);

// make_engine's MagicPIG case. The projection comes from config.magicpig.projection if set,
// else from the bundle's "magicpig" group if there is one (its K and L must equal the
// config's), else from config.magicpig.seed.
std::unique_ptr<Engine> make_magicpig_engine(const ModelShape& shape, const EngineConfig& config,
                                             const Bundle* bundle);

struct MagicPigStats {
  uint64_t candidates = 0;     ///< keys retrieved, summed over query heads and calls
  uint64_t hashed_keys = 0;    ///< hashed keys the same queries could retrieve
  uint64_t table_entries = 0;  ///< bucket entries scanned
  double retrieval_rate() const { return hashed_keys ? double(candidates) / hashed_keys : 0.0; }
};

class MagicPigEngine : public Engine {
 public:
  MagicPigEngine(const ModelShape& shape, const EngineConfig& config);
  ~MagicPigEngine() override;
  MagicPigEngine(const MagicPigEngine&) = delete;
  MagicPigEngine& operator=(const MagicPigEngine&) = delete;

  Method method() const override { return Method::MagicPig; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override;
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out, float* lse,
              cudaStream_t stream) override;
  EngineStats stats() const override;
  void reset_stats() override;
  std::vector<std::vector<int32_t>> last_read(int layer, int b) const override;

  const MagicPigConfig& magicpig_config() const { return config_.magicpig; }
  const kernels::magicpig::Projection& projection() const { return projection_; }
  MagicPigStats magicpig_stats() const;
  bool is_dense_layer(int layer) const;
  int max_context() const { return max_context_; }
  kernels::magicpig::CpuIsa cpu_isa() const { return isa_; }
  // Bytes of the layer's hash tables (ids + offsets), wherever they live; 0 before prefill.
  size_t table_bytes(int layer) const;
  // The hashed range [start, start + len) of sequence b in `layer` (after prefill).
  std::pair<int, int> hashed_range(int layer, int b) const;

  struct Layer;  // per-layer state (magicpig_engine.cpp)

 private:
  void prefill_cpu(int layer, const PagedKV& kv);
  void prefill_cuda(int layer, const PagedKV& kv, cudaStream_t stream);
  void decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse);
  void decode_cuda(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse,
                   cudaStream_t stream);
  void run_cpu_part(int layer, int batch);  // the host function's work
  static void CUDART_CB host_entry(void* task);
  Layer& checked_layer(int layer, const char* who) const;
  void add_dense_stats(const PagedKV& kv) const;

  kernels::magicpig::Params params_;
  kernels::magicpig::Projection projection_;
  kernels::magicpig::CpuIsa isa_ = kernels::magicpig::CpuIsa::Portable;
  std::vector<int> dense_layers_;
  int max_context_ = 0;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<kernels::ThreadPool> pool_;
  std::vector<kernels::magicpig::HeadScratch> scratch_;  // one per pool worker
  struct Staging;
  std::unique_ptr<Staging> staging_;  // cpu_offload pinned buffers, side stream, events
  float* device_w_ = nullptr;
  DeviceCounters device_counters_;  // [dense rows, candidates, scanned, context]
  int last_gpu_layer_ = -1;
  int sm_count_ = 1;  // CUDA backend: sizes the GPU-only mode's splits per query head
  mutable EngineStats host_stats_;
  mutable MagicPigStats host_mp_;
};

}  // namespace kvs
