// The fidelity metrics library (kvs-eval's core): metrics on hand-made cases with known
// answers, the baseline selectors' defining properties, aggregation and the writers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "runtime/eval/baselines.h"
#include "runtime/eval/metrics.h"
#include "runtime/eval/plot.h"
#include "runtime/eval/replay.h"
#include "runtime/eval/report.h"
#include "tests/common/test_util.h"
#include "tests/cpu/h5_test_support.h"

namespace kvs::eval {
namespace {

// One sequence in a paged cache whose pages are stored in reverse order, so every test also
// goes through the page table. Keys and values are given as floats [T, Hkv, d].
struct TestCache {
  int T = 0, Hkv = 0, d = 0, page_size = 0;
  std::vector<bf16> k, v;
  std::vector<int32_t> table, lens;

  TestCache(int T_, int Hkv_, int d_, const std::vector<float>& kf, const std::vector<float>& vf,
            int page_size_ = 4)
      : T(T_), Hkv(Hkv_), d(d_), page_size(page_size_) {
    const int pages = (T + page_size - 1) / page_size;
    k.assign(size_t(pages) * page_size * Hkv * d, float_to_bf16(0.f));
    v = k;
    for (int p = 0; p < pages; ++p) table.push_back(pages - 1 - p);
    lens = {T};
    const PagedKV kv = view();
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < Hkv; ++h)
        for (int i = 0; i < d; ++i) {
          const size_t src = (size_t(t) * Hkv + h) * d + i;
          k[kv.offset(0, t, h) + i] = float_to_bf16(kf[src]);
          v[kv.offset(0, t, h) + i] = float_to_bf16(vf[src]);
        }
  }

  PagedKV view() const {
    PagedKV kv;
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.seq_lens = lens.data();
    kv.batch = 1;
    kv.num_pages = int(table.size());
    kv.page_size = page_size;
    kv.num_kv_heads = Hkv;
    kv.head_dim = d;
    kv.max_pages_per_seq = int(table.size());
    return kv;
  }
};

std::vector<float> normal(size_t n, std::mt19937& gen, float sigma = 1.f) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> x(n);
  for (auto& e : x) e = dist(gen);
  return x;
}

// A random step: cache, queries and the StepInput over them (kept together for lifetime).
struct RandomStep {
  TestCache cache;
  std::vector<float> q;
  StepInput step;
  RandomStep(int T, int Hq, int Hkv, int d, unsigned seed, float key_sigma = 1.f)
      : RandomStep(T, Hq, Hkv, d, std::mt19937(seed), key_sigma) {}

 private:
  RandomStep(int T, int Hq, int Hkv, int d, std::mt19937 gen, float key_sigma)
      : cache(T, Hkv, d, normal(size_t(T) * Hkv * d, gen, key_sigma),
              normal(size_t(T) * Hkv * d, gen), 8),
        q(normal(size_t(Hq) * d, gen)) {
    step.q = q.data();
    step.num_q_heads = Hq;
    step.kv = cache.view();
    step.scale = 1.0 / std::sqrt(double(d));
  }
};

std::vector<int32_t> range(int a, int b) {
  std::vector<int32_t> r(b - a);
  std::iota(r.begin(), r.end(), a);
  return r;
}

// ---------------------------------------------------------------------------------------
// Metrics

TEST(EvalMetrics, AllTokensGiveZeroErrorAndFullRecall) {
  RandomStep r(37, 4, 2, 8, 1);
  const DenseReference dense = dense_reference(r.step);
  Selection all;
  all.tokens.assign(4, range(0, 37));
  const StepMetrics m = evaluate_selection(r.step, dense, all);
  for (int h = 0; h < 4; ++h) {
    EXPECT_EQ(m.rel_l2[h], 0.0) << "head " << h;
    EXPECT_NEAR(m.mass_recall[h], 1.0, 1e-12) << "head " << h;
    EXPECT_EQ(m.tokens_selected[h], 37);
  }
  EXPECT_EQ(m.rows_read, 74);
  EXPECT_EQ(m.rows_total, 74);
  EXPECT_EQ(m.kv_read_fraction, 1.0);
  EXPECT_EQ(m.budget_tokens, -1);
}

TEST(EvalMetrics, OneOfTwoTokensHasClosedFormProbabilityAndError) {
  // Keys 0 and 1 with q = 1 and scale log(3): scores 0 and log(3), probabilities 1/4, 3/4.
  TestCache c(2, 1, 2, {0.f, 0.f, 1.f, 0.f}, {1.f, 0.f, 0.f, 1.f});
  const float q[2] = {1.f, 0.f};
  StepInput step;
  step.q = q;
  step.num_q_heads = 1;
  step.kv = c.view();
  step.scale = std::log(3.0);
  const DenseReference dense = dense_reference(step);
  EXPECT_NEAR(dense.probs[0], 0.25, 1e-14);
  EXPECT_NEAR(dense.probs[1], 0.75, 1e-14);
  EXPECT_NEAR(dense.scores[1], std::log(3.0), 1e-14);
  EXPECT_NEAR(dense.lse[0], std::log(4.0), 1e-14);

  Selection one;
  one.tokens = {{1}};
  const StepMetrics m = evaluate_selection(step, dense, one);
  EXPECT_NEAR(m.mass_recall[0], 0.75, 1e-14);
  // o_sel = v1 = (0, 1); o_dense = (1/4, 3/4): error sqrt(2)/4 over sqrt(10)/4.
  EXPECT_DOUBLE_EQ(m.o[0], 0.0);
  EXPECT_DOUBLE_EQ(m.o[1], 1.0);
  EXPECT_NEAR(m.rel_l2[0], std::sqrt(0.2), 1e-14);
  EXPECT_EQ(m.kv_read_fraction, 0.5);
}

TEST(EvalMetrics, ReadFractionCountsAGroupsUnionOnce) {
  RandomStep r(10, 4, 2, 4, 2);
  const DenseReference dense = dense_reference(r.step);
  Selection s;
  s.tokens = {{0, 1, 2}, {2, 3}, {5}, {}};  // group 0 reads {0,1,2,3}; group 1 reads {5}
  const StepMetrics m = evaluate_selection(r.step, dense, s);
  EXPECT_EQ(m.rows_read, 5);
  EXPECT_EQ(m.rows_total, 20);
  EXPECT_DOUBLE_EQ(m.kv_read_fraction, 0.25);
  EXPECT_EQ(m.tokens_selected, (std::vector<int>{3, 2, 1, 0}));
  // A head that reads nothing outputs zero: all of the output is error, none of the mass.
  EXPECT_DOUBLE_EQ(m.rel_l2[3], 1.0);
  EXPECT_EQ(m.mass_recall[3], 0.0);
  // Recall is the dense probability mass of exactly the tokens read.
  const double* p = dense.head_probs(1);
  EXPECT_NEAR(m.mass_recall[1], p[2] + p[3], 1e-15);
}

TEST(EvalMetrics, ReadReuseCountsRowsTheLastStepCouldHaveRead) {
  // Two kv heads of two query heads each; the last step had 6 tokens.
  Selection prev, now;
  prev.tokens = {{0, 1}, {2}, {4}, {}};  // group 0 read {0, 1, 2}; group 1 read {4}
  // Group 0 reads {1, 2, 3} and the new token 6 (not counted), its union once; group 1 reads
  // {4, 5}: rows 1, 2 and 4 of the 5 older ones were read before.
  now.tokens = {{1, 2, 6}, {2, 3}, {4, 5, 6}, {4}};
  EXPECT_DOUBLE_EQ(read_reuse(now, prev, 6, 2), 3.0 / 5.0);
  // The same rows twice: all reused; only the new token: not measured.
  EXPECT_DOUBLE_EQ(read_reuse(prev, prev, 6, 2), 1.0);
  Selection fresh;
  fresh.tokens = {{6}, {6}, {6}, {}};
  EXPECT_TRUE(std::isnan(read_reuse(fresh, prev, 6, 2)));
  // One kv head for all four: the groups' rows pool ({0, 1, 2, 4} before).
  EXPECT_DOUBLE_EQ(read_reuse(now, prev, 6, 1), 3.0 / 5.0);
  // A previous token past its length, or list counts that do not match, are named.
  Selection late = prev;
  late.tokens[1] = {6};
  try {
    read_reuse(now, late, 6, 2);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("query head 1 has token 6"), std::string::npos)
        << e.what();
  }
  Selection three;
  three.tokens = {{0}, {1}, {2}};
  EXPECT_THROW(read_reuse(three, prev, 6, 2), std::invalid_argument);
  EXPECT_THROW(read_reuse(now, prev, 6, 3), std::invalid_argument);
}

TEST(EvalMetrics, RejectsBadSelectionsNamingTheProblem) {
  RandomStep r(10, 2, 1, 4, 3);
  const DenseReference dense = dense_reference(r.step);
  const auto message = [&](const Selection& s) {
    try {
      evaluate_selection(r.step, dense, s);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  Selection dup;
  dup.tokens = {{1, 1}, {}};
  EXPECT_NE(message(dup).find("twice"), std::string::npos) << message(dup);
  Selection out;
  out.tokens = {{10}, {}};
  EXPECT_NE(message(out).find("outside the context [0, 10)"), std::string::npos) << message(out);
  Selection heads;
  heads.tokens = {{1}};
  EXPECT_NE(message(heads).find("one per query head (2)"), std::string::npos) << message(heads);

  StepInput bad = r.step;
  bad.scale = 0.0;
  EXPECT_THROW(dense_reference(bad), std::invalid_argument);
  RandomStep gqa(10, 4, 2, 4, 3);
  bad = gqa.step;
  bad.num_q_heads = 3;  // not a multiple of the 2 kv heads
  EXPECT_THROW(dense_reference(bad), std::invalid_argument);
  bad = gqa.step;
  bad.seq = 1;  // a batch of one
  EXPECT_THROW(dense_reference(bad), std::invalid_argument);
  RandomStep other(11, 2, 1, 4, 3);
  EXPECT_THROW(evaluate_selection(other.step, dense, dup), std::invalid_argument);
}

TEST(EvalMetrics, EngineOutputIsMeasuredAsGiven) {
  RandomStep r(40, 4, 2, 16, 4);
  const DenseReference dense = dense_reference(r.step);
  Selection s;
  s.tokens = {range(0, 10), range(5, 20), range(30, 40), {0, 39}};
  const StepMetrics ms = evaluate_selection(r.step, dense, s);
  // The same output, rounded to fp32 as an engine would hand it over.
  std::vector<float> o(ms.o.begin(), ms.o.end());
  const StepMetrics mo = evaluate_output(r.step, dense, o.data(), s);
  for (int h = 0; h < 4; ++h) {
    EXPECT_NEAR(mo.rel_l2[h], ms.rel_l2[h], 1e-6) << "head " << h;
    EXPECT_EQ(mo.mass_recall[h], ms.mass_recall[h]);
  }
  EXPECT_EQ(mo.rows_read, ms.rows_read);
  // A reweighting estimator's output is not the selection's attention: measured as is.
  for (auto& x : o) x *= 2.f;
  const StepMetrics scaled = evaluate_output(r.step, dense, o.data(), s);
  EXPECT_GT(scaled.rel_l2[0], 0.5);
  o[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(evaluate_output(r.step, dense, o.data(), s), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Baselines

TEST(EvalBudget, ResolvesTokensAndFractions) {
  EXPECT_EQ(Budget::of_tokens(64).resolve(1000), 64);
  EXPECT_EQ(Budget::of_tokens(64).resolve(10), 64);  // selectors report the shortfall
  EXPECT_EQ(Budget::of_fraction(0.07).resolve(100), 7);
  EXPECT_EQ(Budget::of_fraction(0.001).resolve(100), 1);
  EXPECT_EQ(Budget::of_fraction(0.25).describe(), "fraction=0.25");
  EXPECT_EQ(Budget::of_tokens(256).describe(), "tokens=256");
  EXPECT_THROW(Budget().resolve(10), std::invalid_argument);
  EXPECT_THROW(Budget::of_fraction(1.5).resolve(10), std::invalid_argument);
  Budget both = Budget::of_tokens(3);
  both.fraction = 0.5;
  EXPECT_THROW(both.resolve(10), std::invalid_argument);
}

TEST(EvalBaselines, TopKIndicesBreaksTiesTowardsEarlierTokens) {
  const double v[6] = {1, 5, 3, 5, 0, 3};
  EXPECT_EQ(top_k_indices(v, 6, 3), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(top_k_indices(v, 6, 0), (std::vector<int32_t>{}));
  EXPECT_EQ(top_k_indices(v, 6, 9), range(0, 6));
}

TEST(EvalBaselines, StreamingKeepsSinksAndRecentWindow) {
  RandomStep r(20, 4, 2, 4, 5);
  const Selection s = select_streaming(r.step, Budget::of_tokens(8));
  for (const auto& t : s.tokens) EXPECT_EQ(t, (std::vector<int32_t>{0, 1, 2, 3, 16, 17, 18, 19}));
  EXPECT_EQ(s.budget_tokens, 8);
  StreamingConfig one_sink;
  one_sink.sink_tokens = 1;
  EXPECT_EQ(select_streaming(r.step, Budget::of_tokens(3), one_sink).tokens[0],
            (std::vector<int32_t>{0, 18, 19}));
  EXPECT_THROW(select_streaming(r.step, Budget::of_tokens(3)), std::invalid_argument);
}

TEST(EvalBaselines, StreamingBudgetBeyondContextReadsAllAndSaysSo) {
  // Context of 6 tokens, shorter than 4 sinks + a window: everything is read, and the
  // metrics show 6 tokens read against a budget of 64.
  RandomStep r(6, 2, 1, 4, 6);
  const Selection s = select_streaming(r.step, Budget::of_tokens(64));
  EXPECT_EQ(s.tokens[0], range(0, 6));
  const StepMetrics m = evaluate_selection(r.step, dense_reference(r.step), s);
  EXPECT_EQ(m.budget_tokens, 64);
  EXPECT_EQ(m.tokens_selected[0], 6);
  EXPECT_EQ(m.kv_read_fraction, 1.0);
  EXPECT_EQ(m.rel_l2[0], 0.0);

  Aggregator agg;
  agg.add("streaming", "tokens=64", 0, m);
  const ResultRow row = agg.rows().at(0);
  EXPECT_EQ(row.budget_tokens_mean, 64.0);
  EXPECT_EQ(row.tokens_selected_mean, 6.0);
}

TEST(EvalBaselines, QuestBoundIsAboveEveryScoreInItsPage) {
  for (unsigned seed = 10; seed < 16; ++seed) {
    RandomStep r(101, 4, 2, 16, seed);
    const DenseReference dense = dense_reference(r.step);
    for (int page : {16, 7}) {
      QuestConfig cfg;
      cfg.page_tokens = page;
      for (int h = 0; h < 4; ++h) {
        const std::vector<double> b = quest_page_bounds(r.step, h, cfg);
        ASSERT_EQ(int(b.size()), (101 + page - 1) / page);
        for (int t = 0; t < 101; ++t) {
          const double s = dense.head_scores(h)[t];
          EXPECT_GE(b[t / page], s - 1e-12 * (1 + std::abs(s)))
              << "seed " << seed << " head " << h << " token " << t;
        }
      }
    }
  }
}

TEST(EvalBaselines, QuestFindsThePageOfAPlantedKey) {
  const int T = 100, d = 32, Hkv = 2, Hq = 4;
  std::mt19937 gen(7);
  std::vector<float> kf = normal(size_t(T) * Hkv * d, gen, 0.1f);
  const std::vector<float> vf = normal(size_t(T) * Hkv * d, gen);
  std::vector<float> q = normal(size_t(Hq) * d, gen);
  // Token 37 of kv head 1 points along query head 3's query: its page (32..47) must win.
  for (int i = 0; i < d; ++i) kf[(size_t(37) * Hkv + 1) * d + i] = 2.f * q[3 * d + i];
  TestCache c(T, Hkv, d, kf, vf, 16);
  StepInput step;
  step.q = q.data();
  step.num_q_heads = Hq;
  step.kv = c.view();
  step.scale = 1.0 / std::sqrt(double(d));
  const Selection s = select_quest(step, Budget::of_tokens(32));
  std::vector<int32_t> want = range(32, 48);
  const std::vector<int32_t> last = range(96, 100);
  want.insert(want.end(), last.begin(), last.end());
  EXPECT_EQ(s.tokens[3], want);
  EXPECT_EQ(s.budget_tokens, 32);
  for (const auto& t : s.tokens) EXPECT_LE(int(t.size()), 32);
  EXPECT_THROW(select_quest(step, Budget::of_tokens(15)), std::invalid_argument);
}

TEST(EvalBaselines, OracleRecallBoundsQuestRecallAtEqualBudget) {
  int unions_larger_than_a_head = 0;
  for (unsigned seed = 20; seed < 26; ++seed) {
    // Keys with spread so that attention is peaked and the ranking matters.
    RandomStep r(203, 8, 2, 16, seed, 2.f);
    const DenseReference dense = dense_reference(r.step);
    for (int budget : {16, 32, 64, 128}) {
      const Budget b = Budget::of_tokens(budget);
      const StepMetrics quest = evaluate_selection(r.step, dense, select_quest(r.step, b));
      const StepMetrics topk = evaluate_selection(r.step, dense, select_topk(dense, b));
      for (int h = 0; h < 8; ++h) {
        EXPECT_EQ(topk.tokens_selected[h], budget);
        EXPECT_LE(quest.tokens_selected[h], budget);
        EXPECT_GE(quest.mass_recall[h], 0.0);
        EXPECT_GE(topk.mass_recall[h], quest.mass_recall[h] - 1e-12)
            << "seed " << seed << " budget " << budget << " head " << h;
      }
      // Heads of a group pick pages on their own: the group loads the union, at least the
      // largest head's pages and at most all heads' pages.
      const auto& n = quest.tokens_selected;
      const int64_t lower =
          *std::max_element(n.begin(), n.begin() + 4) + *std::max_element(n.begin() + 4, n.end());
      const int64_t upper = std::accumulate(n.begin(), n.end(), int64_t(0));
      EXPECT_GE(quest.rows_read, lower);
      EXPECT_LE(quest.rows_read, upper);
      unions_larger_than_a_head += quest.rows_read > lower;
    }
  }
  EXPECT_GT(unions_larger_than_a_head, 0);
}

// H2O is driven with hand-made dense references: only the probabilities matter to it.
DenseReference fake_dense(int Hq, int Hkv, const std::vector<double>& probs_per_head) {
  DenseReference d;
  d.num_q_heads = Hq;
  d.num_kv_heads = Hkv;
  d.seq_len = int(probs_per_head.size());
  d.probs.resize(size_t(Hq) * d.seq_len);
  for (size_t i = 0; i < d.probs.size(); ++i) d.probs[i] = probs_per_head[i % d.seq_len];
  return d;
}

TEST(EvalBaselines, H2OKeepsHeavyHittersAndEvictsForGood) {
  H2OSelector h2o(2, 1);  // budget 4 -> 2 recent + 2 heavy
  h2o.observe(fake_dense(2, 1, {0.05, 0.5, 0.05, 0.3, 0.1}));
  Selection s = h2o.select(6, Budget::of_tokens(4));
  EXPECT_EQ(s.tokens[0], (std::vector<int32_t>{1, 3, 4, 5}));
  EXPECT_EQ(s.tokens[1], s.tokens[0]);
  // Token 0 becomes the heaviest, but it was evicted at the previous step.
  h2o.observe(fake_dense(2, 1, {2.0, 0.0, 0.0, 0.0, 0.0, 0.0}));
  s = h2o.select(7, Budget::of_tokens(4));
  EXPECT_EQ(s.tokens[0], (std::vector<int32_t>{1, 3, 5, 6}));

  H2OConfig fresh;
  fresh.permanent_eviction = false;
  H2OSelector again(2, 1, fresh);
  again.observe(fake_dense(2, 1, {0.05, 0.5, 0.05, 0.3, 0.1}));
  again.select(6, Budget::of_tokens(4));
  again.observe(fake_dense(2, 1, {2.0, 0.0, 0.0, 0.0, 0.0, 0.0}));
  EXPECT_EQ(again.select(7, Budget::of_tokens(4)).tokens[0], (std::vector<int32_t>{0, 1, 5, 6}));

  // A larger budget does not bring back 0, 2 and 4.
  EXPECT_EQ(h2o.select(7, Budget::of_tokens(100)).tokens[0], (std::vector<int32_t>{1, 3, 5, 6}));
  EXPECT_THROW(h2o.select(5, Budget::of_tokens(4)), std::invalid_argument);
  h2o.reset();
  EXPECT_EQ(h2o.select(5, Budget::of_tokens(8)).tokens[0], range(0, 5));
  EXPECT_THROW(h2o.observe(fake_dense(4, 1, {1.0})), std::invalid_argument);
}

TEST(EvalBaselines, H2OOnRealStepsSumsTheGroupsMass) {
  // Growing contexts of one random sequence: select, measure, then observe the step.
  const int Tmax = 64;
  RandomStep r(Tmax, 4, 2, 8, 30, 2.f);
  H2OSelector h2o(4, 2);
  std::vector<int32_t> lens = {0};
  for (int T = 40; T <= Tmax; ++T) {
    lens[0] = T;
    StepInput step = r.step;
    step.kv.seq_lens = lens.data();
    const DenseReference dense = dense_reference(step);
    const StepMetrics m = evaluate_selection(step, dense, h2o.select(T, Budget::of_tokens(16)));
    for (int h = 0; h < 4; ++h) {
      EXPECT_EQ(m.tokens_selected[h], 16);
      EXPECT_GT(m.mass_recall[h], 0.0);
    }
    // One set per kv head: the group's union is no bigger than a head's set.
    EXPECT_EQ(m.rows_read, 32);
    h2o.observe(dense);
  }
}

// kvs-eval's replay runs H2O beside the other baselines: a row per fixed budget and per
// method's read, every step, reading its budget, within the TopK oracle's recall at the same
// budget; its selectors follow the sequence, seeded by the prompt's last queries.
TEST(EvalReplay, H2ORowsFollowTheSequenceWithinTheOracle) {
  testing_h5::TempDir tmp;
  ModelShape shape;
  shape.name = "h2o-replay";
  shape.num_layers = 1;
  shape.num_q_heads = 4;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  shape.max_position = 1024;
  const int T = 260, decode_start = 240, hq = 4, hkv = 2, d = 64;
  {
    CaptureMeta meta;
    meta.shape = shape;
    meta.layers = {0};
    meta.vocab_size = 256;
    CaptureWriter w(tmp.path("c.h5"), meta);
    w.begin_sequence(std::vector<int32_t>(size_t(T), 65), decode_start, "synthetic");
    std::mt19937 rng(17);
    const std::vector<bf16> q = test::random_bf16(size_t(T) * hq * d, rng);
    const std::vector<bf16> k = test::random_bf16(size_t(T) * hkv * d, rng);
    const std::vector<bf16> v = test::random_bf16(size_t(T) * hkv * d, rng);
    w.append_qkv(0, T, q.data(), k.data(), v.data());
    const std::vector<float> pooled(size_t(hq) * ((T + 15) / 16), 0.f);
    for (int st = 0; st < T - decode_start; ++st) w.append_attn_row(0, pooled.data());
    w.commit();
  }
  const CaptureFile cap = CaptureFile::open(tmp.path("c.h5"));
  ReplayConfig rc;
  rc.methods = {"dense", "mac"};
  rc.engine.backend = Backend::Cpu;
  rc.budget_fractions = {0.1};
  auto find = [](const std::vector<ResultRow>& rows, const std::string& method) {
    for (const ResultRow& r : rows)
      if (r.method == method) return r;
    ADD_FAILURE() << "no row " << method;
    return ResultRow{};
  };
  const std::vector<ResultRow> rows = replay_capture(cap, rc).rows();
  const ResultRow h2o = find(rows, "h2o"), topk = find(rows, "topk");
  const ResultRow h2o_mac = find(rows, "h2o@mac"), topk_mac = find(rows, "topk@mac");
  EXPECT_TRUE(std::none_of(rows.begin(), rows.end(), [](const ResultRow& r) {
    return r.method == "h2o@dense";
  })) << "dense reads everything: no baselines at its read";
  for (const ResultRow* r : {&h2o, &h2o_mac}) {
    EXPECT_EQ(r->steps, T - decode_start);
    EXPECT_DOUBLE_EQ(r->tokens_selected_mean, r->budget_tokens_mean);
    EXPECT_GT(r->mass_recall_mean, 0.0);
  }
  EXPECT_EQ(h2o.knob, "fraction=0.1");
  EXPECT_LE(h2o.mass_recall_mean, topk.mass_recall_mean);
  EXPECT_LE(h2o_mac.mass_recall_mean, topk_mac.mass_recall_mean);
  // The warm-up is what H2O starts from: without it the same steps select differently.
  rc.h2o_warmup = 0;
  const ResultRow cold = find(replay_capture(cap, rc).rows(), "h2o");
  EXPECT_EQ(cold.steps, h2o.steps);
  EXPECT_NE(cold.mass_recall_mean, h2o.mass_recall_mean);
}

// ---------------------------------------------------------------------------------------
// Aggregation and writers

StepMetrics fake_metrics(std::vector<double> rel, std::vector<double> recall, double fraction,
                         int tokens, int budget) {
  StepMetrics m;
  m.rel_l2 = std::move(rel);
  m.mass_recall = std::move(recall);
  m.tokens_selected.assign(m.rel_l2.size(), tokens);
  m.kv_read_fraction = fraction;
  m.budget_tokens = budget;
  return m;
}

TEST(EvalReport, PercentilesInterpolateLinearly) {
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 10), 1.3);
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 90), 3.7);
  EXPECT_DOUBLE_EQ(percentile({7}, 90), 7.0);
  EXPECT_TRUE(std::isnan(percentile({}, 50)));
  EXPECT_THROW(percentile({1}, 101), std::invalid_argument);
}

TEST(EvalReport, AggregatesOverStepsHeadsAndLayers) {
  Aggregator agg;
  agg.add("quest", "tokens=32", 0, fake_metrics({0.1, 0.3}, {0.9, 0.7}, 0.25, 32, 32));
  agg.add("topk", "tokens=32", 0, fake_metrics({0.0, 0.0}, {1.0, 1.0}, 0.2, 32, 32));
  agg.add("quest", "tokens=32", 0, fake_metrics({0.2, 0.4}, {0.8, 0.6}, 0.75, 16, 32));
  agg.add("quest", "tokens=32", 1, fake_metrics({1.0, 1.0}, {0.0, 0.0}, 0.5, 32, -1));
  const std::vector<ResultRow> rows = agg.rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].method, "quest");
  EXPECT_EQ(rows[1].method, "topk");
  EXPECT_EQ(rows[2].layer, 1);
  EXPECT_EQ(rows[0].steps, 2);
  EXPECT_DOUBLE_EQ(rows[0].rel_l2_mean, 0.25);
  EXPECT_DOUBLE_EQ(rows[0].rel_l2_p50, 0.25);
  EXPECT_DOUBLE_EQ(rows[0].rel_l2_p90, 0.37);
  EXPECT_DOUBLE_EQ(rows[0].mass_recall_mean, 0.75);
  EXPECT_DOUBLE_EQ(rows[0].mass_recall_p10, 0.63);
  EXPECT_DOUBLE_EQ(rows[0].kv_read_fraction_mean, 0.5);
  EXPECT_DOUBLE_EQ(rows[0].tokens_selected_mean, 24.0);
  EXPECT_DOUBLE_EQ(rows[0].budget_tokens_mean, 32.0);
  EXPECT_TRUE(std::isnan(rows[2].budget_tokens_mean));  // no step had a budget
  EXPECT_TRUE(std::isnan(rows[0].read_reuse_mean));     // no step measured it
  {
    // read_reuse averages the steps that measured it (NaN: the first step).
    Aggregator reuse;
    StepMetrics m = fake_metrics({0.1}, {0.9}, 0.25, 32, -1);
    reuse.add("saap", "", 0, m);
    m.read_reuse = 0.5;
    reuse.add("saap", "", 0, m);
    m.read_reuse = 0.75;
    reuse.add("saap", "", 1, m);
    EXPECT_DOUBLE_EQ(reuse.rows()[0].read_reuse_mean, 0.5);
    EXPECT_DOUBLE_EQ(reuse.rows_over_layers()[0].read_reuse_mean, 0.625);
  }

  const std::vector<ResultRow> pooled = agg.rows_over_layers();
  ASSERT_EQ(pooled.size(), 2u);
  EXPECT_EQ(pooled[0].layer, -1);
  EXPECT_EQ(pooled[0].steps, 3);
  EXPECT_DOUBLE_EQ(pooled[0].rel_l2_mean, 3.0 / 6.0);
  EXPECT_DOUBLE_EQ(pooled[0].budget_tokens_mean, 32.0);

  EXPECT_THROW(agg.add("x", "", 0, StepMetrics{}), std::invalid_argument);
}

std::vector<ResultRow> sample_rows() {
  Aggregator agg;
  agg.add("quest", "tokens=32", 0, fake_metrics({0.1, 0.3}, {0.9, 0.7}, 0.25, 32, 32));
  agg.add("quest", "tokens=64", 0, fake_metrics({0.25, 0.75}, {0.95, 0.9}, 0.5, 64, 64));
  agg.add("topk", "tokens=32", 0, fake_metrics({0.01, 0.02}, {0.99, 0.98}, 0.3, 32, 32));
  agg.add("weird \"name\"\\,\n", "a,b", 0, fake_metrics({0.5, 0.5}, {0.5, 0.5}, 0.6, 1, -1));
  return agg.rows();
}

TEST(EvalReport, JsonIsEscapedAndCarriesTheFields) {
  std::ostringstream out;
  write_json(out, sample_rows(), {{"command", "kvs-eval --capture 'a b.h5'"}, {"backend", "cpu"}});
  const std::string j = out.str();
  EXPECT_EQ(j.rfind("{\n\"meta\": {\"command\": \"kvs-eval --capture 'a b.h5'\", \"backend\": \"cpu\"},\n\"rows\": [", 0), 0u)
      << j;
  EXPECT_NE(j.find("\"method\": \"quest\", \"knob\": \"tokens=64\", \"layer\": 0, \"steps\": 1"),
            std::string::npos)
      << j;
  EXPECT_NE(j.find("\"rel_l2_mean\": 0.5, "), std::string::npos) << j;
  EXPECT_NE(j.find("\"kv_read_fraction_mean\": 0.3,"), std::string::npos) << j;
  EXPECT_NE(j.find("\"method\": \"weird \\\"name\\\"\\\\,\\n\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"budget_tokens_mean\": null"), std::string::npos) << j;
  EXPECT_EQ(j.find("nan"), std::string::npos);
  // Structure: 4 objects, balanced braces outside strings, no raw control bytes in strings.
  int depth = 0, objects = 0;
  bool in_string = false;
  for (size_t i = 0; i < j.size(); ++i) {
    const char ch = j[i];
    if (in_string) {
      if (ch == '\\')
        ++i;
      else if (ch == '"')
        in_string = false;
      else
        EXPECT_GE((unsigned char)ch, 0x20u) << "raw control byte at " << i;
      continue;
    }
    if (ch == '"') in_string = true;
    if (ch == '{') ++objects, ++depth;
    if (ch == '}') --depth;
    EXPECT_GE(depth, 0);
  }
  EXPECT_EQ(depth, 0);
  EXPECT_FALSE(in_string);
  EXPECT_EQ(objects, 6);  // the top level, meta and 4 rows
  EXPECT_EQ(json_quote(std::string("\x01") + "\t"), "\"\\u0001\\t\"");
}

// Splits one CSV record (RFC 4180 quoting) into fields.
std::vector<std::string> csv_fields(const std::string& text, size_t& pos) {
  std::vector<std::string> f(1);
  bool quoted = false;
  for (; pos < text.size(); ++pos) {
    const char ch = text[pos];
    if (quoted) {
      if (ch == '"' && pos + 1 < text.size() && text[pos + 1] == '"') {
        f.back() += '"';
        ++pos;
      } else if (ch == '"') {
        quoted = false;
      } else {
        f.back() += ch;
      }
    } else if (ch == '"') {
      quoted = true;
    } else if (ch == ',') {
      f.emplace_back();
    } else if (ch == '\n') {
      ++pos;
      break;
    } else {
      f.back() += ch;
    }
  }
  return f;
}

TEST(EvalReport, CsvHasTheColumnsAndQuotesFields) {
  std::ostringstream out;
  write_csv(out, sample_rows());
  const std::string c = out.str();
  size_t pos = 0;
  const std::vector<std::string> header = csv_fields(c, pos);
  EXPECT_EQ(header,
            (std::vector<std::string>{
                "method", "knob", "layer", "steps", "rel_l2_mean", "rel_l2_p50", "rel_l2_p90",
                "mass_recall_mean", "mass_recall_p10", "kv_read_fraction_mean",
                "tokens_selected_mean", "budget_tokens_mean", "read_reuse_mean"}));
  std::vector<std::vector<std::string>> records;
  while (pos < c.size()) records.push_back(csv_fields(c, pos));
  ASSERT_EQ(records.size(), 4u);
  for (const auto& r : records) EXPECT_EQ(r.size(), header.size());
  EXPECT_EQ(records[1][1], "tokens=64");
  EXPECT_EQ(records[2][9], "0.3");
  EXPECT_EQ(records[3][0], "weird \"name\"\\,\n");
  EXPECT_EQ(records[3][1], "a,b");
  EXPECT_EQ(records[3][11], "nan");
}

TEST(EvalReport, TextTableIsAligned) {
  std::vector<ResultRow> rows = sample_rows();
  rows.pop_back();  // the multi-line name would break lines, as it should in a raw dump
  std::ostringstream out;
  write_table(out, rows);
  std::istringstream in(out.str());
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0].rfind("method", 0), 0u);
  EXPECT_NE(lines[0].find("kv_read_fraction_mean"), std::string::npos);
  // Right-aligned numeric last column: every line ends at the same column.
  for (const auto& l : lines) EXPECT_EQ(l.size(), lines[0].size()) << l;
  EXPECT_NE(lines[3].find("topk"), std::string::npos);
}

TEST(EvalPlot, WritesAPngWhenGnuplotExists) {
  if (!gnuplot_available()) GTEST_SKIP() << "gnuplot not installed";
  std::vector<ResultRow> rows = sample_rows();
  rows.pop_back();
  rows[0].rel_l2_mean = std::numeric_limits<double>::infinity();  // skipped, not fatal
  const std::string png = testing::TempDir() + "kvs_eval_plot_test.png";
  PlotConfig cfg;
  cfg.title = "layer 0 (it's a test)";
  plot_fidelity(rows, png, cfg);
  std::ifstream in(png, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  std::ifstream gp(png + ".gp");
  std::string script((std::istreambuf_iterator<char>(gp)), std::istreambuf_iterator<char>());
  EXPECT_NE(script.find("title 'topk'"), std::string::npos) << script;
  for (const char* ext : {"", ".gp", ".dat"}) std::remove((png + ext).c_str());
}

TEST(EvalPlot, MissingGnuplotOrMixedLayersIsAClearError) {
  std::vector<ResultRow> rows = sample_rows();
  PlotConfig cfg;
  cfg.gnuplot = "kvs-no-such-gnuplot";
  try {
    plot_fidelity(rows, testing::TempDir() + "never.png", cfg);
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("kvs-no-such-gnuplot' not found"), std::string::npos)
        << e.what();
  }
  rows[1].layer = 3;
  EXPECT_THROW(plot_fidelity(rows, testing::TempDir() + "never.png"), std::invalid_argument);
  EXPECT_THROW(plot_fidelity({}, testing::TempDir() + "never.png"), std::invalid_argument);
}

}  // namespace
}  // namespace kvs::eval
