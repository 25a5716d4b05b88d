// kvs-bench-magicpig: per-layer MagicPIG decode time against our dense kernel, same run.
//
// For each (context, batch): one layer of a paged bf16 KV cache (page size 16) filled on the
// GPU with keys of realistic structure (spec 2.6: a common offset per kv head, a sink key
// opposite to it, runs of 64 tokens sharing one of --topics directions, noise) and random
// values; queries lean towards one topic each. The prompt is context - 1 tokens, the decode
// step sees one new token. Each mode builds its engine (prefill timed, wall clock), runs
// --warmup decodes, then --iters decodes timed one by one with CUDA events on the stream
// (cpu_offload: the stream waits for the CPU part, so the event pair spans both halves);
// medians are reported. Dense: kernels::dense_decode_cuda over the whole context, same
// events. Retrieval rate: candidates / hashed keys, per query head. Table memory: the layer's
// ids + offsets per token of context (all sequences, all kv heads).
// The CPU part uses --threads workers (0: hardware concurrency) and the widest vector unit.
// --json writes every row with the dense time of its (context, batch) (docs/formats.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/dense/dense_decode.h"
#include "runtime/magicpig_engine.h"
#include "tools/bench/bench_common.h"

namespace po = boost::program_options;

namespace kvs {
namespace {

using bench::hash_index;

// Approximately N(0, 1): Irwin-Hall of 4 uniforms, rescaled.
__device__ __forceinline__ float gauss(uint64_t i, uint32_t seed) {
  float s = 0.f;
  for (uint32_t r = 0; r < 4; ++r) s += float(hash_index(i * 4 + r, seed)) * (1.f / 4294967296.f);
  return (s - 2.f) * 1.7320508f;
}

__device__ __forceinline__ int topic_of(int b, int t, int topics) {
  return int((uint32_t(t / 64) * 2654435761u + uint32_t(b) * 97u) % uint32_t(topics));
}

// Token t of sequence b lives in page b * pages_per_seq + t / page (sequential pages).
__global__ void fill_kv(bf16* k, bf16* v, int batch, int context, int hkv, int d, int topics,
                        const float* mean, const float* topic_dirs) {
  const int64_t total = int64_t(batch) * context * hkv * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(e % d), h = int((e / d) % hkv);
    const int64_t bt = e / (int64_t(d) * hkv);
    const int t = int(bt % context), b = int(bt / context);
    const float m = mean[h * d + i];
    const float x = t == 0
                        ? -3.f * m
                        : m + topic_dirs[(int64_t(h) * topics + topic_of(b, t, topics)) * d + i] +
                              0.7f * gauss(uint64_t(e), 11u);
    reinterpret_cast<uint16_t*>(k)[e] = uint16_t(__float_as_uint(x) >> 16);
    reinterpret_cast<uint16_t*>(v)[e] = uint16_t(__float_as_uint(gauss(uint64_t(e), 23u)) >> 16);
  }
}

__global__ void fill_q(bf16* q, int batch, int hq, int hkv, int d, int topics, int context,
                       const float* topic_dirs) {
  const int64_t total = int64_t(batch) * hq * d;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(e % d), qh = int((e / d) % hq), b = int(e / (int64_t(d) * hq));
    const int h = qh / (hq / hkv);
    // Each head leans towards the topic of some token of its sequence.
    const int t = int(hash_index(uint64_t(b) * hq + qh, 5u) % uint32_t(context));
    const float x = 0.12f * topic_dirs[(int64_t(h) * topics + topic_of(b, t, topics)) * d + i] +
                    0.3f * gauss(uint64_t(e), 37u);
    reinterpret_cast<uint16_t*>(q)[e] = uint16_t(__float_as_uint(x) >> 16);
  }
}

template <typename T>
using DeviceArray = bench::DeviceBuffer<T>;
using bench::parse_counts;
using bench::time_calls;

std::vector<std::string> parse_modes(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) {
      magicpig_mode_from_string(item);  // validates
      out.push_back(item);
    }
  if (out.empty()) throw std::invalid_argument("--modes is empty");
  return out;
}

struct Options {
  int hq, hkv, d, bits, tables, page, iters, warmup, threads, topics;
  std::vector<std::string> modes;
};

void bench_one(const Options& o, int context, int batch, cudaStream_t stream,
               bench::BenchReport& report) {
  const int pages_per_seq = (context + o.page - 1) / o.page;
  const int num_pages = batch * pages_per_seq;
  const size_t elems = size_t(num_pages) * o.page * o.hkv * o.d;
  DeviceArray<bf16> k(elems), v(elems), q(size_t(batch) * o.hq * o.d),
      out(size_t(batch) * o.hq * o.d);
  DeviceArray<int32_t> table(static_cast<size_t>(num_pages)), lens(static_cast<size_t>(batch));
  {
    std::vector<int32_t> t(static_cast<size_t>(num_pages));
    for (int i = 0; i < num_pages; ++i) t[size_t(i)] = i;
    KVS_CUDA_CHECK(cudaMemcpy(table.p, t.data(), t.size() * 4, cudaMemcpyHostToDevice));
    std::mt19937_64 rng(uint64_t(context) * 31 + batch);
    std::normal_distribution<float> n01;
    std::vector<float> mean(size_t(o.hkv) * o.d), topics(size_t(o.hkv) * o.topics * o.d);
    for (float& x : mean) x = 2.f * n01(rng);
    for (float& x : topics) x = 1.5f * n01(rng);
    DeviceArray<float> mean_d(mean.size()), topics_d(topics.size());
    KVS_CUDA_CHECK(cudaMemcpy(mean_d.p, mean.data(), mean.size() * 4, cudaMemcpyHostToDevice));
    KVS_CUDA_CHECK(
        cudaMemcpy(topics_d.p, topics.data(), topics.size() * 4, cudaMemcpyHostToDevice));
    // Sequential pages: token t of b is element ((b * context + t) * hkv + h) * d + i when
    // context is a multiple of the page size; otherwise the fill leaves the tail padding.
    if (context % o.page != 0)
      throw std::invalid_argument("context " + std::to_string(context) +
                                  " must be a multiple of --page-size " + std::to_string(o.page));
    fill_kv<<<4096, 256, 0, stream>>>(k.p, v.p, batch, context, o.hkv, o.d, o.topics, mean_d.p,
                                      topics_d.p);
    fill_q<<<256, 256, 0, stream>>>(q.p, batch, o.hq, o.hkv, o.d, o.topics, context, topics_d.p);
    KVS_CUDA_CHECK(cudaGetLastError());
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  PagedKV kv;
  kv.k = k.p;
  kv.v = v.p;
  kv.page_table = table.p;
  kv.seq_lens = lens.p;
  kv.batch = batch;
  kv.num_pages = num_pages;
  kv.page_size = o.page;
  kv.num_kv_heads = o.hkv;
  kv.head_dim = o.d;
  kv.max_pages_per_seq = pages_per_seq;
  auto set_len = [&](int n) {
    const std::vector<int32_t> l(size_t(batch), n);
    KVS_CUDA_CHECK(cudaMemcpy(lens.p, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
  };

  set_len(context);
  const float scale = 1.f / std::sqrt(float(o.d));
  const size_t dws = kernels::dense_decode_workspace_bytes(batch, o.hq, o.d);
  float dense_ms = 0.f;
  {
    DeviceArray<char> ws(dws);
    dense_ms = time_calls(
        [&] {
          KVS_CUDA_CHECK(
              kernels::dense_decode_cuda(q.p, o.hq, kv, scale, out.p, nullptr, ws.p, dws, stream));
        },
        o.warmup, o.iters, stream);
  }

  ModelShape shape;
  shape.name = "bench";
  shape.num_layers = 1;
  shape.num_q_heads = o.hq;
  shape.num_kv_heads = o.hkv;
  shape.head_dim = o.d;
  shape.max_position = context;
  for (const std::string& mode : o.modes) {
    EngineConfig c;
    c.backend = Backend::Cuda;
    c.max_batch = batch;
    c.collect_stats = true;
    c.magicpig.bits = o.bits;
    c.magicpig.tables = o.tables;
    c.magicpig.dense_layers = std::vector<int>{};
    c.magicpig.mode = magicpig_mode_from_string(mode);
    c.magicpig.threads = o.threads;
    c.magicpig.max_context = context;
    std::unique_ptr<MagicPigEngine> e;
    try {
      e = std::make_unique<MagicPigEngine>(shape, c);
    } catch (const std::exception& ex) {
      std::printf("%8d %5d  %-11s  skipped: %s\n", context, batch, mode.c_str(), ex.what());
      report.add_skipped("skipped context " + std::to_string(context) + " batch " +
                         std::to_string(batch) + " mode " + mode + ": " + ex.what());
      continue;
    }
    DeviceArray<char> ws(e->workspace_bytes());
    e->bind_workspace({ws.p, e->workspace_bytes()});
    set_len(context - 1);
    const auto t0 = std::chrono::steady_clock::now();
    e->prefill(0, kv, stream);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double prefill_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    set_len(context);
    e->reset_stats();
    const float ms = time_calls([&] { e->decode(0, q.p, nullptr, kv, out.p, nullptr, stream); },
                                o.warmup, o.iters, stream);
    const MagicPigStats s = e->magicpig_stats();
    const EngineStats es = e->stats();
    const double per_token = double(e->table_bytes(0)) / (double(batch) * context);
    const double per_head =
        double(s.candidates) / std::max<uint64_t>(es.decode_calls, 1) / (batch * o.hq);
    const double tables_mib = double(e->table_bytes(0)) / (1 << 20);
    const char* isa = kernels::magicpig::to_string(e->cpu_isa());
    std::printf("%8d %5d  %-11s %9.1f %9.1f %7.2fx %8.4f %9.0f %10.1f %8.1f %7.1f %6s\n", context,
                batch, mode.c_str(), dense_ms * 1e3, ms * 1e3, dense_ms / ms, s.retrieval_rate(),
                per_head, tables_mib, per_token, prefill_s, isa);
    std::fflush(stdout);
    report.add_row({{"context", context},
                    {"batch", batch},
                    {"mode", mode},
                    {"dense_us", dense_ms * 1e3},
                    {"magicpig_us", ms * 1e3},
                    {"speedup", dense_ms / ms},
                    {"retrieval_rate", s.retrieval_rate()},
                    {"candidates_per_head", per_head},
                    {"tables_mib", tables_mib},
                    {"table_bytes_per_token", per_token},
                    {"prefill_s", prefill_s},
                    {"isa", isa}});
  }
}

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) {
  using namespace kvs;
  po::options_description desc("kvs-bench-magicpig options");
  std::string contexts, batches, modes, json_path;
  Options o{};
  desc.add_options()("help,h", "this help")(
      "contexts", po::value(&contexts)->default_value("96K,128K"), "context lengths (K = 1024)")(
      "batches", po::value(&batches)->default_value("1,8"), "batch sizes")(
      "hq", po::value(&o.hq)->default_value(32), "query heads")(
      "hkv", po::value(&o.hkv)->default_value(8), "kv heads")(
      "head-dim", po::value(&o.d)->default_value(128), "head dim (64 or 128)")(
      "bits", po::value(&o.bits)->default_value(10), "K, bits per table")(
      "tables", po::value(&o.tables)->default_value(150), "L, tables")(
      "modes", po::value(&modes)->default_value("cpu_offload,gpu"), "cpu_offload and/or gpu")(
      "threads", po::value(&o.threads)->default_value(0), "CPU workers (0: hardware concurrency)")(
      "topics", po::value(&o.topics)->default_value(64), "key topic directions per kv head")(
      "page-size", po::value(&o.page)->default_value(16), "KV page size")(
      "iters", po::value(&o.iters)->default_value(20), "timed decode calls (median)")(
      "warmup", po::value(&o.warmup)->default_value(3), "untimed decode calls first")(
      "json", po::value(&json_path), "also write the table as JSON to this path");
  try {
    if (!cli::parse_options(argc, argv, desc)) return 0;
    if (o.hq <= 0 || o.hkv <= 0 || o.hq % o.hkv != 0 || o.iters <= 0 || o.warmup < 0 ||
        o.topics <= 0 || o.page <= 0)
      throw std::invalid_argument(
          "--hq must be a positive multiple of --hkv; --iters, --topics, "
          "--page-size > 0; --warmup >= 0");
    o.modes = parse_modes(modes);
    const std::vector<int> ctx = parse_counts(contexts, "contexts");
    const std::vector<int> bs = parse_counts(batches, "batches");
    if (!cuda_device_available()) throw std::runtime_error("no CUDA device");
    cudaDeviceProp prop{};
    KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int threads = o.threads > 0 ? o.threads : int(std::thread::hardware_concurrency());
    bench::BenchReport report("kvs_magicpig", cli::command_line(argc, argv), json_path);
    report.meta().add({{"hq", o.hq},
                       {"hkv", o.hkv},
                       {"head_dim", o.d},
                       {"bits", o.bits},
                       {"tables", o.tables},
                       {"threads", threads},
                       {"topics", o.topics},
                       {"page_size", o.page},
                       {"iters", o.iters},
                       {"warmup", o.warmup}});
    report.save();
    std::printf("# %s; Hq %d Hkv %d d %d; (K, L) = (%d, %d); sink 4, local 64; %d CPU threads\n",
                prop.name, o.hq, o.hkv, o.d, o.bits, o.tables, threads);
    std::printf("# times are per layer (one decode of every sequence of the batch), median of %d\n",
                o.iters);
    std::printf("%8s %5s  %-11s %9s %9s %8s %8s %9s %10s %8s %7s %6s\n", "context", "batch", "mode",
                "dense_us", "mpig_us", "speedup", "retr", "cand/head", "tables_MiB", "B/token",
                "prefill_s", "isa");
    cudaStream_t stream;
    KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int c : ctx)
      for (int b : bs) bench_one(o, c, b, stream, report);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::cerr << "kvs-bench-magicpig: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
