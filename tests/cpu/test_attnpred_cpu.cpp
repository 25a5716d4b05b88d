// AttentionPredictor CPU reference: top-K selection, the token rule, history rows and
// pooling, the engine against dense attention, stored parts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>

#include "artifacts/bundle.h"
#include "artifacts/capture_file.h"
#include "kernels/attnpred/attnpred.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/saap/saap.h"
#include "runtime/attnpred_engine.h"

namespace kvs {
namespace {

namespace ap = kernels::attnpred;

TEST(AttnPredCpu, TopBlocksTakeHighestScoresLowestIndexOnTies) {
  const std::vector<float> s = {0.5f, 2.f, 1.f, 2.f, 1.f, 1.f, -3.f};
  std::vector<uint8_t> f(10, 0);
  ap::select_top_blocks_cpu(s.data(), int(s.size()), 4, 2, f.data());
  // 2.f at 1 and 3, then the 1.f ties: indices 2 and 4 before 5 (flags shifted by 2).
  EXPECT_EQ(f, (std::vector<uint8_t>{0, 0, 0, 1, 1, 1, 1, 0, 0, 0}));
  std::fill(f.begin(), f.end(), 0);
  ap::select_top_blocks_cpu(s.data(), int(s.size()), 100, 0, f.data());
  EXPECT_EQ(std::accumulate(f.begin(), f.end(), 0), 7);
  // Existing flags stay (the union of a group's heads).
  std::vector<uint8_t> g(7, 0);
  g[6] = 1;
  ap::select_top_blocks_cpu(s.data(), 7, 1, 0, g.data());
  EXPECT_EQ(g, (std::vector<uint8_t>{0, 1, 0, 0, 0, 0, 1}));
}

TEST(AttnPredCpu, TokenRuleIsSinkRecentAndFlaggedBlocks) {
  const ap::Geometry g{64, 16, 32, 48};
  const int n = 300;
  std::vector<uint8_t> flags(size_t(g.num_blocks(n)), 0);
  flags[5] = flags[9] = 1;  // tokens 80..95 and 144..159
  const std::vector<int32_t> t = ap::selected_tokens_cpu(g, n, flags.data());
  std::vector<int32_t> want;
  for (int i = 0; i < 32; ++i) want.push_back(i);
  for (int i = 80; i < 96; ++i) want.push_back(i);
  for (int i = 144; i < 160; ++i) want.push_back(i);
  for (int i = n - 48; i < n; ++i) want.push_back(i);
  EXPECT_EQ(t, want);
  EXPECT_EQ(g.candidate_begin(), 2);
  EXPECT_EQ(g.candidate_end(n), 19 - 3);
  EXPECT_THROW(ap::validate(ap::Geometry{64, 16, 30, 64}), std::invalid_argument);
}

TEST(AttnPredCpu, HistoryRingZeroPadsShortHistoriesAndDropsTheOldest) {
  const int H = 4, W = 6;
  std::vector<float> rows(size_t(2) * H * W, -1.f);
  int32_t count = 0, tokens = 0;
  ap::HistoryState h{rows.data(), &count, &tokens, 1, 2, H, W};
  std::vector<float> x(size_t(H) * 3);
  for (int step = 0; step < 6; ++step) {
    std::vector<float> r = {float(step), float(step) + 0.5f, float(step) + 0.25f};
    for (int head = 0; head < 2; ++head) ap::append_row_cpu(h, 0, head, r.data(), 3);
    ++count;
    ap::gather_input_cpu(h, 0, 1, 1, 4, x.data());
    for (int i = 0; i < H; ++i) {
      const int s = step - H + 1 + i;  // the step logical row i holds
      EXPECT_EQ(x[size_t(i) * 3 + 0], s < 0 ? 0.f : float(s) + 0.5f) << step << " " << i;
      EXPECT_EQ(x[size_t(i) * 3 + 2], 0.f);  // past the row's width: zero (was -1 before)
    }
  }
}

// A small random cache: one sequence, contiguous page.
struct Scene {
  ModelShape shape;
  int n = 0;
  std::vector<bf16> k, v, q;
  int32_t table = 0, len = 0;
  PagedKV kv;
  Scene(int tokens, uint32_t seed) : n(tokens) {
    shape.name = "attnpred-test";
    shape.num_layers = 3;
    shape.num_q_heads = 4;
    shape.num_kv_heads = 2;
    shape.head_dim = 64;
    shape.max_position = 4096;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    k.resize(size_t(4096) * 2 * 64);
    v.resize(k.size());
    for (auto& x : k) x = float_to_bf16(nd(rng));
    for (auto& x : v) x = float_to_bf16(nd(rng));
    q.resize(size_t(4) * 64);
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = &table;
    kv.seq_lens = &len;
    kv.batch = 1;
    kv.num_pages = 1;
    kv.page_size = 4096;
    kv.num_kv_heads = 2;
    kv.head_dim = 64;
    kv.max_pages_per_seq = 1;
    len = n;
  }
  void new_query(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.5f);
    for (auto& x : q) x = float_to_bf16(nd(rng));
  }
};

AttnPredParams test_params(int budget) {
  AttnPredParams p;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 0.2f);
  p.cnn.resize(ap::kParamCount);
  for (auto& w : p.cnn) w = nd(rng);
  p.budget_tokens = budget;
  p.dense_layers = {0};
  return p;
}

// The warm-up (full) row over every key; with calibration_keys e4m3 or int4 over the keys
// rounded as the CUDA rows' copy holds them and (int4) q rounded to int8 as those rows take it
// (the attention itself is unchanged).
TEST(AttnPredCpu, WarmupRowIsThePooledFullSoftmax) {
  for (CalibrationKeys keys :
       {CalibrationKeys::Bf16, CalibrationKeys::E4m3, CalibrationKeys::Int4}) {
    SCOPED_TRACE(to_string(keys));
    Scene sc(700, 1);
    EngineConfig cfg;
    cfg.backend = Backend::Cpu;
    cfg.attnpred.calibration_keys = keys;
    AttnPredEngine e(sc.shape, cfg, test_params(256));
    e.prefill(1, sc.kv, nullptr);
    sc.new_query(9);
    std::vector<bf16> out(sc.q.size());
    e.decode(1, sc.q.data(), nullptr, sc.kv, out.data(), nullptr, nullptr);
    const std::vector<float> rows = e.history_rows(1);
    EXPECT_EQ(e.history_count(1)[0], 1);
    const int mb = e.max_blocks(), H = e.geometry().history;
    const ap::KeyFormat format =
        keys == CalibrationKeys::Int4 ? ap::KeyFormat::Int4 : ap::KeyFormat::E4m3;
    for (int qh = 0; qh < 4; ++qh) {
      std::vector<double> s(size_t(sc.n));
      double m = -1e300, z = 0;
      float qf[64], qr[64];
      for (int i = 0; i < 64; ++i) qf[i] = bf16_to_float(sc.q[size_t(qh) * 64 + i]);
      if (keys == CalibrationKeys::Bf16)
        std::copy(qf, qf + 64, qr);
      else
        ap::round_query_cpu(format, qf, 64, qr);
      for (int t = 0; t < sc.n; ++t) {
        const bf16* k = sc.k.data() + (size_t(t) * 2 + qh / 2) * 64;
        float kr[64];
        if (keys != CalibrationKeys::Bf16) {
          ap::round_key_cpu(format, k, 64, kr);
        } else {
          for (int i = 0; i < 64; ++i) kr[i] = bf16_to_float(k[i]);
        }
        double dot = 0;
        for (int i = 0; i < 64; ++i) dot += double(qr[i]) * kr[i];
        s[size_t(t)] = dot * sc.shape.scale();
        m = std::max(m, s[size_t(t)]);
      }
      for (double x : s) z += std::exp(x - m);
      const float* row = rows.data() + (size_t(qh) * H + 0) * mb;  // ring slot 0
      for (int j = 0; j < mb; ++j) {
        double want = 0;
        for (int t = j * 16; t < std::min(sc.n, j * 16 + 16); ++t)
          want = std::max(want, std::exp(s[size_t(t)] - m) / z);
        ASSERT_NEAR(row[j], want, 1e-6 * std::max(1.0, want)) << "head " << qh << " block " << j;
      }
    }
    EXPECT_TRUE(e.last_read(1, 0).empty());  // the warm-up step read every token
  }
}

// A key in e4m3: the rule SAAP's router weights use (one rule, kernels/common/e4m3.h), each
// element within e4m3's half step (2^-4 relative) of its bf16 value or within the smallest
// subnormal step of the scale, the largest element kept, a zero key kept zero.
TEST(AttnPredCpu, KeysRoundToE4m3WithAScalePerKey) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int d : {64, 128})
    for (float spread : {1e-3f, 1.f, 300.f}) {
      std::vector<bf16> k(static_cast<size_t>(d));
      for (auto& x : k) x = float_to_bf16(spread * nd(rng));
      k[size_t(d / 3)] = float_to_bf16(-4 * spread);  // the largest magnitude, negative
      std::vector<float> got(static_cast<size_t>(d)), as_float(got.size()), saap(got.size());
      ap::round_key_cpu(ap::KeyFormat::E4m3, k.data(), d, got.data());
      float amax = 0.f;
      for (int e = 0; e < d; ++e) {
        as_float[size_t(e)] = bf16_to_float(k[size_t(e)]);
        amax = std::max(amax, std::fabs(as_float[size_t(e)]));
      }
      std::vector<uint8_t> q(got.size());
      float scale = 0.f;
      kernels::saap::quantize_rows_e4m3(as_float.data(), 1, d, q.data(), &scale, saap.data());
      EXPECT_FLOAT_EQ(scale, amax / 448.f);
      for (int e = 0; e < d; ++e) {
        EXPECT_EQ(got[size_t(e)], saap[size_t(e)]) << "d " << d << " element " << e;
        const float x = as_float[size_t(e)];
        EXPECT_LE(std::fabs(got[size_t(e)] - x), std::fabs(x) / 16 + scale * 0x1p-9f)
            << "d " << d << " element " << e;
      }
      EXPECT_NEAR(got[size_t(d / 3)], as_float[size_t(d / 3)], 1e-6f * amax);
    }
  std::vector<bf16> zero(64, float_to_bf16(0.f));
  std::vector<float> got(64, 1.f);
  ap::round_key_cpu(ap::KeyFormat::E4m3, zero.data(), 64, got.data());
  for (float x : got) EXPECT_EQ(x, 0.f);
}

// A key in int4 and a query head in int8 (kernels/common/int_rows.h): each element the
// nearest multiple of the row's scale max |x| / L (L = 7, 127) within [-L, L], ties to even,
// so within half a step of its value; the largest element kept exactly (+-L steps), a zero
// row kept zero. The E4m3 format leaves a query as it is.
TEST(AttnPredCpu, KeysRoundToInt4AndQueriesToInt8WithAScalePerRow) {
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int d : {64, 128})
    for (float spread : {1e-3f, 1.f, 300.f}) {
      SCOPED_TRACE("d " + std::to_string(d) + " spread " + std::to_string(spread));
      std::vector<bf16> k(static_cast<size_t>(d));
      for (auto& x : k) x = float_to_bf16(spread * nd(rng));
      k[size_t(d / 3)] = float_to_bf16(-4 * spread);  // the largest magnitude, negative
      std::vector<float> kf(static_cast<size_t>(d)), got(kf.size()), qgot(kf.size());
      float amax = 0.f;
      for (int e = 0; e < d; ++e)
        amax = std::max(amax, std::fabs(kf[size_t(e)] = bf16_to_float(k[size_t(e)])));
      ap::round_key_cpu(ap::KeyFormat::Int4, k.data(), d, got.data());
      ap::round_query_cpu(ap::KeyFormat::Int4, kf.data(), d, qgot.data());
      const float s4 = amax / 7.f, s8 = amax / 127.f;
      std::set<float> levels;
      for (int e = 0; e < d; ++e) {
        const float x = kf[size_t(e)];
        const float l4 = got[size_t(e)] / s4, l8 = qgot[size_t(e)] / s8;
        EXPECT_NEAR(l4, std::nearbyint(l4), 1e-4f) << "element " << e;  // a whole level
        EXPECT_LE(std::fabs(l4), 7.f + 1e-4f);
        EXPECT_LE(std::fabs(got[size_t(e)] - x), 0.5f * s4 * (1 + 1e-5f)) << "element " << e;
        EXPECT_LE(std::fabs(qgot[size_t(e)] - x), 0.5f * s8 * (1 + 1e-5f)) << "element " << e;
        EXPECT_NEAR(l8, std::nearbyint(l8), 1e-3f) << "element " << e;
        levels.insert(std::nearbyint(l4));
      }
      EXPECT_FLOAT_EQ(got[size_t(d / 3)], -7 * s4);
      EXPECT_FLOAT_EQ(qgot[size_t(d / 3)], -127 * s8);
      EXPECT_GE(levels.size(), 8u);  // a normal row uses most of the 15 levels
      ap::round_query_cpu(ap::KeyFormat::E4m3, kf.data(), d, qgot.data());
      EXPECT_EQ(qgot, kf);
    }
  std::vector<bf16> zero(64, float_to_bf16(0.f));
  std::vector<float> got(64, 1.f), zf(64, 0.f);
  ap::round_key_cpu(ap::KeyFormat::Int4, zero.data(), 64, got.data());
  for (float x : got) EXPECT_EQ(x, 0.f);
  ap::round_query_cpu(ap::KeyFormat::Int4, zf.data(), 64, got.data());
  for (float x : got) EXPECT_EQ(x, 0.f);
}

// The e4m3 and int4 calibration keys are a GPU-resident copy: offload mode (whose rows read
// the host's keys) refuses them by name, before any device work; an unknown format is named.
TEST(AttnPredCpu, CopiedCalibrationKeysRefuseOffloadMode) {
  Scene sc(700, 1);
  for (CalibrationKeys keys : {CalibrationKeys::E4m3, CalibrationKeys::Int4}) {
    EngineConfig cfg;
    cfg.backend = Backend::Cuda;
    cfg.attnpred.offload = true;
    cfg.attnpred.calibration_keys = keys;
    try {
      AttnPredEngine e(sc.shape, cfg, test_params(256));
      FAIL() << "no error";
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what())
                    .find(std::string("calibration_keys ") + to_string(keys) +
                          " needs GPU-resident mode"),
                std::string::npos)
          << err.what();
    }
  }
  EXPECT_EQ(calibration_keys_from_string("int4"), CalibrationKeys::Int4);
  try {
    calibration_keys_from_string("int3");
    FAIL() << "no error";
  } catch (const std::invalid_argument& err) {
    EXPECT_NE(std::string(err.what()).find("'int3' (known: bf16, e4m3, int4)"), std::string::npos)
        << err.what();
  }
}

// A prefill names what is wrong: a prompt longer than max_context, a cache of another shape.
TEST(AttnPredCpu, PrefillRefusesPromptsPastMaxContextAndCachesOfAnotherShape) {
  Scene sc(700, 1);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.attnpred.max_context = 512;
  AttnPredEngine e(sc.shape, cfg, test_params(256));
  try {
    e.prefill(1, sc.kv, nullptr);
    FAIL() << "no error";
  } catch (const std::out_of_range& err) {
    EXPECT_NE(std::string(err.what()).find("sequence 0 has 700 tokens, above max_context 512"),
              std::string::npos)
        << err.what();
  }
  PagedKV other = sc.kv;
  other.num_kv_heads = 1;
  sc.len = 300;
  EXPECT_THROW(e.prefill(1, other, nullptr), std::invalid_argument);
  EXPECT_NO_THROW(e.prefill(1, sc.kv, nullptr));
}

TEST(AttnPredCpu, EngineAttendsItsSelectionAndMatchesDenseWhenTheBudgetCoversAll) {
  Scene sc(600, 2);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  // Budget above the context: every candidate block is taken, so the output is dense.
  AttnPredEngine big(sc.shape, cfg, test_params(1024));
  AttnPredEngine small(sc.shape, cfg, test_params(256));
  big.prefill(2, sc.kv, nullptr);
  small.prefill(2, sc.kv, nullptr);
  std::vector<bf16> ob(sc.q.size()), os(sc.q.size());
  std::vector<float> dense(sc.q.size());
  for (int step = 0; step < 12; ++step) {
    sc.len = sc.n + step;
    sc.new_query(100 + step);
    big.decode(2, sc.q.data(), nullptr, sc.kv, ob.data(), nullptr, nullptr);
    small.decode(2, sc.q.data(), nullptr, sc.kv, os.data(), nullptr, nullptr);
    kernels::dense_decode_cpu(sc.q.data(), 4, sc.kv, float(sc.shape.scale()), dense.data(),
                              nullptr);
    for (size_t i = 0; i < dense.size(); ++i)
      ASSERT_NEAR(bf16_to_float(ob[i]), dense[i], 1e-2 + 1e-2 * std::abs(dense[i]));
    const auto read = small.last_read(2, 0);
    if (step == 0) {
      EXPECT_TRUE(read.empty());
      continue;
    }
    ASSERT_EQ(read.size(), 4u);
    for (int qh = 0; qh < 4; ++qh) {
      const auto& t = read[size_t(qh)];
      // Sink and recent always; at most the group's union of budgets.
      for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::binary_search(t.begin(), t.end(), i));
      for (int i = sc.len - 64; i < sc.len; ++i)
        EXPECT_TRUE(std::binary_search(t.begin(), t.end(), i));
      EXPECT_LE(int(t.size()), 64 + 64 + 2 * (256 - 128));
      EXPECT_LT(int(t.size()), sc.len);
      // The output is exact attention over exactly those tokens.
      std::vector<float> qf(64);
      for (int i = 0; i < 64; ++i) qf[size_t(i)] = bf16_to_float(sc.q[size_t(qh) * 64 + i]);
      std::vector<double> o(64);
      double l;
      kernels::attend_cpu(qf.data(), sc.kv, 0, qh / 2, t.data(), int(t.size()), sc.shape.scale(),
                          o.data(), &l);
      for (int i = 0; i < 64; ++i)
        ASSERT_EQ(bf16_to_float(os[size_t(qh) * 64 + i]),
                  bf16_to_float(float_to_bf16(float(o[size_t(i)]))));
    }
  }
  EXPECT_EQ(small.history_count(2)[0], 12);
  EXPECT_LT(small.stats().kv_read_fraction(), 1.0);
  EXPECT_THROW(small.decode(1, sc.q.data(), nullptr, sc.kv, os.data(), nullptr, nullptr),
               std::logic_error);  // layer 1 never prefilled
}

// predict_interval 3: the block flags change only on the warm-up steps and every third step
// after them (layer 1's phase shifted by one step); every step still appends its history row,
// and a step between predictions attends sink, its own recent window and the kept blocks.
TEST(AttnPredCpu, EnginePredictsEveryIntervalAndKeepsItsBlocksBetween) {
  Scene sc(900, 4);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.attnpred.predict_interval = 0;
  EXPECT_THROW(AttnPredEngine(sc.shape, cfg, test_params(256)), std::invalid_argument);
  cfg.attnpred.predict_interval = 3;
  cfg.attnpred.warmup_steps = 2;
  AttnPredEngine e(sc.shape, cfg, test_params(256));
  EXPECT_EQ(e.predict_interval(), 3);
  e.prefill(1, sc.kv, nullptr);
  std::vector<bf16> out(sc.q.size());
  std::vector<uint8_t> before = e.block_flags(1);
  int changed = 0;
  for (int step = 0; step < 14; ++step) {
    sc.len = sc.n + step;
    sc.new_query(300 + step);
    e.decode(1, sc.q.data(), nullptr, sc.kv, out.data(), nullptr, nullptr);
    EXPECT_EQ(e.history_count(1)[0], step + 1);
    const std::vector<uint8_t> flags = e.block_flags(1);
    const bool predicted = step < 2 || (step - 2 + 1 + 1) % 3 == 0;  // layer 1: phase shifted by 1
    if (!predicted) {
      ASSERT_EQ(flags, before) << "step " << step << " changed the selection between predictions";
    } else if (step > 1) {
      changed += flags != before;
    }
    if (step >= 2) {  // sparse: the flags as they were when the step began
      const auto read = e.last_read(1, 0);
      ASSERT_EQ(read.size(), 4u);
      for (int h = 0; h < 2; ++h)
        EXPECT_EQ(read[size_t(h) * 2],
                  ap::selected_tokens_cpu(e.geometry(), sc.len,
                                          before.data() + size_t(h) * e.max_blocks()))
            << "step " << step << " kv head " << h;
    }
    before = flags;
  }
  EXPECT_GT(changed, 0) << "no prediction after the warm-up changed the selection";
}

// group_history: one history per kv head, whose newest row is the largest of the group's
// pooled softmax rows over the tokens the step read (all of them on warm-up and calibration
// steps), and one CNN prediction and top-K per kv head from it: each kv head flags exactly
// k_blocks candidates and every query head reads at most the budget.
TEST(AttnPredCpu, GroupedHistoryIsTheGroupsLargestRowAndPredictsPerKvHead) {
  Scene sc(900, 5);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.attnpred.group_history = 1;
  cfg.attnpred.calibration_period = 3;
  const AttnPredParams params = test_params(256);
  AttnPredEngine e(sc.shape, cfg, params);
  e.prefill(1, sc.kv, nullptr);
  const int mb = e.max_blocks(), H = e.geometry().history, k_blocks = e.k_blocks();
  ASSERT_EQ(k_blocks, 8);
  std::vector<bf16> out(sc.q.size());
  for (int step = 0; step < 9; ++step) {
    sc.len = sc.n + step;
    sc.new_query(500 + step);
    e.decode(1, sc.q.data(), nullptr, sc.kv, out.data(), nullptr, nullptr);
    const std::vector<float> rows = e.history_rows(1);
    ASSERT_EQ(rows.size(), size_t(2) * H * mb);  // two kv heads' histories
    const auto read = e.last_read(1, 0);
    const bool full = step == 0 || (step + 2) % 3 == 0;  // layer 1's phase one step on
    for (int h = 0; h < 2; ++h) {
      std::vector<int32_t> tokens;
      if (full) {
        tokens.resize(size_t(sc.len));
        std::iota(tokens.begin(), tokens.end(), 0);
      } else {
        ASSERT_EQ(read.size(), 4u);
        tokens = read[size_t(h) * 2];
        EXPECT_LE(int(tokens.size()), 256 + 16) << "step " << step;  // the budget, no union
      }
      std::vector<double> want(size_t(mb), 0.0);
      for (int qh = 2 * h; qh < 2 * h + 2; ++qh) {
        std::vector<double> s(tokens.size());
        double m = -1e300, z = 0;
        for (size_t i = 0; i < tokens.size(); ++i) {
          double dot = 0;
          for (int d = 0; d < 64; ++d)
            dot += double(bf16_to_float(sc.q[size_t(qh) * 64 + d])) *
                   double(bf16_to_float(sc.k[(size_t(tokens[i]) * 2 + h) * 64 + d]));
          s[i] = dot * sc.shape.scale();
          m = std::max(m, s[i]);
        }
        for (double x : s) z += std::exp(x - m);
        for (size_t i = 0; i < tokens.size(); ++i)
          want[size_t(tokens[i] / 16)] =
              std::max(want[size_t(tokens[i] / 16)], std::exp(s[i] - m) / z);
      }
      const float* newest = rows.data() + (size_t(h) * H + size_t(step % H)) * mb;
      for (int j = 0; j < mb; ++j)
        ASSERT_NEAR(newest[j], want[size_t(j)], 1e-6 * std::max(1.0, want[size_t(j)]))
            << "step " << step << " kv head " << h << " block " << j;
    }
    // The prediction this step made: the CNN over each kv head's own history.
    const std::vector<uint8_t> flags = e.block_flags(1);
    const ap::Geometry& g = e.geometry();
    const int c0 = g.candidate_begin(), c1 = g.candidate_end(sc.len), w = c1 - c0;
    ASSERT_GT(w, k_blocks);
    for (int h = 0; h < 2; ++h) {
      std::vector<float> x(size_t(H) * w, 0.f), y(static_cast<size_t>(w));
      for (int i = 0; i < H; ++i) {  // logical row i: ring slot (count - H + i), zeros before
        const int r = step + 1 - H + i;
        if (r < 0) continue;
        for (int c = 0; c < w; ++c)
          x[size_t(i) * w + c] = rows[(size_t(h) * H + size_t(r % H)) * mb + c0 + c];
      }
      ap::cnn_forward_cpu(params.cnn.data(), x.data(), 1, H, w, y.data());
      std::vector<uint8_t> want(size_t(mb), 0);
      ap::select_top_blocks_cpu(y.data(), w, k_blocks, c0, want.data());
      const std::vector<uint8_t> got(flags.begin() + h * mb, flags.begin() + (h + 1) * mb);
      EXPECT_EQ(got, want) << "step " << step << " kv head " << h;
      EXPECT_EQ(std::accumulate(got.begin(), got.end(), 0), k_blocks);
    }
  }
}

TEST(AttnPredCpu, StoredPartsRoundTripAndValidate) {
  Scene sc(100, 3);
  const std::string path = "attnpred_parts_" + std::to_string(::getpid()) + ".h5";
  const AttnPredParams p = test_params(512);
  {
    BundleWriter w(path, sc.shape);
    write_attnpred_params(w.method_group("attnpred"), p);
    w.commit();
  }
  const Bundle b = Bundle::open(path);
  const AttnPredParams r = load_attnpred_params(b.method_group("attnpred"), sc.shape);
  EXPECT_EQ(r.cnn, p.cnn);
  EXPECT_EQ(r.budget_tokens, 512);
  EXPECT_EQ(r.dense_layers, p.dense_layers);
  EXPECT_NO_THROW(validate_stored_parts(Method::AttnPred, b.method_group("attnpred"), sc.shape));
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  EXPECT_EQ(make_engine(Method::AttnPred, sc.shape, cfg, &b)->method(), Method::AttnPred);
  EXPECT_THROW(make_engine(Method::AttnPred, sc.shape, cfg, nullptr), std::invalid_argument);
  cfg.attnpred.budget_tokens = 200;  // not sink + recent + a multiple of 16
  EXPECT_THROW(make_engine(Method::AttnPred, sc.shape, cfg, &b), std::invalid_argument);
  std::remove(path.c_str());
}

// A bundle whose CNN was trained on grouped rows says so, and the engine keeps a history per kv
// head unless the config overrides; a bundle without the attribute (written before it) means
// per query head; any other value is an error that names it.
TEST(AttnPredCpu, StoredGroupHistoryPicksTheEnginesForm) {
  Scene sc(300, 6);
  const std::string path = "attnpred_grouped_" + std::to_string(::getpid()) + ".h5";
  AttnPredParams p = test_params(256);
  p.group_history = true;
  {
    BundleWriter w(path, sc.shape);
    write_attnpred_params(w.method_group("attnpred"), p);
    w.commit();
  }
  const AttnPredParams r =
      load_attnpred_params(Bundle::open(path).method_group("attnpred"), sc.shape);
  EXPECT_TRUE(r.group_history);
  std::remove(path.c_str());
  auto histories = [&](int knob) {
    EngineConfig cfg;
    cfg.backend = Backend::Cpu;
    cfg.attnpred.group_history = knob;
    AttnPredEngine e(sc.shape, cfg, r);
    e.prefill(1, sc.kv, nullptr);
    return e.history_rows(1).size() / (size_t(e.geometry().history) * e.max_blocks());
  };
  EXPECT_EQ(histories(-1), 2u);  // the bundle's: one per kv head
  EXPECT_EQ(histories(0), 4u);   // overridden: one per query head
  EXPECT_EQ(histories(1), 2u);
  EXPECT_THROW(histories(2), std::invalid_argument);
  {
    BundleWriter w(path, sc.shape);
    write_attnpred_params(w.method_group("attnpred"), p);
    w.method_group("attnpred").set_attr_int("group_history", 2);
    w.commit();
  }
  try {
    load_attnpred_params(Bundle::open(path).method_group("attnpred"), sc.shape);
    ADD_FAILURE() << "group_history 2 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("group_history 2"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvs
