// kvs-bench-saap: SAAP decode (index step + query MLP + top-l + gather + sparse attention: the
// whole attention phase of one layer, SaapEngine::decode on CUDA) against our dense kernel
// (kernels::dense_decode_cuda) in the same run, timed as CUDA-graph replays (median).
//
// Scene per context: `layers` independent layers, each with random router weights (the
// paper's MLP shape, batch norm at identity) and unit-norm random centroids; the pre-RoPE keys
// are clustered around them (key = 3 c_z + uniform noise, z uniform over the C centroids, so
// clusters are balanced as k-means makes them), RoPE'd into a paged bf16 cache of 16-token
// pages; values and queries are random. Each layer is prefilled with context - 1 tokens
// (index build, timed once) and decoded at the context, so every replay also assigns the token
// that leaves the recent window (the index lengths are restored at the head of each replay,
// and the copies' measured cost is subtracted). The
// `layers` decodes run in sequence inside one graph so the L2 never holds the next
// call's KV or weights; time per call = median replay time / layers. A timed step that folds
// the index (--generated k * fold_every - 1) needs --restore-index: the whole index is then
// restored before each replay, its copies' cost subtracted the same way. The
// selected token count (sink + window + l clusters) is read back and printed with the KV
// bytes each side reads.
// A generation's average step is the row of a step that does not fold (with fold_every at most
// kernels::saap::kAttendScanRound every such step costs the same) plus the fold's cost over
// fold_every steps: the fold is the step that folds (--restore-index --timed-step index
// --generated k * fold_every - 1) less the step that only indexes (the same with index_every
// fewer generated). scripts/gpu_check.sh times all three and scripts/results.py joins them.
// --json writes every row with its dense time (docs/formats.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/common/rope.h"
#include "kernels/common/thread_pool.h"
#include "kernels/dense/dense_decode.h"
#include "runtime/kv_cache.h"
#include "runtime/saap_engine.h"
#include "tools/bench/bench_common.h"

namespace po = boost::program_options;

namespace kvs {
namespace {

__device__ __forceinline__ float hash_unit(uint64_t i, uint32_t seed) {
  return float(bench::hash_index(i, seed)) * (1.f / 4294967296.f);  // [0, 1)
}

__global__ void fill_uniform(__nv_bfloat16* x, size_t n, float lo, float hi, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(lo + (hi - lo) * hash_unit(i, seed));
}

// keys [n, Hkv, d] pre-RoPE: 3 * centroid[h][z] + U(-0.3, 0.3), z = hash(t, h) mod C.
__global__ void fill_clustered_keys(__nv_bfloat16* k, int n, int hkv, int d, const float* cent,
                                    int C, uint32_t seed) {
  const size_t total = size_t(n) * hkv * d;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t row = i / d;
    const int h = int(row % hkv), j = int(i % d);
    const int z = int(hash_unit(row, seed ^ 0xC1u) * float(C)) % C;
    const float noise = 0.6f * hash_unit(i, seed) - 0.3f;
    k[i] = __float2bfloat16_rn(3.f * cent[(size_t(h) * C + z) * d + j] + noise);
  }
}

template <typename T>
using Dev = bench::DeviceBuffer<T>;
using bench::time_graph;

constexpr int kPageSize = 16;  ///< tokens per KV page

struct Args {
  std::vector<int> contexts{131072, 524288};
  int batch = 1, hq = 32, hkv = 8, d = 128, clusters = 1024, probes = 32, hidden = 1024;
  int sink = 1, recent = 2047, layers = 4, iters = 100;
  int generated = 0;  ///< decode steps between the prefill and the timed step
  int fold_every = SaapConfig().fold_every;
  int index_every = SaapConfig().index_every;
  bool restore_index = false;  ///< restore the whole index per replay (see run())
  bool no_member_rows = false;  ///< SaapConfig::member_rows off: members through the page table
  /// mix: the layers index on the engine's staggered steps (SaapConfig::index_phase -1);
  /// index / plain: every layer indexes on the timed step / on none.
  std::string timed_step = "mix";
  std::string router = "mlp";
  std::string router_weights = "fp8";
  uint32_t seed = 7;
};

// Each indexed layer's arrays (slot i of per_layer) come from their own generator, seeded by
// (seed, i), so that the layers are drawn in parallel (about 1 s a layer on one core at the
// default shapes).
SaapParts random_parts(const Args& a) {
  SaapParts p;
  p.num_clusters = a.clusters;
  p.hidden_dim = a.hidden;
  p.head_dim = a.d;
  p.num_q_heads = a.hq;
  p.num_kv_heads = a.hkv;
  p.probes = a.probes;
  p.sink_tokens = a.sink;
  p.recent_tokens = a.recent;
  p.dense_layers = {0};
  for (int l = 1; l <= a.layers; ++l) p.layers.push_back(l);
  p.allocate();
  kernels::ThreadPool pool(0);
  pool.parallel_for(int64_t(p.per_layer.size()), [&](int64_t i, int) {
    SaapLayerParts& l = p.per_layer[size_t(i)];
    std::seed_seq seq{a.seed, uint32_t(i)};
    std::mt19937_64 rng(seq);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t c = 0; c < l.centroids.size() / size_t(a.d); ++c) {
      double s = 0.0;
      float* row = l.centroids.data() + c * a.d;
      for (int j = 0; j < a.d; ++j) {
        row[j] = normal(rng);
        s += double(row[j]) * row[j];
      }
      for (int j = 0; j < a.d; ++j) row[j] = float(row[j] / std::sqrt(s));
    }
    const float s1 = 1.f / std::sqrt(float(a.d)), s2 = 1.f / std::sqrt(float(a.hidden));
    for (float& w : l.w1) w = normal(rng) * s1;
    for (float& w : l.w2) w = normal(rng) * s2;
    for (float& b : l.b1) b = 0.1f * normal(rng);
    for (float& b : l.b2) b = 0.1f * normal(rng);
  });
  return p;
}

void run(const Args& a, bench::BenchReport& report) {
  const int max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  ModelShape shape;
  shape.name = "bench";
  shape.num_layers = a.layers + 1;
  shape.num_q_heads = a.hq;
  shape.num_kv_heads = a.hkv;
  shape.head_dim = a.d;
  shape.max_position = max_ctx;
  shape.rope.theta = 500000.0;
  SaapParts parts = random_parts(a);
  std::vector<std::unique_ptr<Dev<float>>> cent_dev;
  for (const SaapLayerParts& l : parts.per_layer) {
    cent_dev.push_back(std::make_unique<Dev<float>>(l.centroids.size()));
    KVS_CUDA_CHECK(cudaMemcpy(cent_dev.back()->p, l.centroids.data(),
                              l.centroids.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  EngineConfig cfg;
  cfg.backend = Backend::Cuda;
  cfg.max_batch = a.batch;
  cfg.saap.probes = a.probes;
  cfg.saap.sink_tokens = a.sink;
  cfg.saap.recent_tokens = a.recent;
  cfg.saap.query_router = saap_router_from_string(a.router);
  cfg.saap.router_weights = saap_weights_from_string(a.router_weights);
  cfg.saap.max_context = max_ctx;
  cfg.saap.fold_every = a.fold_every;
  cfg.saap.index_every = a.index_every;
  cfg.saap.member_rows = !a.no_member_rows;
  // The timed step's tokens past the window, m = n - recent, is ctx - recent at every context
  // (check_contexts keeps its residue mod index_every the same): "index" puts every layer's
  // phase where that step indexes, "plain" where the step before it did.
  const int m_mod = (a.contexts[0] - a.recent) % a.index_every, ie = a.index_every;
  if (a.timed_step == "index") {
    cfg.saap.index_phase = (ie - m_mod) % ie;
  } else if (a.timed_step == "plain") {
    if (ie == 1) throw std::invalid_argument("--timed-step plain needs --index-every > 1");
    cfg.saap.index_phase = (ie - (m_mod + ie - 1) % ie) % ie;
  } else if (a.timed_step != "mix") {
    throw std::invalid_argument("--timed-step must be mix, index or plain, got " + a.timed_step);
  }
  SaapEngine engine(shape, cfg, std::move(parts));  // the engine keeps the host copies
  Dev<char> ws(engine.workspace_bytes());
  engine.bind_workspace({ws.p, engine.workspace_bytes()});

  KVCacheConfig cc;
  cc.num_layers = shape.num_layers;
  cc.num_kv_heads = a.hkv;
  cc.head_dim = a.d;
  cc.page_size = kPageSize;
  cc.max_batch = a.batch;
  cc.max_seq_len = max_ctx;
  cc.device = Device::Cuda;
  KVCache cache(cc);
  for (int b = 0; b < a.batch; ++b) cache.reserve(b, max_ctx);
  const std::vector<float> inv_freq = rope_inv_freq(shape.rope, a.d);
  Dev<float> inv_freq_dev(inv_freq.size());
  KVS_CUDA_CHECK(cudaMemcpy(inv_freq_dev.p, inv_freq.data(), inv_freq.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
  std::vector<int32_t> iota(static_cast<size_t>(max_ctx));
  for (int i = 0; i < max_ctx; ++i) iota[size_t(i)] = i;
  Dev<int32_t> pos_dev(iota.size());
  KVS_CUDA_CHECK(cudaMemcpy(pos_dev.p, iota.data(), iota.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  {
    Dev<bf16> k(size_t(max_ctx) * a.hkv * a.d), v(size_t(max_ctx) * a.hkv * a.d);
    for (int l = 1; l <= a.layers; ++l)
      for (int b = 0; b < a.batch; ++b) {
        const size_t n = size_t(max_ctx) * a.hkv * a.d;
        fill_clustered_keys<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(k.p), max_ctx, a.hkv,
                                           a.d, cent_dev[size_t(l - 1)]->p, a.clusters,
                                           a.seed * 131u + uint32_t(l * 17 + b));
        KVS_CUDA_CHECK(cudaGetLastError());
        KVS_CUDA_CHECK(kernels::rope_cuda(k.p, max_ctx, a.hkv, a.d, int64_t(a.hkv) * a.d, pos_dev.p,
                                          inv_freq_dev.p, false, nullptr));
        fill_uniform<<<4096, 256>>>(reinterpret_cast<__nv_bfloat16*>(v.p), n, -1.f, 1.f,
                                    a.seed * 977u + uint32_t(l * 31 + b));
        KVS_CUDA_CHECK(cudaGetLastError());
        cache.write(l, b, 0, max_ctx, k.p, v.p);
      }
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const size_t qn = size_t(a.batch) * a.hq * a.d;
  Dev<bf16> q(qn), q_pre(qn), out(qn);
  Dev<float> lse(size_t(a.batch) * a.hq);
  fill_uniform<<<256, 256>>>(reinterpret_cast<__nv_bfloat16*>(q_pre.p), qn, -2.f, 2.f, a.seed + 5);
  fill_uniform<<<256, 256>>>(reinterpret_cast<__nv_bfloat16*>(q.p), qn, -2.f, 2.f, a.seed + 6);
  KVS_CUDA_CHECK(cudaGetLastError());
  const size_t dense_ws_bytes = kernels::dense_decode_workspace_bytes(a.batch, a.hq, a.d);
  Dev<char> dense_ws(dense_ws_bytes);
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const float scale = float(shape.scale());

  // The timed step is step generated + 1 since the prefill. Layer l's phase, and with it the
  // layers that index on the timed step (kernels/saap/saap.h, index_step_count).
  const auto phase = [&](int l) { return engine.index_phase(l); };
  std::string indexing;
  for (int l = 1; l <= a.layers; ++l)
    if ((m_mod + phase(l)) % ie == 0)
      indexing += (indexing.empty() ? "" : ", ") + std::to_string(l);
  const std::string timed = "the timed step indexes in " +
                            (indexing.empty() ? std::string("no layer") : "layers " + indexing) +
                            " of 1-" + std::to_string(a.layers);
  std::printf(
      "kvs-bench-saap: Hq %d Hkv %d d %d, batch %d, C %d, l %d, hidden %d, router %s "
      "(%s weights, w2 %s), dense part %d + %d, %d tokens generated since the prefill (index "
      "steps of up to %d tokens, %s; folded every %d), members' KV rows %s, %d layers per "
      "graph, median of %d replays\n",
      a.hq, a.hkv, a.d, a.batch, a.clusters, a.probes, a.hidden, a.router.c_str(),
      a.router_weights.c_str(),
      saap_w2_in_column_blocks(cfg.max_batch) ? "in column blocks, zero hidden units skipped"
                                              : "in fragment order",
      a.sink, a.recent, a.generated, a.index_every, timed.c_str(), a.fold_every,
      a.no_member_rows ? "through the page table" : "kept with the index", a.layers, a.iters);
  const double weight_bytes = cfg.saap.router_weights == SaapWeights::Fp8 ? 1 : 2;
  const double mlp_mb = a.router == "mlp"
                            ? double(a.hq) * (double(a.hidden) * a.d + double(a.clusters) * a.hidden) * weight_bytes / 1e6
                            : double(a.hkv) * a.clusters * a.d * 4 / 1e6;
  std::printf("%9s %12s %10s %10s %10s %10s %9s %12s\n", "context", "prefill_ms", "tokens/kvh",
              "KV_MB", "router_MB", "saap_us", "dense_us", "speedup");
  for (int ctx : a.contexts) {
    // Prefill ctx - 1 - generated tokens, decode `generated` steps eagerly, then time the
    // step at ctx, as a real step does: one token per (sequence, kv head) leaves the recent
    // window, the index step assigns the pending ones when index_every of them are (the
    // header says whether the timed step does), and the decode scans the assignments made
    // since the prefill. Every replay restores the index lengths first (copies inside the
    // graph, their cost subtracted), so it repeats that step.
    if (a.generated < 0 || a.generated > ctx - 1 - a.sink - a.recent)
      throw std::invalid_argument("--generated " + std::to_string(a.generated) + " must lie in [0, " +
                                  std::to_string(ctx - 1 - a.sink - a.recent) + "] at context " +
                                  std::to_string(ctx) + " (the prefill must fill the window)");
    // A replay restores indexed_len, which undoes the step's assignment. A step that folds
    // also rewrites the CSR: --restore-index restores the whole index. Layer l has assigned
    // indexed(m) - m0 tokens once m have left the window (m0 at the prefill).
    const int m0 = ctx - 1 - a.generated - a.recent;
    for (int l = 1; l <= a.layers; ++l) {
      const auto assigned = [&](int m) { return std::max(0, m - (m + phase(l)) % ie - m0); };
      if (a.fold_every > 0 && !a.restore_index &&
          assigned(m0 + a.generated + 1) / a.fold_every > assigned(m0 + a.generated) / a.fold_every)
        throw std::invalid_argument("--generated " + std::to_string(a.generated) +
                                    ": the timed step folds layer " + std::to_string(l) +
                                    "'s index (--fold-every " + std::to_string(a.fold_every) +
                                    "); time it with --restore-index, or choose another count");
    }
    cache.set_lengths(std::vector<int>(size_t(a.batch), ctx - 1 - a.generated));
    cudaEvent_t e0, e1;
    KVS_CUDA_CHECK(cudaEventCreate(&e0));
    KVS_CUDA_CHECK(cudaEventCreate(&e1));
    KVS_CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int l = 1; l <= a.layers; ++l) engine.prefill(l, cache.view(l), stream);
    KVS_CUDA_CHECK(cudaEventRecord(e1, stream));
    KVS_CUDA_CHECK(cudaEventSynchronize(e1));
    float prefill_ms = 0.f;
    KVS_CUDA_CHECK(cudaEventElapsedTime(&prefill_ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    for (int s = 0; s < a.generated; ++s) {
      cache.set_lengths(std::vector<int>(size_t(a.batch), ctx - a.generated + s));
      for (int l = 1; l <= a.layers; ++l)
        engine.decode(l, q.p, q_pre.p, cache.view(l), out.p, lse.p, stream);
    }
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    cache.set_lengths(std::vector<int>(size_t(a.batch), ctx));
    // The index arrays a replay restores, as they were before the timed step: indexed_len
    // always; with --restore-index also csr_len, the offsets and the members (and their rows).
    std::vector<std::vector<std::pair<int32_t*, std::unique_ptr<Dev<int32_t>>>>> saved;
    for (int l = 1; l <= a.layers; ++l) {
      const kernels::saap::IndexState& st = engine.index_state(l);
      const size_t slots = size_t(a.batch) * a.hkv;
      std::vector<std::pair<int32_t*, size_t>> arrays = {{st.indexed_len, slots}};
      if (a.restore_index) {
        arrays.push_back({st.csr_len, slots});
        arrays.push_back({st.offsets, slots * (size_t(a.clusters) + 1)});
        arrays.push_back({st.members, slots * size_t(st.max_tokens)});
        if (st.member_rows) arrays.push_back({st.member_rows, slots * size_t(st.max_tokens)});
      }
      saved.emplace_back();
      for (auto [ptr, n] : arrays) {
        auto copy = std::make_unique<Dev<int32_t>>(n);
        KVS_CUDA_CHECK(cudaMemcpyAsync(copy->p, ptr, n * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, stream));
        saved.back().emplace_back(ptr, std::move(copy));
      }
    }
    auto restore = [&](int l) {
      for (const auto& [ptr, copy] : saved[size_t(l - 1)])
        KVS_CUDA_CHECK(cudaMemcpyAsync(ptr, copy->p, copy->n * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, stream));
    };
    // Every replay first restores the index arrays of all layers, then runs the layers' steps
    // back to back. The copies are the benchmark's, not the step's: their cost inside the chain
    // is a graph of the copies done twice less a graph of them done once (both pay one graph
    // launch), and it is subtracted.
    auto restore_all = [&] {
      for (int l = 1; l <= a.layers; ++l) restore(l);
    };
    float saap_ms = time_graph(stream, a.iters, [&] {
      restore_all();
      for (int l = 1; l <= a.layers; ++l)
        engine.decode(l, q.p, q_pre.p, cache.view(l), out.p, lse.p, stream);
    });
    const float restore_ms = std::max(0.f, time_graph(stream, a.iters, [&] {
                                             restore_all();
                                             restore_all();
                                           }) - time_graph(stream, a.iters, restore_all));
    saap_ms -= restore_ms;
    std::printf("# the index copies (%s), %.1f us per layer, are subtracted\n",
                a.restore_index ? "lengths, offsets and members" : "indexed_len",
                1000.0 * restore_ms / a.layers);
    // Tokens the last layer's decode attended (mean over kv heads of sequence 0).
    const auto read = engine.last_read(a.layers, 0);
    double tokens = 0.0;
    for (int h = 0; h < a.hkv; ++h) tokens += double(read[size_t(h) * (a.hq / a.hkv)].size());
    tokens /= a.hkv;
    const float dense_ms = time_graph(stream, a.iters, [&] {
      for (int l = 1; l <= a.layers; ++l)
        KVS_CUDA_CHECK(kernels::dense_decode_cuda(q.p, a.hq, cache.view(l), scale, out.p, lse.p,
                                                  dense_ws.p, dense_ws_bytes, stream));
    });
    const double kv_mb = tokens * a.hkv * a.batch * a.d * 2 * 2 / 1e6;
    const double saap_us = 1000.0 * saap_ms / a.layers, dense_us = 1000.0 * dense_ms / a.layers;
    std::printf("%9d %12.1f %10.0f %10.1f %10.1f %10.1f %9.1f %11.2fx\n", ctx,
                prefill_ms / a.layers, tokens, kv_mb, mlp_mb, saap_us, dense_us,
                dense_us / saap_us);
    std::fflush(stdout);
    report.add_row({{"context", ctx},
                    {"batch", a.batch},
                    {"prefill_ms", prefill_ms / a.layers},
                    {"tokens_per_kv_head", tokens},
                    {"kv_mb", kv_mb},
                    {"router_mb", mlp_mb},
                    {"saap_us", saap_us},
                    {"dense_us", dense_us},
                    {"speedup", dense_us / saap_us},
                    {"restore_us", 1000.0 * restore_ms / a.layers}});
  }
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) try {
  kvs::Args a;
  std::string contexts = "131072,524288", json_path;
  po::options_description opts("kvs-bench-saap: SAAP decode vs dense decode (CUDA graphs)");
  opts.add_options()("help,h", "show this help")("contexts",
                                                 po::value(&contexts)->default_value(contexts),
                                                 "context lengths, comma-separated")(
      "batch", po::value(&a.batch)->default_value(a.batch), "sequences")(
      "hq", po::value(&a.hq)->default_value(a.hq), "query heads")(
      "hkv", po::value(&a.hkv)->default_value(a.hkv), "kv heads")(
      "head-dim", po::value(&a.d)->default_value(a.d), "head dim (64 or 128)")(
      "clusters", po::value(&a.clusters)->default_value(a.clusters), "C")(
      "probes", po::value(&a.probes)->default_value(a.probes), "l")(
      "hidden", po::value(&a.hidden)->default_value(a.hidden), "MLP hidden width")(
      "sink", po::value(&a.sink)->default_value(a.sink), "sink tokens")(
      "recent", po::value(&a.recent)->default_value(a.recent), "recent window")(
      "generated", po::value(&a.generated)->default_value(a.generated),
      "decode steps after the prefill, before the timed step (assignments it scans)")(
      "fold-every", po::value(&a.fold_every)->default_value(a.fold_every),
      "assignments merged into the cluster index at a time (0: never)")(
      "index-every", po::value(&a.index_every)->default_value(a.index_every),
      "tokens that left the window assigned per index step (the step on which that many are "
      "pending)")(
      "timed-step", po::value(&a.timed_step)->default_value(a.timed_step),
      "mix: each layer indexes on its own steps (the engine's default), so that with --layers = "
      "--index-every the time is the average step; index / plain: every layer indexes on the timed "
      "step (index_every tokens when --generated is at least index_every - 1) / on none")(
      "restore-index", po::bool_switch(&a.restore_index),
      "restore the whole index before each replay and subtract the copies' own time (needed to "
      "time a step that folds: --generated k * fold_every - 1)")(
      "no-member-rows", po::bool_switch(&a.no_member_rows),
      "resolve the clusters' members to KV rows through the page table (SaapConfig::member_rows "
      "off)")("router", po::value(&a.router)->default_value(a.router), "mlp or nearest_centroid")(
      "router-weights", po::value(&a.router_weights)->default_value(a.router_weights),
      "the MLP's weights: bf16 or fp8")("layers", po::value(&a.layers)->default_value(a.layers),
                                        "layers decoded per graph (L2 rotation)")(
      "iters", po::value(&a.iters)->default_value(a.iters), "timed replays (median)")(
      "seed", po::value(&a.seed)->default_value(a.seed), "data seed")(
      "json", po::value(&json_path), "also write the table as JSON to this path");
  if (!kvs::cli::parse_options(argc, argv, opts)) return 0;
  a.contexts = kvs::bench::parse_counts(contexts, "contexts");
  if (a.index_every < 1) throw std::invalid_argument("--index-every must be >= 1");
  for (int ctx : a.contexts)
    if ((ctx - a.recent) % a.index_every != (a.contexts[0] - a.recent) % a.index_every)
      throw std::invalid_argument("--contexts: " + std::to_string(ctx) + " and " +
                                  std::to_string(a.contexts[0]) +
                                  " leave the timed step at different index phases (their "
                                  "difference is not a multiple of --index-every)");
  if (!kvs::cuda_device_available()) throw std::runtime_error("no CUDA device");
  if (a.layers < 1 || a.iters < 1 || a.batch < 1)
    throw std::invalid_argument("--layers, --iters and --batch must be >= 1");
  kvs::bench::BenchReport report("kvs_saap", kvs::cli::command_line(argc, argv), json_path);
  report.meta().add({{"batch", a.batch},
                     {"hq", a.hq},
                     {"hkv", a.hkv},
                     {"head_dim", a.d},
                     {"page_size", kvs::kPageSize},
                     {"clusters", a.clusters},
                     {"probes", a.probes},
                     {"hidden", a.hidden},
                     {"sink", a.sink},
                     {"recent", a.recent},
                     {"generated", a.generated},
                     {"fold_every", a.fold_every},
                     {"index_every", a.index_every},
                     {"restore_index", a.restore_index},
                     {"member_rows", !a.no_member_rows},
                     {"timed_step", a.timed_step},
                     {"router", a.router},
                     {"router_weights", a.router_weights},
                     {"layers", a.layers},
                     {"iters", a.iters},
                     {"seed", a.seed}});
  report.save();
  kvs::run(a, report);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-bench-saap: error: %s\n", e.what());
  return 1;
}
