// kvs-bench-attnpred: AttentionPredictor decode time per layer, GPU-resident and offloaded,
// against dense attention over the same cache (batch 1; Llama-3.1-8B attention by default).
//
// Columns (microseconds per layer and decode step, median over --reps repetitions of a
// --steps step loop over --layers layers; every loop covers whole calibration periods, so
// calibration rows are amortised as in a real decode):
//   dense        dense_decode_cuda over the device cache (CUDA graph replays)
//   ap_gpu       the attnpred engine, GPU-resident (attention + history row + prediction),
//                CUDA graph replays of the step loop, as a decode loop would run it
//   ap_eager     the same loop launched kernel by kernel (the host's launches may bound it)
//   sparse_attn  its sparse step alone: the attention over the selected blocks and the history
//                row (sparse_attend_cuda, two kernels)
//   predictor    its CNN + top-K alone, one prediction (the paper's "predict attention";
//                hideable, cross-token); with --predict-interval P it follows P appended
//                history rows, and 1/P of the steps pay it
//   full_row     one calibration row (scores over all keys); 1/M of the steps pay it
//   offl_copy    the paper's baseline: the whole layer's KV copied H2D (cudaMemcpyAsync from
//                pinned memory), then dense attention
//   offl_zc      dense attention reading the pinned host KV directly (zero-copy)
//   ap_offload   the attnpred engine in offload mode (cross-token prefetch on a side stream)
//   late         share of prefetches decode had to wait for; blk/step: blocks copied per
//                layer step (prefetched + on demand)
// Weights are random (selection quality does not change the cost); queries and keys are
// random bf16. Targets (issue): ap_offload 5.6x faster than offl_copy at 32K; ap_gpu 5x faster
// than dense at 128K with budget 2048. --predict-interval P (AttnPredConfig::predict_interval)
// makes the engines predict every P-th step; --group-history (AttnPredConfig::group_history)
// gives them one history, prediction and top-K per kv head; --calibration-keys e4m3 or int4
// (AttnPredConfig::calibration_keys) has the GPU-resident engine's calibration rows, and the
// full_row column, read an e4m3 or int4 copy of K (offload mode keeps bf16). --json writes every
// row (docs/formats.md).
#include <cuda_bf16.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/dense/dense_decode.h"
#include "runtime/attnpred_engine.h"
#include "tools/bench/bench_common.h"

namespace po = boost::program_options;
namespace ap = kvs::kernels::attnpred;

namespace {

__global__ void fill_random_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    x[i] = __float2bfloat16((float(h & 0xffff) / 65535.f - 0.5f) * 2.f);
  }
}

void fill_random(kvs::bf16* x, size_t n, uint32_t seed) {
  fill_random_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(x), n, seed);
  KVS_CUDA_CHECK(cudaGetLastError());
}

// Median microseconds per `per_rep` units over `reps` timed calls of f (one untimed first).
template <class F>
double median_us(int reps, int per_rep, cudaStream_t s, F&& f) {
  return kvs::bench::time_calls(f, 1, reps, s) * 1000.0 / per_rep;
}

// count[0] += rows: the next decode step's length, or `rows` more history rows (their content
// is not what is timed: each predictor call is then an incremental CNN update over that many
// appended rows, not a repeat of the last).
__global__ void advance_count(int32_t* count, int rows) { count[threadIdx.x] += rows; }

template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string contexts_s, json_path, keys_s;
  int hq, hkv, d, budget, layers, steps, reps, period, interval;
  bool grouped = false;
  po::options_description opts(
      "kvs-bench-attnpred: AttentionPredictor decode vs dense, GPU and offload");
  opts.add_options()("help,h", "show this help")(
      "contexts", po::value(&contexts_s)->default_value("32768,65536,131072"), "context lengths")(
      "hq", po::value(&hq)->default_value(32), "query heads")(
      "hkv", po::value(&hkv)->default_value(8), "kv heads")("d", po::value(&d)->default_value(128),
                                                            "head dim")(
      "budget", po::value(&budget)->default_value(2048),
      "tokens per head (sink + recent included)")("period", po::value(&period)->default_value(5),
                                                  "calibration period M")(
      "predict-interval", po::value(&interval)->default_value(1),
      "predict every P-th step (AttnPredConfig::predict_interval)")(
      "group-history", po::bool_switch(&grouped),
      "one history and top-K per kv head (AttnPredConfig::group_history)")(
      "calibration-keys", po::value(&keys_s)->default_value("bf16"),
      "the calibration rows' keys: bf16, e4m3 or int4 (AttnPredConfig::calibration_keys)")(
      "layers", po::value(&layers)->default_value(4), "layers per step (prefetch overlaps them)")(
      "steps", po::value(&steps)->default_value(10), "decode steps per repetition (whole periods)")(
      "reps", po::value(&reps)->default_value(5), "repetitions (median)")(
      "json", po::value(&json_path), "also write the table as JSON to this path");
  if (!kvs::cli::parse_options(argc, argv, opts)) return 0;
  if (!kvs::cuda_device_available()) {
    std::fprintf(stderr, "kvs-bench-attnpred: no CUDA device\n");
    return 1;
  }
  if (interval < 1) {
    std::fprintf(stderr, "kvs-bench-attnpred: --predict-interval %d is below 1\n", interval);
    return 1;
  }
  if (steps % period != 0 || steps % interval != 0) {
    std::fprintf(stderr,
                 "kvs-bench-attnpred: --steps %d is not a multiple of --period %d and "
                 "--predict-interval %d (a loop covers whole phases of both)\n",
                 steps, period, interval);
    return 1;
  }
  const kvs::CalibrationKeys keys = kvs::calibration_keys_from_string(keys_s);
  const std::vector<int> contexts = kvs::bench::parse_counts(contexts_s, "contexts");
  cudaDeviceProp prop{};
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  kvs::bench::BenchReport report("kvs_attnpred", kvs::cli::command_line(argc, argv), json_path);
  report.meta().add({{"batch", 1},
                     {"hq", hq},
                     {"hkv", hkv},
                     {"head_dim", d},
                     {"budget", budget},
                     {"period", period},
                     {"predict_interval", interval},
                     {"group_history", grouped ? 1 : 0},
                     {"calibration_keys", keys_s},
                     {"layers", layers},
                     {"steps", steps},
                     {"reps", reps}});
  report.save();
  std::printf(
      "# %s, Hq %d, Hkv %d, d %d, budget %d, M %d, predict every %d, %s, %d layers, batch 1\n",
      prop.name, hq, hkv, d, budget, period, interval,
      grouped ? "a history per kv head" : "a history per query head", layers);
  std::printf("%8s %9s %9s %9s %11s %9s %9s %10s %9s %11s %6s %9s %8s %8s\n", "context",
              "dense", "ap_gpu", "ap_eager", "sparse_attn", "predictor", "full_row", "offl_copy",
              "offl_zc", "ap_offload", "late", "blk/step", "x_gpu", "x_offl");

  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  kvs::AttnPredParams params;
  params.cnn.resize(ap::kParamCount);
  for (float& w : params.cnn) w = nd(rng);
  params.budget_tokens = budget;
  params.calibration_period = period;
  params.dense_layers = {};

  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int L : contexts) {
    // Every decode step grows the sequence by one: a warm-up loop, 1 + reps eager loops, and
    // 3 + reps replays of the captured loop (the step advances the length on the device, so
    // the replays go on growing it, as a decode loop does).
    const int total_steps = steps * (2 * reps + 5);
    const int cap = L + total_steps + 16;
    kvs::ModelShape shape;
    shape.name = "bench";
    shape.num_layers = layers;
    shape.num_q_heads = hq;
    shape.num_kv_heads = hkv;
    shape.head_dim = d;
    shape.max_position = cap;
    const float scale = float(shape.scale());
    const size_t layer_elems = size_t(cap) * hkv * d;

    // Device cache (one contiguous page per layer) and lengths.
    std::vector<kvs::bf16*> dk(static_cast<size_t>(layers)), dv(static_cast<size_t>(layers));
    for (int l = 0; l < layers; ++l) {
      dk[size_t(l)] = dalloc<kvs::bf16>(layer_elems);
      dv[size_t(l)] = dalloc<kvs::bf16>(layer_elems);
      fill_random(dk[size_t(l)], layer_elems, 11u + l);
      fill_random(dv[size_t(l)], layer_elems, 101u + l);
    }
    int32_t* table = dalloc<int32_t>(1);
    KVS_CUDA_CHECK(cudaMemset(table, 0, sizeof(int32_t)));
    int32_t* len = dalloc<int32_t>(1);
    kvs::bf16* q = dalloc<kvs::bf16>(size_t(hq) * d);
    kvs::bf16* out = dalloc<kvs::bf16>(size_t(hq) * d);
    fill_random(q, size_t(hq) * d, 5u);
    auto view = [&](const kvs::bf16* k, const kvs::bf16* v) {
      kvs::PagedKV kv;
      kv.k = k;
      kv.v = v;
      kv.page_table = table;
      kv.seq_lens = len;
      kv.batch = 1;
      kv.num_pages = 1;
      kv.page_size = cap;
      kv.num_kv_heads = hkv;
      kv.head_dim = d;
      kv.max_pages_per_seq = 1;
      return kv;
    };
    auto set_len = [&] {  // the prefill's length (decode steps advance it on the device)
      KVS_CUDA_CHECK(cudaMemcpyAsync(len, &L, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
      KVS_CUDA_CHECK(cudaStreamSynchronize(stream));  // L is a host variable
    };
    set_len();
    const size_t dws_bytes = kvs::kernels::dense_decode_workspace_bytes(1, hq, d);
    void* dws = dalloc<char>(dws_bytes);

    // Dense over the device cache.
    const double dense = kvs::bench::time_graph(stream, reps, [&] {
      for (int l = 0; l < layers; ++l)
        KVS_CUDA_CHECK(kvs::kernels::dense_decode_cuda(q, hq, view(dk[size_t(l)], dv[size_t(l)]),
                                                       scale, out, nullptr, dws, dws_bytes,
                                                       stream));
    }) * 1000.0 / layers;

    // GPU-resident engine.
    kvs::EngineConfig ec;
    ec.backend = kvs::Backend::Cuda;
    ec.attnpred.max_context = cap;
    ec.attnpred.predict_interval = interval;
    ec.attnpred.group_history = grouped ? 1 : 0;
    ec.attnpred.calibration_keys = keys;
    auto run_engine = [&](kvs::AttnPredEngine& e, const std::vector<kvs::bf16*>& K,
                          const std::vector<kvs::bf16*>& V, bool graph_too) {
      void* ws = dalloc<char>(e.workspace_bytes());
      e.bind_workspace({ws, e.workspace_bytes()});
      set_len();
      for (int l = 0; l < layers; ++l) e.prefill(l, view(K[size_t(l)], V[size_t(l)]), stream);
      // Past the warm-up, into a steady state, then timed loops of whole periods.
      auto loop = [&] {
        for (int i = 0; i < steps; ++i) {
          advance_count<<<1, 1, 0, stream>>>(len, 1);
          for (int l = 0; l < layers; ++l)
            e.decode(l, q, nullptr, view(K[size_t(l)], V[size_t(l)]), out, nullptr, stream);
        }
      };
      loop();
      e.reset_stats();
      const double eager = median_us(reps, layers * steps, stream, loop);
      // GPU-resident: the loop (whole phases of calibration and prediction) captured once and
      // replayed.
      const double graph =
          graph_too ? kvs::bench::time_graph(stream, reps, loop) * 1000.0 / (layers * steps) : 0.0;
      return std::make_tuple(eager, graph, ws);
    };
    kvs::AttnPredEngine gpu(shape, ec, params);
    auto [ap_eager, ap_gpu, ws_gpu] = run_engine(gpu, dk, dv, true);

    // Its parts: predictor, sparse attention, full row, on a history of random rows.
    const int mb = gpu.max_blocks();
    const ap::Geometry geo = gpu.geometry();
    ap::HistoryState hist;
    hist.max_batch = 1;
    hist.group = grouped ? hq / hkv : 1;
    hist.num_heads = hq / hist.group;
    hist.history = geo.history;
    hist.max_blocks = mb;
    hist.rows = dalloc<float>(size_t(hist.num_heads) * geo.history * mb);
    hist.count = dalloc<int32_t>(1);
    hist.tokens = dalloc<int32_t>(1);
    {
      std::vector<float> rows(size_t(hist.num_heads) * geo.history * mb);
      std::uniform_real_distribution<float> u(0.f, 0.01f);
      for (float& x : rows) x = u(rng);
      KVS_CUDA_CHECK(
          cudaMemcpy(hist.rows, rows.data(), rows.size() * sizeof(float), cudaMemcpyHostToDevice));
      const int c = 1000, t = L;
      KVS_CUDA_CHECK(cudaMemcpy(hist.count, &c, sizeof c, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(cudaMemcpy(hist.tokens, &t, sizeof t, cudaMemcpyHostToDevice));
    }
    float* dparams = dalloc<float>(ap::kParamCount);
    KVS_CUDA_CHECK(cudaMemcpy(dparams, params.cnn.data(), ap::kParamCount * sizeof(float),
                              cudaMemcpyHostToDevice));
    ap::CnnCache cnn;
    cnn.s = dalloc<float>(ap::CnnCache::s_floats(hist));
    cnn.edge = dalloc<float>(ap::CnnCache::edge_floats(hist));
    cnn.count = dalloc<int32_t>(1);
    cnn.end = dalloc<int32_t>(1);
    cnn.sum = dalloc<long long>(ap::CnnCache::sum_values(hist));
    cnn.frags = dalloc<uint32_t>(ap::kCnnFragWords);
    float* scores = dalloc<float>(size_t(hq) * mb);
    uint8_t* flags = dalloc<uint8_t>(size_t(hkv) * mb);
    KVS_CUDA_CHECK(ap::reset_cnn_cache_cuda(dparams, cnn, 1, stream));
    set_len();
    // One prediction: `interval` rows appended since the last, the slice end where it was
    // (the stored rows' end columns are recomputed one step in 16 as the context grows: not
    // in this figure; ap_gpu has them).
    const double predictor = median_us(reps, 1, stream, [&] {
      advance_count<<<1, 1, 0, stream>>>(hist.count, interval);
      KVS_CUDA_CHECK(ap::predict_cuda(dparams, hist, cnn, 1, geo, scores, interval, stream));
      KVS_CUDA_CHECK(
          ap::select_blocks_cuda(scores, hist, 1, hkv, geo, gpu.k_blocks(), flags, stream));
    });
    kvs::kernels::tactic::Selection sel;
    sel.max_tokens = gpu.max_selected_tokens();
    sel.rows = dalloc<int32_t>(size_t(hkv) * sel.max_tokens);
    sel.tokens = dalloc<int32_t>(size_t(hkv) * sel.max_tokens);
    sel.counts = dalloc<int32_t>(size_t(hkv));
    const size_t sws_bytes =
        ap::sparse_attend_workspace_bytes(1, hq, hkv, d, gpu.max_list_blocks());
    void* sws = dalloc<char>(sws_bytes);
    const kvs::PagedKV kv0 = view(dk[0], dv[0]);
    const double sparse_attn = median_us(reps, 1, stream, [&] {
      KVS_CUDA_CHECK(ap::sparse_attend_cuda(q, hq, kv0, scale, flags, mb, geo,
                                            gpu.max_list_blocks(), &hist, sel, nullptr, out,
                                            nullptr, sws, sws_bytes, stream));
    });
    const size_t rs_bytes = ap::row_scratch_bytes(1, hq, mb * geo.block);
    void* rs = dalloc<char>(rs_bytes);
    // e4m3, int4: the copy is filled as a prefill fills it, and the timed rows find it full (a
    // decode loop's rows quantize the M keys since the last one).
    const bool copied = keys != kvs::CalibrationKeys::Bf16;
    ap::KeyCopy copy;
    copy.max_batch = 1;
    copy.num_kv_heads = hkv;
    copy.head_dim = d;
    copy.max_tokens = mb * geo.block;
    copy.format = keys == kvs::CalibrationKeys::Int4 ? ap::KeyFormat::Int4 : ap::KeyFormat::E4m3;
    if (copied) {
      copy.k = dalloc<uint8_t>(size_t(hkv) * copy.max_tokens * copy.key_bytes());
      copy.scale = dalloc<float>(size_t(hkv) * copy.max_tokens);
      copy.len = dalloc<int32_t>(1);
      KVS_CUDA_CHECK(ap::fill_key_copy_cuda(kv0, copy, 1, stream));
    }
    const double full_row = median_us(reps, 1, stream, [&] {
      if (copied)
        KVS_CUDA_CHECK(ap::append_full_row_from_copy_cuda(q, hq, kv0, 1, scale, geo, hist, copy, rs,
                                                          rs_bytes, stream));
      else
        KVS_CUDA_CHECK(ap::append_row_cuda(q, hq, kv0, nullptr, 0, len, 1, hkv, scale, geo, hist,
                                           rs, rs_bytes, false, stream));
    });

    // Offload: pinned mapped host KV.
    std::vector<kvs::bf16*> hk(static_cast<size_t>(layers)), hv(static_cast<size_t>(layers));
    for (int l = 0; l < layers; ++l) {
      KVS_CUDA_CHECK(
          cudaHostAlloc(&hk[size_t(l)], layer_elems * sizeof(kvs::bf16), cudaHostAllocMapped));
      KVS_CUDA_CHECK(
          cudaHostAlloc(&hv[size_t(l)], layer_elems * sizeof(kvs::bf16), cudaHostAllocMapped));
      KVS_CUDA_CHECK(cudaMemcpy(hk[size_t(l)], dk[size_t(l)], layer_elems * sizeof(kvs::bf16),
                                cudaMemcpyDeviceToHost));
      KVS_CUDA_CHECK(cudaMemcpy(hv[size_t(l)], dv[size_t(l)], layer_elems * sizeof(kvs::bf16),
                                cudaMemcpyDeviceToHost));
    }
    set_len();
    const size_t layer_bytes = size_t(L) * hkv * d * sizeof(kvs::bf16);
    const double offl_copy = median_us(reps, layers, stream, [&] {
      for (int l = 0; l < layers; ++l) {
        KVS_CUDA_CHECK(
            cudaMemcpyAsync(dk[0], hk[size_t(l)], layer_bytes, cudaMemcpyHostToDevice, stream));
        KVS_CUDA_CHECK(
            cudaMemcpyAsync(dv[0], hv[size_t(l)], layer_bytes, cudaMemcpyHostToDevice, stream));
        KVS_CUDA_CHECK(kvs::kernels::dense_decode_cuda(q, hq, view(dk[0], dv[0]), scale, out,
                                                       nullptr, dws, dws_bytes, stream));
      }
    });
    const double offl_zc = median_us(reps, layers, stream, [&] {
      for (int l = 0; l < layers; ++l)
        KVS_CUDA_CHECK(kvs::kernels::dense_decode_cuda(q, hq, view(hk[size_t(l)], hv[size_t(l)]),
                                                       scale, out, nullptr, dws, dws_bytes,
                                                       stream));
    });
    kvs::EngineConfig eo = ec;
    eo.attnpred.offload = true;
    eo.attnpred.calibration_keys = kvs::CalibrationKeys::Bf16;
    double ap_off = 0, late = 0, blk = 0;
    void* ws_off = nullptr;
    {
      kvs::AttnPredEngine off(shape, eo, params);
      auto r = run_engine(off, hk, hv, false);  // offload decode is not for graph capture
      ap_off = std::get<0>(r);
      ws_off = std::get<2>(r);
      const auto os = off.offload_stats();
      late = os.prefetches ? double(os.late_prefetches) / double(os.prefetches) : 0.0;
      blk = os.prefetches
                ? double(os.blocks_prefetched + os.blocks_on_demand) / double(os.prefetches)
                : 0.0;
      if (os.selection_errors)
        std::fprintf(stderr, "kvs-bench-attnpred: %llu selection errors at context %d\n",
                     (unsigned long long)os.selection_errors, L);
      KVS_CUDA_CHECK(cudaDeviceSynchronize());
    }
    std::printf(
        "%8d %9.1f %9.1f %9.1f %11.1f %9.1f %9.1f %10.1f %9.1f %11.1f %6.3f %9.1f %8.2f %8.2f\n", L,
        dense, ap_gpu, ap_eager, sparse_attn, predictor, full_row, offl_copy, offl_zc, ap_off, late,
        blk, dense / ap_gpu, offl_copy / ap_off);
    std::fflush(stdout);
    report.add_row({{"context", L},
                    {"batch", 1},
                    {"dense_us", dense},
                    {"ap_gpu_us", ap_gpu},
                    {"ap_gpu_eager_us", ap_eager},
                    {"sparse_attn_us", sparse_attn},
                    {"predictor_us", predictor},
                    {"full_row_us", full_row},
                    {"offload_copy_us", offl_copy},
                    {"offload_zero_copy_us", offl_zc},
                    {"ap_offload_us", ap_off},
                    {"late_fraction", late},
                    {"blocks_per_step", blk},
                    {"speedup_gpu", dense / ap_gpu},
                    {"speedup_offload", offl_copy / ap_off}});

    for (int l = 0; l < layers; ++l) {
      cudaFree(dk[size_t(l)]);
      cudaFree(dv[size_t(l)]);
      cudaFreeHost(hk[size_t(l)]);
      cudaFreeHost(hv[size_t(l)]);
    }
    for (void* p : {(void*)table, (void*)len, (void*)q, (void*)out, dws, ws_gpu, ws_off})
      cudaFree(p);
    for (void* p : {(void*)hist.rows, (void*)hist.count, (void*)hist.tokens, (void*)cnn.s})
      cudaFree(p);
    for (void* p : {(void*)cnn.edge, (void*)cnn.count, (void*)cnn.end, (void*)dparams}) cudaFree(p);
    for (void* p : {(void*)scores, (void*)flags, (void*)sel.rows, (void*)sel.tokens}) cudaFree(p);
    for (void* p : {(void*)sel.counts, sws, rs, (void*)cnn.sum, (void*)cnn.frags}) cudaFree(p);
    for (void* p : {(void*)copy.k, (void*)copy.scale, (void*)copy.len}) cudaFree(p);
  }
  cudaStreamDestroy(stream);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-bench-attnpred: error: %s\n", e.what());
  return 1;
}
