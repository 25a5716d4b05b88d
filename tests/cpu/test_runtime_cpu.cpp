// KV cache bookkeeping, the dense engine on the CPU backend, and the engines' thread pool.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/common/thread_pool.h"
#include "kernels/dense/dense_decode.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "tests/common/test_util.h"

namespace kvs {
namespace {

using test::random_bf16;

ModelShape tiny_shape() {
  ModelShape s;
  s.num_layers = 2;
  s.num_q_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.max_position = 4096;
  return s;
}

KVCacheConfig cpu_cache(const ModelShape& s, int page_size, int max_batch, int max_len) {
  return test::cache_config(s, page_size, max_batch, max_len, Device::Cpu);
}

TEST(ThreadPool, RunsEveryIndexOnceAndForwardsErrors) {
  kernels::ThreadPool pool(4);
  std::vector<std::atomic<int>> seen(1000);
  for (int rep = 0; rep < 3; ++rep)
    pool.parallel_for(1000, [&](int64_t i, int w) {
      ASSERT_LT(w, pool.size());
      seen[size_t(i)]++;
    });
  for (auto& s : seen) EXPECT_EQ(s.load(), 3);
  EXPECT_THROW(pool.parallel_for(100,
                                 [](int64_t i, int) {
                                   if (i == 37) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
}

TEST(KVCache, WriteThenViewReadsBackThroughInterleavedPages) {
  const ModelShape s = tiny_shape();
  KVCache cache(cpu_cache(s, 16, 2, 100));
  // Interleaved reservations give sequence 0 non-contiguous pages.
  cache.reserve(0, 20);
  cache.reserve(1, 40);
  cache.reserve(0, 70);
  std::mt19937 gen(1);
  const int row = s.num_kv_heads * s.head_dim;
  const auto k = random_bf16(size_t(70) * row, gen), v = random_bf16(size_t(70) * row, gen);
  cache.write(1, 0, 0, 70, k.data(), v.data());
  cache.set_lengths({70, 0});
  const PagedKV kv = cache.view(1);
  EXPECT_NE(kv.page_table[2], kv.page_table[1] + 1);  // really non-contiguous
  for (int t = 0; t < 70; ++t)
    for (int h = 0; h < s.num_kv_heads; ++h)
      for (int i = 0; i < s.head_dim; ++i) {
        ASSERT_EQ(kv.k[kv.offset(0, t, h) + i].bits, k[size_t(t) * row + h * s.head_dim + i].bits);
        ASSERT_EQ(kv.v[kv.offset(0, t, h) + i].bits, v[size_t(t) * row + h * s.head_dim + i].bits);
      }
}

TEST(KVCache, StepAppendsAtTheEnd) {
  const ModelShape s = tiny_shape();
  KVCache cache(cpu_cache(s, 4, 3, 32));
  for (int b = 0; b < 3; ++b) cache.reserve(b, 12);  // three whole pages of 4
  cache.set_lengths({5, 0, 11});
  std::mt19937 gen(2);
  const int row = s.num_kv_heads * s.head_dim;
  const auto k = random_bf16(size_t(3) * row, gen), v = random_bf16(size_t(3) * row, gen);
  cache.begin_step(nullptr);
  cache.append(0, k.data(), v.data(), nullptr);
  EXPECT_EQ(cache.lengths(), (std::vector<int>{6, 1, 12}));
  const PagedKV kv = cache.view(0);
  EXPECT_EQ(kv.seq_lens[2], 12);
  for (int b = 0; b < 3; ++b)
    EXPECT_EQ(kv.k[kv.offset(b, kv.seq_lens[b] - 1, 1) + 3].bits, k[size_t(b) * row + s.head_dim + 3].bits);
  // Slot 2 is full: the next step must refuse rather than write past its pages.
  EXPECT_THROW(cache.begin_step(nullptr), std::out_of_range);
}

TEST(KVCache, ErrorsNameTheNumbers) {
  const ModelShape s = tiny_shape();
  KVCache cache(cpu_cache(s, 16, 2, 64));  // 4 pages per sequence, 8 in the pool
  cache.reserve(0, 64);
  cache.reserve(1, 64);
  cache.release(1);
  cache.reserve(1, 32);
  try {
    cache.reserve(0, 65);
    FAIL();
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("max_seq_len=64"), std::string::npos) << e.what();
  }
  try {
    cache.set_lengths({64, 33});
    FAIL();
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("reservation of 32"), std::string::npos) << e.what();
  }
  KVCacheConfig small = cpu_cache(s, 16, 2, 64);
  small.num_pages = 3;
  KVCache tight(small);
  try {
    tight.reserve(0, 64);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("only 3 of 3 are free"), std::string::npos) << e.what();
  }
  EXPECT_THROW(KVCache(cpu_cache(s, 0, 1, 8)), std::invalid_argument);
}

TEST(DenseEngineCpu, MatchesReferenceThroughTheCache) {
  const ModelShape s = tiny_shape();
  KVCache cache(cpu_cache(s, 16, 2, 200));
  const std::vector<int> lens{130, 7};
  std::mt19937 gen(3);
  const int row = s.num_kv_heads * s.head_dim;
  for (int b = 0; b < 2; ++b) {
    cache.reserve(b, lens[b]);
    const auto k = random_bf16(size_t(lens[b]) * row, gen), v = random_bf16(size_t(lens[b]) * row, gen);
    cache.write(1, b, 0, lens[b], k.data(), v.data());
  }
  cache.set_lengths(lens);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.max_batch = 2;
  auto engine = make_engine(Method::Dense, s, cfg);
  const auto q = random_bf16(size_t(2) * s.num_q_heads * s.head_dim, gen);
  std::vector<bf16> out(q.size());
  std::vector<float> lse(2 * s.num_q_heads), ref(q.size()), ref_lse(lse.size());
  engine->decode(1, q.data(), nullptr, cache.view(1), out.data(), lse.data(), nullptr);
  kernels::dense_decode_cpu(q.data(), s.num_q_heads, cache.view(1), float(s.scale()), ref.data(),
                            ref_lse.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i].bits, float_to_bf16(ref[i]).bits);
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_EQ(lse[i], ref_lse[i]);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.decode_calls, 1u);
  EXPECT_EQ(st.kv_rows_read, uint64_t(137 * 2));
  EXPECT_DOUBLE_EQ(st.kv_read_fraction(), 1.0);
}

TEST(DenseEngineCpu, RejectsMismatchedInputs) {
  const ModelShape s = tiny_shape();
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  auto engine = make_engine(Method::Dense, s, cfg);
  ModelShape other = s;
  other.num_kv_heads = 4;
  KVCache cache(cpu_cache(other, 16, 2, 32));
  cache.reserve(0, 8);
  cache.reserve(1, 8);
  cache.set_lengths({8});
  std::vector<bf16> q(size_t(s.num_q_heads) * s.head_dim), out(q.size());
  try {
    engine->decode(0, q.data(), nullptr, cache.view(0), out.data(), nullptr, nullptr);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4 kv heads"), std::string::npos) << e.what();
  }
  KVCache ok(cpu_cache(s, 16, 2, 32));
  ok.reserve(0, 8);
  ok.reserve(1, 8);
  ok.set_lengths({8, 8});
  EXPECT_THROW(engine->decode(0, q.data(), nullptr, ok.view(0), out.data(), nullptr, nullptr),
               std::invalid_argument);  // batch 2 > max_batch 1
  EXPECT_THROW(engine->decode(5, q.data(), nullptr, ok.view(0), out.data(), nullptr, nullptr),
               std::out_of_range);
  EXPECT_THROW(method_from_string("quest"), std::invalid_argument);
}

}  // namespace
}  // namespace kvs
