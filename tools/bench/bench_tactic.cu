// kvs-bench --method tactic.
//
// Synthetic but realistically skewed scene per (sequence, kv head): keys from `components`
// Gaussian components; component c sits at logit L_c = -2 ln(rank_c) along the query
// direction u (ranks a permutation), plus unit-variance parts orthogonal-ish to u and a small
// per-token noise. exp(L) ~ rank^-2 puts ~90 % of the attention mass on the top ~8 of 512
// components, i.e. ~1.5 % of the tokens, while the rest forms a long tail, as in the paper's
// sorted score curves. Queries are sqrt(d) * u plus a little per-head noise.
//
// --capture F: the scene from a capture file (kvs-capture) instead, where it fits: for batch
// B and context n, sequences 0 .. B-1 of F, their first n tokens; KV set li of the replay is
// captured layer li mod (the layers captured), so that --layers sets still rotate through
// more memory than the L2 holds when the capture has fewer layers. K = rope(k_pre) and V = v
// of those tokens through a shuffled page table, and each sequence's query is its captured
// q_pre at position n - 1, rotated there: the decode step of that token over the keys the
// model had made. The head counts and head dim are the capture's.
//
// Per (context, batch): the prefill clustering of one layer (all sequences and kv heads) is
// timed with events and set against a dense causal prefill attention estimate (4 n^2 d Hq / 2
// FLOP per sequence at --prefill-tflops). Decode: `layers` KV sets (each with its clusters)
// are decoded in sequence inside one CUDA graph (as a model step would, and so that the L2
// never holds the next layer's data); median replay time / layers is the per-layer time of:
//   tactic  = re-cluster check + selection + sparse attention (the engine's decode path)
//   select  = selection only,  attn = sparse attention only (over the selection made)
//   dense   = dense_decode_cuda over the same KV
// reclu_ms: one layer's step that re-clusters a block of the last 2048 decoded tokens (all
// sequences and kv heads at once), which the timed replays never take.
// Tokens: the union per (sequence, kv head) and the per-query-head selection, as a percent of
// the context. Mass: exp(lse_tactic - lse_dense) per (sequence, query head): the attention
// mass the selection achieved (mean and min).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/rope.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/tactic/tactic.h"
#include "tools/bench/bench_common.h"
#include "tools/bench/bench_tactic.h"

namespace kvs {
namespace {

namespace tk = kernels::tactic;

__device__ __forceinline__ uint32_t mix(uint32_t h) { return bench::fmix32(h); }
__device__ __forceinline__ float unit(uint32_t h) {  // uniform in [-sqrt3, sqrt3): variance 1
  return (float(mix(h)) * (2.f / 4294967296.f) - 1.f) * 1.7320508f;
}
__device__ __forceinline__ float sign_u(int h, int j, int d) {
  return (mix(0xA5A5u ^ uint32_t(h) * 7919u ^ uint32_t(j) * 104729u) & 1u ? 1.f : -1.f) *
         rsqrtf(float(d));
}

// One thread per (b, t, h, j) element of K and V, through the page table.
__global__ void fill_scene(__nv_bfloat16* k, __nv_bfloat16* v, const int32_t* table, int max_pages,
                           int page_size, int batch, int n, int hkv, int d, int components,
                           uint32_t seed) {
  const int64_t total = int64_t(batch) * n * hkv * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(i % d);
    const int h = int((i / d) % hkv);
    const int t = int((i / (int64_t(d) * hkv)) % n);
    const int b = int(i / (int64_t(d) * hkv * n));
    const uint32_t sh = seed * 0x9E3779B1u ^ uint32_t(b) * 0x85EBCA77u ^ uint32_t(h) * 0xC2B2AE3Du;
    const int c = int(mix(sh ^ uint32_t(t) * 0x27D4EB2Fu) % uint32_t(components));
    // rank = (a c + o) mod components + 1 with a odd: a permutation for power-of-two counts,
    // and close to one otherwise.
    const uint32_t a = mix(sh ^ 0x1234u) | 1u, o = mix(sh ^ 0x5678u);
    const int rank = int((a * uint32_t(c) + o) % uint32_t(components)) + 1;
    const float logit = -2.f * logf(float(rank));
    const float key = logit * sign_u(h, j, d) +
                      0.5f * unit(sh ^ uint32_t(c) * 0x165667B1u ^ uint32_t(j) * 0xD3A2646Cu) +
                      0.1f * unit(sh ^ uint32_t(t) * 0xFD7046C5u ^ uint32_t(j) * 0xB55A4F09u);
    const int64_t page = table[int64_t(b) * max_pages + t / page_size];
    const int64_t at = ((page * page_size + t % page_size) * hkv + h) * int64_t(d) + j;
    k[at] = __float2bfloat16_rn(key);
    v[at] = __float2bfloat16_rn(unit(sh ^ uint32_t(t) * 0x94D049BBu ^ uint32_t(j) * 0x2545F491u));
  }
}

__global__ void fill_queries(__nv_bfloat16* q, int batch, int hq, int hkv, int d, uint32_t seed) {
  const int total = batch * hq * d;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int j = i % d, head = (i / d) % hq;
    const int h = head / (hq / hkv);
    q[i] = __float2bfloat16_rn(sqrtf(float(d)) * sign_u(h, j, d) +
                               0.2f * unit(seed ^ uint32_t(i) * 0x9E3779B1u));
  }
}

// Rows [n, hkv, d] of sequence b (contiguous, token-major) into a paged buffer through its
// page table (pages per sequence: max_pages).
__global__ void scatter_to_pages(const __nv_bfloat16* rows, __nv_bfloat16* paged,
                                 const int32_t* table, int max_pages, int page_size, int b, int n,
                                 int hkv, int d) {
  const int64_t row = int64_t(hkv) * d, total = int64_t(n) * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(i / row);
    const int64_t page = table[int64_t(b) * max_pages + t / page_size];
    paged[(page * page_size + t % page_size) * row + i % row] = rows[i];
  }
}

template <typename T>
using Dev = bench::DeviceBuffer<T>;
using bench::time_graph;

struct Layer {
  std::unique_ptr<Dev<bf16>> k, v;
  std::unique_ptr<Dev<int32_t>> table;
  std::unique_ptr<Dev<bf16>> cent;
  std::unique_ptr<Dev<int32_t>> off, mem, nc, cl, mrows;
  std::unique_ptr<Dev<int32_t>> rows, tokens, counts, selected;
  std::unique_ptr<Dev<bf16>> q;  ///< [B, Hq, d], the step's queries, RoPE applied
  tk::ClusterState st;
  tk::Selection sel;
};

// Tokens decoded after the last clustering that are clustered as one block (the engine's
// default recluster_interval).
constexpr int kBlockTokens = 2048;

struct Result {
  int context, batch, layers;
  double cluster_ms, prefill_est_ms, kmeans_tflop, recluster_ms;
  double dense_us, tactic_us, select_us, attn_us;
  double union_pct, head_pct, mass_mean, mass_min, sel_mb;
};

// Layer li's K, V (through l.table) and queries from the capture (see the file comment).
void fill_from_capture(const CaptureFile& cap, int li, int n, int B, int pages, int page_size,
                       Layer& l, cudaStream_t stream) {
  const ModelShape shape = cap.meta().captured_shape();
  const auto& layers = cap.meta().layers;
  const int layer = layers[size_t(li) % layers.size()], hq = shape.num_q_heads;
  const int hkv = shape.num_kv_heads, d = shape.head_dim;
  const std::vector<float> inv_freq = rope_inv_freq(shape.rope, d);
  std::vector<int32_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), 0);
  Dev<float> freq(inv_freq.size());
  Dev<int32_t> pos(positions.size());
  KVS_CUDA_CHECK(cudaMemcpy(freq.p, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice));
  KVS_CUDA_CHECK(cudaMemcpy(pos.p, positions.data(), positions.size() * 4, cudaMemcpyHostToDevice));
  const size_t rows = size_t(n) * hkv * d;
  Dev<bf16> k(rows), v(rows);
  for (int b = 0; b < B; ++b) {
    // The arrays hold every captured token; the first n are the scene's.
    const std::vector<bf16> k_pre = cap.k_pre(b, layer), v_all = cap.v(b, layer);
    const std::vector<bf16> q_pre = cap.q_pre(b, layer);
    KVS_CUDA_CHECK(cudaMemcpy(k.p, k_pre.data(), rows * sizeof(bf16), cudaMemcpyHostToDevice));
    KVS_CUDA_CHECK(cudaMemcpy(v.p, v_all.data(), rows * sizeof(bf16), cudaMemcpyHostToDevice));
    KVS_CUDA_CHECK(cudaMemcpy(l.q->p + size_t(b) * hq * d, q_pre.data() + size_t(n - 1) * hq * d,
                              size_t(hq) * d * sizeof(bf16), cudaMemcpyHostToDevice));
    KVS_CUDA_CHECK(
        kernels::rope_cuda(k.p, n, hkv, d, int64_t(hkv) * d, pos.p, freq.p, false, stream));
    KVS_CUDA_CHECK(kernels::rope_cuda(l.q->p + size_t(b) * hq * d, 1, hq, d, int64_t(hq) * d,
                                      pos.p + (n - 1), freq.p, false, stream));
    for (auto [src, dst] : {std::pair{&k, l.k.get()}, std::pair{&v, l.v.get()}})
      scatter_to_pages<<<1024, 256, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(src->p),
                                                 reinterpret_cast<__nv_bfloat16*>(dst->p),
                                                 l.table->p, pages, page_size, b, n, hkv, d);
    KVS_CUDA_CHECK(cudaGetLastError());
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));  // k, v and pos are rewritten or freed next
  }
}

bool bench_one(const TacticBenchArgs& a, const CaptureFile* cap, int n, int B, cudaStream_t stream,
               Result* r, std::string* note) {
  const int pages = (n + a.page_size - 1) / a.page_size;
  const int64_t num_pages = int64_t(B) * pages;
  const size_t kv_elems = size_t(num_pages) * a.page_size * a.hkv * a.d;
  tk::KMeansParams km;
  km.cluster_size = a.cluster_size;
  tk::FitParams fit;
  fit.target = a.p;
  fit.exact_fraction = a.exact_fraction;
  fit.window_fraction = a.window_fraction;
  fit.window_min = a.window_min;
  const int C = tk::max_clusters_for(n, km.cluster_size);
  const size_t subs = size_t(B) * a.hkv;
  const size_t per_layer = 2 * kv_elems * sizeof(bf16) + subs * C * a.d * sizeof(bf16) +
                           subs * (size_t(C) + 1 + 3 * size_t(n)) * sizeof(int32_t);
  const size_t sel_ws = tk::select_workspace_bytes(B, a.hq, a.hkv, a.d, C, n, fit);
  const size_t sub_ws = kernels::dense_decode_workspace_bytes(B * a.hkv, a.hq / a.hkv, a.d);
  const size_t dense_ws = kernels::dense_decode_workspace_bytes(B, a.hq, a.d);
  const size_t pre_ws = tk::cluster_prefill_workspace_bytes(B, a.hkv, n, km.cluster_size);
  const size_t need = a.layers * per_layer + sel_ws + sub_ws + dense_ws + pre_ws;
  size_t free_bytes = 0, total = 0;
  KVS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (need + (1u << 30) > free_bytes || num_pages * a.page_size * a.hkv >= (int64_t(1) << 31)) {
    std::ostringstream os;
    os << "skipped context " << n << " batch " << B << ": needs " << need / (1 << 20) << " MiB for "
       << a.layers << " layers, " << free_bytes / (1 << 20) << " MiB free";
    *note = os.str();
    return false;
  }
  std::mt19937_64 rng(77 + n + B);
  std::vector<Layer> L(size_t(a.layers));
  Dev<int32_t> lens(static_cast<size_t>(B));
  const std::vector<int32_t> lens_host(size_t(B), n);
  KVS_CUDA_CHECK(cudaMemcpy(lens.p, lens_host.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
  auto view = [&](const Layer& l) {
    PagedKV kv;
    kv.k = l.k->p;
    kv.v = l.v->p;
    kv.page_table = l.table->p;
    kv.seq_lens = lens.p;
    kv.batch = B;
    kv.num_pages = int(num_pages);
    kv.page_size = a.page_size;
    kv.num_kv_heads = a.hkv;
    kv.head_dim = a.d;
    kv.max_pages_per_seq = pages;
    return kv;
  };
  Dev<char> pre(pre_ws);
  cudaEvent_t e0, e1;
  KVS_CUDA_CHECK(cudaEventCreate(&e0));
  KVS_CUDA_CHECK(cudaEventCreate(&e1));
  float cluster_ms = 0.f;
  for (int li = 0; li < a.layers; ++li) {
    Layer& l = L[size_t(li)];
    l.k = std::make_unique<Dev<bf16>>(kv_elems);
    l.v = std::make_unique<Dev<bf16>>(kv_elems);
    std::vector<int32_t> table(static_cast<size_t>(num_pages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    l.table = std::make_unique<Dev<int32_t>>(table.size());
    KVS_CUDA_CHECK(cudaMemcpy(l.table->p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    l.q = std::make_unique<Dev<bf16>>(size_t(B) * a.hq * a.d);
    if (cap) {
      fill_from_capture(*cap, li, n, B, pages, a.page_size, l, stream);
    } else {
      fill_scene<<<4096, 256, 0, stream>>>(
          reinterpret_cast<__nv_bfloat16*>(l.k->p), reinterpret_cast<__nv_bfloat16*>(l.v->p),
          l.table->p, pages, a.page_size, B, n, a.hkv, a.d, a.components, uint32_t(1000 + li));
      fill_queries<<<256, 256, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(l.q->p), B, a.hq,
                                            a.hkv, a.d, 4242u);
      KVS_CUDA_CHECK(cudaGetLastError());
    }
    l.cent = std::make_unique<Dev<bf16>>(subs * C * a.d);
    l.off = std::make_unique<Dev<int32_t>>(subs * (size_t(C) + 1));
    l.mem = std::make_unique<Dev<int32_t>>(subs * n);
    l.nc = std::make_unique<Dev<int32_t>>(subs);
    l.cl = std::make_unique<Dev<int32_t>>(subs);
    if (a.member_rows) l.mrows = std::make_unique<Dev<int32_t>>(subs * n);
    l.rows = std::make_unique<Dev<int32_t>>(subs * n);
    l.tokens = std::make_unique<Dev<int32_t>>(subs * n);
    l.counts = std::make_unique<Dev<int32_t>>(subs);
    l.selected = std::make_unique<Dev<int32_t>>(size_t(B) * a.hq);
    l.st.centroids = l.cent->p;
    l.st.offsets = l.off->p;
    l.st.members = l.mem->p;
    l.st.num_clusters = l.nc->p;
    l.st.clustered_len = l.cl->p;
    l.st.member_rows = a.member_rows ? l.mrows->p : nullptr;
    l.st.max_batch = B;
    l.st.num_kv_heads = a.hkv;
    l.st.head_dim = a.d;
    l.st.max_clusters = C;
    l.st.max_tokens = n;
    l.sel = tk::Selection{l.rows->p, l.tokens->p, l.counts->p, l.selected->p, n};
    // Cluster every layer; time layer 0 (its second run: the first pays one-time setup).
    for (int rep = 0; rep < (li == 0 ? 2 : 1); ++rep) {
      KVS_CUDA_CHECK(cudaEventRecord(e0, stream));
      KVS_CUDA_CHECK(
          tk::cluster_prefill_cuda(view(l), lens_host.data(), li, km, l.st, pre.p, pre_ws, stream));
      KVS_CUDA_CHECK(cudaEventRecord(e1, stream));
      KVS_CUDA_CHECK(cudaEventSynchronize(e1));
      if (li == 0) KVS_CUDA_CHECK(cudaEventElapsedTime(&cluster_ms, e0, e1));
    }
  }

  Dev<bf16> o(size_t(B) * a.hq * a.d), od(size_t(B) * a.hq * a.d);
  Dev<float> lse(size_t(B) * a.hq), lse_dense(size_t(B) * a.hq);
  Dev<char> ws_sel(sel_ws), ws_sub(sub_ws), ws_dense(dense_ws);
  const float scale = cap ? float(cap->meta().shape.scale()) : 1.f / std::sqrt(float(a.d));
  const int g = a.hq / a.hkv;
  auto select = [&](Layer& l, int li) {
    KVS_CUDA_CHECK(tk::recluster_blocks_cuda(view(l), li, kBlockTokens, km, l.st, stream));
    KVS_CUDA_CHECK(tk::select_tokens_cuda(l.q->p, a.hq, view(l), scale, fit, l.st, l.sel, nullptr,
                                          ws_sel.p, sel_ws, stream));
  };
  auto attend = [&](Layer& l) {
    KVS_CUDA_CHECK(kernels::dense_decode_cuda(l.q->p, g, tk::subrequest_view(view(l), l.sel), scale,
                                              o.p, lse.p, ws_sub.p, sub_ws, stream));
  };
  // Eager run first: errors surface here rather than as a broken capture.
  for (int li = 0; li < a.layers; ++li) {
    select(L[size_t(li)], li);
    attend(L[size_t(li)]);
  }
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float t_tactic = time_graph(stream, a.iters, [&] {
    for (int li = 0; li < a.layers; ++li) {
      select(L[size_t(li)], li);
      attend(L[size_t(li)]);
    }
  });
  const float t_select = time_graph(stream, a.iters, [&] {
    for (int li = 0; li < a.layers; ++li) select(L[size_t(li)], li);
  });
  const float t_attn = time_graph(stream, a.iters, [&] {
    for (int li = 0; li < a.layers; ++li) attend(L[size_t(li)]);
  });
  const float t_dense = time_graph(stream, a.iters, [&] {
    for (int li = 0; li < a.layers; ++li)
      KVS_CUDA_CHECK(kernels::dense_decode_cuda(L[size_t(li)].q->p, a.hq, view(L[size_t(li)]),
                                                scale, od.p, lse_dense.p, ws_dense.p, dense_ws,
                                                stream));
  });
  // Mass and token counts of the last layer (o / lse hold its results after the replays).
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> ls = lse.get(), ld = lse_dense.get();
  const std::vector<int32_t> counts = L.back().counts->get(), selected = L.back().selected->get();
  double mass_sum = 0.0, mass_min = 1.0;
  for (size_t i = 0; i < ls.size(); ++i) {
    const double m = std::exp(double(ls[i]) - double(ld[i]));
    mass_sum += m;
    mass_min = std::min(mass_min, m);
  }
  const double union_tokens = std::accumulate(counts.begin(), counts.end(), 0.0) / counts.size();
  const double head_tokens =
      std::accumulate(selected.begin(), selected.end(), 0.0) / selected.size();
  // The step that re-clusters, which the replays above never take (every token is clustered
  // at prefill): layer 0's state rewound as if its last kBlockTokens tokens had been decoded
  // since (clustered_len n - kBlockTokens, their clusters not yet appended), then one
  // recluster_blocks_cuda call timed with events, median of 5. It overwrites the state of the
  // rewound tokens, so it runs after every other measurement.
  double recluster_ms = std::nan("");  // null in the JSON: a context shorter than two blocks
  if (n >= 2 * kBlockTokens) {
    const int c0 = tk::max_clusters_for(n - kBlockTokens, km.cluster_size);
    const std::vector<int32_t> nc(subs, c0), cl(subs, n - kBlockTokens);
    std::vector<float> ms;
    for (int rep = 0; rep < 5; ++rep) {
      KVS_CUDA_CHECK(cudaMemcpyAsync(L[0].nc->p, nc.data(), subs * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream));
      KVS_CUDA_CHECK(cudaMemcpyAsync(L[0].cl->p, cl.data(), subs * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream));
      KVS_CUDA_CHECK(cudaEventRecord(e0, stream));
      KVS_CUDA_CHECK(tk::recluster_blocks_cuda(view(L[0]), 0, kBlockTokens, km, L[0].st, stream));
      KVS_CUDA_CHECK(cudaEventRecord(e1, stream));
      KVS_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0.f;
      KVS_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    // Every slot must have clustered its block, or the figure timed the early return.
    const std::vector<int32_t> after = L[0].cl->get();
    for (int32_t c : after)
      if (c != n) throw std::runtime_error("kvs-bench tactic: the re-clustering step did not run");
    std::sort(ms.begin(), ms.end());
    recluster_ms = ms[ms.size() / 2];
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const tk::FitPlan plan = tk::make_fit_plan(n, fit);
  r->recluster_ms = recluster_ms;
  r->context = n;
  r->batch = B;
  r->layers = a.layers;
  r->cluster_ms = cluster_ms;
  r->prefill_est_ms = 4.0 * double(n) * n * a.d * a.hq / 2.0 * B / (a.prefill_tflops * 1e12) * 1e3;
  r->kmeans_tflop = 2.0 * double(n) * C * a.d * km.iterations * subs / 1e12;
  r->dense_us = t_dense * 1e3 / a.layers;
  r->tactic_us = t_tactic * 1e3 / a.layers;
  r->select_us = t_select * 1e3 / a.layers;
  r->attn_us = t_attn * 1e3 / a.layers;
  r->union_pct = 100.0 * union_tokens / n;
  r->head_pct = 100.0 * head_tokens / n;
  r->mass_mean = mass_sum / ls.size();
  r->mass_min = mass_min;
  r->sel_mb = (double(subs) * C * a.d * 2 + double(B) * a.hq * plan.num_samples() * a.d * 2) / 1e6;
  return true;
}

}  // namespace

// With --capture: the shape, contexts and batches the capture serves (what the command
// line left to it), or an error naming what it cannot serve.
TacticBenchArgs resolve_capture(const TacticBenchArgs& given, const CaptureFile& cap) {
  TacticBenchArgs a = given;
  const ModelShape shape = cap.meta().captured_shape();
  const std::string what = "--capture " + cap.path() + ": ";
  if (a.shape_given &&
      (a.hq != shape.num_q_heads || a.hkv != shape.num_kv_heads || a.d != shape.head_dim))
    throw std::invalid_argument(
        what + "--hq " + std::to_string(a.hq) + " --hkv " + std::to_string(a.hkv) + " --head-dim " +
        std::to_string(a.d) + " disagree with the capture's " + std::to_string(shape.num_q_heads) +
        " / " + std::to_string(shape.num_kv_heads) + " / " + std::to_string(shape.head_dim));
  a.hq = shape.num_q_heads;
  a.hkv = shape.num_kv_heads;
  a.d = shape.head_dim;
  const auto& seqs = cap.sequences();
  if (!a.batches_given) {
    a.batches.erase(std::remove_if(a.batches.begin(), a.batches.end(),
                                   [&](int B) { return B > int(seqs.size()); }),
                    a.batches.end());
    if (a.batches.empty()) a.batches = {1};
  }
  int shortest = std::numeric_limits<int>::max();
  for (int B : a.batches) {
    if (B > int(seqs.size()))
      throw std::invalid_argument(what + "--batches " + std::to_string(B) + ", but it holds " +
                                  std::to_string(seqs.size()) + " sequence(s)");
    for (int b = 0; b < B; ++b) shortest = std::min(shortest, seqs[size_t(b)].num_tokens);
  }
  if (!a.contexts_given) a.contexts = {shortest};
  for (int n : a.contexts)
    for (int B : a.batches)
      for (int b = 0; b < B; ++b)
        if (n > seqs[size_t(b)].num_tokens)
          throw std::invalid_argument(what + "context " + std::to_string(n) + " at batch " +
                                      std::to_string(B) + ": " + seqs[size_t(b)].name +
                                      " has only " + std::to_string(seqs[size_t(b)].num_tokens) +
                                      " tokens");
  return a;
}

int run_tactic_bench(const TacticBenchArgs& given) {
  // The capture is read and checked first, so that what it cannot serve is named on any
  // machine.
  std::unique_ptr<CaptureFile> cap;
  if (!given.capture.empty()) cap = std::make_unique<CaptureFile>(CaptureFile::open(given.capture));
  const TacticBenchArgs a = cap ? resolve_capture(given, *cap) : given;
  if (!(a.p > 0.0 && a.p <= 1.0)) throw std::invalid_argument("--p must be in (0, 1]");
  if (a.hq / a.hkv > 8) throw std::invalid_argument("--method tactic supports GQA groups up to 8");
  if (a.layers < 1 || a.components < 1)
    throw std::invalid_argument("--layers and --components must be >= 1");
  if (a.cluster_size < 1 || kBlockTokens % a.cluster_size != 0)
    throw std::invalid_argument("--cluster-size must divide the re-clustered block of " +
                                std::to_string(kBlockTokens) + " tokens, got " +
                                std::to_string(a.cluster_size));
  if (!(a.exact_fraction > 0.0 && a.exact_fraction <= 1.0))
    throw std::invalid_argument("--exact-fraction must be in (0, 1]");
  if (!(a.window_fraction >= 0.0 && a.window_fraction < 0.5) || a.window_min < 1)
    throw std::invalid_argument("--window-fraction must be in [0, 0.5) and --window-min >= 1");
  if (!cuda_device_available()) throw std::runtime_error("kvs-bench needs a CUDA device");
  int dev = 0;
  KVS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  KVS_CUDA_CHECK(tk::prepare_cuda(a.d));
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::BenchReport report("kvs_tactic", a.command, a.json_path);
  report.meta().add({{"p", a.p},
                     {"hq", a.hq},
                     {"hkv", a.hkv},
                     {"head_dim", a.d},
                     {"page_size", a.page_size},
                     {"layers", a.layers},
                     {"components", a.components},
                     {"cluster_size", a.cluster_size},
                     {"exact_fraction", a.exact_fraction},
                     {"window_fraction", a.window_fraction},
                     {"window_min", a.window_min},
                     {"iters", a.iters},
                     {"prefill_tflops", a.prefill_tflops},
                     {"member_rows", a.member_rows},
                     {"scene", cap ? "capture " + cap->path() : std::string("synthetic")}});
  report.save();
  const std::string scene =
      cap ? "keys, values and queries of " + cap->path() + " (layers " +
                [&] {
                  std::string s;
                  const auto& layers = cap->meta().layers;
                  for (int li = 0; li < a.layers; ++li)
                    s += (li ? "," : "") + std::to_string(layers[size_t(li) % layers.size()]);
                  return s;
                }() +
                ")"
          : std::to_string(a.components) + " key components";
  std::printf(
      "kvs-bench tactic decode: %s, %d SMs; Hq %d Hkv %d d %d page %d; P %.2f; %d layers "
      "per replay; %s; clusters of %d tokens; exact %.4f, window %.4f (min %d); member rows %s\n",
      prop.name, prop.multiProcessorCount, a.hq, a.hkv, a.d, a.page_size, a.p, a.layers,
      scene.c_str(), a.cluster_size, a.exact_fraction, a.window_fraction, a.window_min,
      a.member_rows ? "kept with the clusters" : "through the page table");
  std::printf("%8s %5s | %9s %9s %7s %8s %9s | %9s %9s %9s %9s %7s | %7s %7s %6s %6s %7s\n",
              "context", "batch", "clust_ms", "pfill_ms", "ratio", "km_TFLOP", "reclu_ms",
              "dense_us", "tactic_us", "select_us", "attn_us", "speedup", "union%", "head%", "mass",
              "m_min", "sel_MB");
  for (int n : a.contexts)
    for (int B : a.batches) {
      Result r;
      std::string note;
      if (!bench_one(a, cap.get(), n, B, stream, &r, &note)) {
        std::printf("%s\n", note.c_str());
        report.add_skipped(note);
        continue;
      }
      std::printf(
          "%8d %5d | %9.2f %9.2f %7.3f %8.2f %9.3f | %9.1f %9.1f %9.1f %9.1f %7.2f | %7.2f "
          "%7.2f %6.3f %6.3f %7.1f\n",
          r.context, r.batch, r.cluster_ms, r.prefill_est_ms, r.cluster_ms / r.prefill_est_ms,
          r.kmeans_tflop, r.recluster_ms, r.dense_us, r.tactic_us, r.select_us, r.attn_us,
          r.dense_us / r.tactic_us, r.union_pct, r.head_pct, r.mass_mean, r.mass_min, r.sel_mb);
      std::fflush(stdout);
      report.add_row({{"context", r.context},
                      {"batch", r.batch},
                      {"cluster_ms", r.cluster_ms},
                      {"prefill_est_ms", r.prefill_est_ms},
                      {"cluster_ratio", r.cluster_ms / r.prefill_est_ms},
                      {"kmeans_tflop", r.kmeans_tflop},
                      {"recluster_ms", r.recluster_ms},
                      {"dense_us", r.dense_us},
                      {"tactic_us", r.tactic_us},
                      {"select_us", r.select_us},
                      {"attn_us", r.attn_us},
                      {"speedup", r.dense_us / r.tactic_us},
                      {"union_pct", r.union_pct},
                      {"head_pct", r.head_pct},
                      {"mass_mean", r.mass_mean},
                      {"mass_min", r.mass_min},
                      {"selection_mb", r.sel_mb}});
    }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace kvs
