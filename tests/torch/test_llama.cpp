// The libtorch runner on the real kvs-tiny-a weights (CPU): agreement with transformers
// (through a fixture made on the GPU machine by scripts/make_logits_fixture.py), internal
// consistency (chunked prefill, decode), the observer hooks, and a bits-per-byte sanity check
// that catches RoPE layout mistakes.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "capture/llama.h"
#include "capture/tokens.h"
#include "kernels/common/rope.h"
#include "tests/torch/test_util.h"

namespace kvs {
namespace {

const LlamaModel& tiny_fp32() {
  static const LlamaModel m =
      LlamaModel::load(testing::tiny_model_dir(), torch::kCPU, torch::kFloat32);
  return m;
}

const LlamaModel& tiny_bf16() {
  static const LlamaModel m =
      LlamaModel::load(testing::tiny_model_dir(), torch::kCPU, torch::kBFloat16);
  return m;
}

std::vector<int32_t> val_tokens(size_t bytes) {
  return byte_tokens(tiny_fp32().config(), testing::validation_text(bytes));
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

double bits_per_byte(const LlamaModel& m, const std::vector<int32_t>& ids) {
  KvCache cache = m.new_cache();
  const torch::Tensor logits = m.prefill(ids, cache);
  return next_token_nll(logits, ids).mean().item<double>() / std::log(2.0);
}

// ------------------------------------------------------------------ against transformers

std::string fixture_path() {
  return std::string(KVS_SOURCE_DIR) + "/tests/fixtures/kvs_tiny_a_logits.h5";
}

struct Fixture {
  std::vector<int32_t> tokens, long_tokens;
  torch::Tensor logits, long_last_logits;  // fp32 CPU
  std::string transformers_version;
};

std::unique_ptr<Fixture> load_fixture() {
  if (!testing::path_exists(fixture_path())) return nullptr;
  const h5::File f = h5::File::open_read(fixture_path());
  auto fx = std::make_unique<Fixture>();
  fx->tokens = h5::open_dataset(f.root(), "tokens", h5::DType::I32, {-1}).read<int32_t>();
  const int64_t T = int64_t(fx->tokens.size());
  auto logits = h5::open_dataset(f.root(), "logits", h5::DType::F32, {T, 256}).read<float>();
  fx->logits = torch::from_blob(logits.data(), {T, 256}, torch::kFloat32).clone();
  fx->long_tokens = h5::open_dataset(f.root(), "long_tokens", h5::DType::I32, {-1}).read<int32_t>();
  auto last = h5::open_dataset(f.root(), "long_last_logits", h5::DType::F32, {256}).read<float>();
  fx->long_last_logits = torch::from_blob(last.data(), {256}, torch::kFloat32).clone();
  fx->transformers_version = f.root().attr_string("transformers_version");
  return fx;
}

#define SKIP_WITHOUT_FIXTURE(fx)                                                                \
  if (!(fx))                                                                                    \
  GTEST_SKIP() << "no fixture " << fixture_path()                                               \
               << ": run scripts/make_logits_fixture.py <model folder> on the GPU machine (it " \
                  "needs transformers) and copy the file there"

TEST(LlamaVsTransformers, Fp32LogitsMatch) {
  const auto fx = load_fixture();
  SKIP_WITHOUT_FIXTURE(fx);
  KvCache cache = tiny_fp32().new_cache();
  const torch::Tensor ours = tiny_fp32().prefill(fx->tokens, cache);
  const double scale = fx->logits.abs().max().item<double>();
  const double diff = max_abs_diff(ours, fx->logits);
  RecordProperty("transformers_version", fx->transformers_version);
  std::printf("fp32 vs transformers %s: max |dlogit| %.3g (logit scale %.3g)\n",
              fx->transformers_version.c_str(), diff, scale);
  EXPECT_LT(diff, 1e-3 * scale);
  EXPECT_TRUE(torch::equal(ours.argmax(-1), fx->logits.argmax(-1)));
}

TEST(LlamaVsTransformers, Fp32ChunkedLongPrefillLastLogits) {
  const auto fx = load_fixture();
  SKIP_WITHOUT_FIXTURE(fx);
  KvCache cache = tiny_fp32().new_cache();
  PrefillOptions opt;
  opt.chunk = 128;
  opt.logits = LogitsMode::Last;
  const torch::Tensor ours = tiny_fp32().prefill(fx->long_tokens, cache, opt).squeeze(0);
  const double scale = fx->long_last_logits.abs().max().item<double>();
  EXPECT_LT(max_abs_diff(ours, fx->long_last_logits), 1e-3 * scale);
  EXPECT_EQ(ours.argmax().item<int64_t>(), fx->long_last_logits.argmax().item<int64_t>());
}

TEST(LlamaVsTransformers, Bf16LogitsClose) {
  const auto fx = load_fixture();
  SKIP_WITHOUT_FIXTURE(fx);
  KvCache cache = tiny_bf16().new_cache();
  const torch::Tensor ours = tiny_bf16().prefill(fx->tokens, cache);
  const double scale = fx->logits.abs().max().item<double>();
  const double diff = max_abs_diff(ours, fx->logits);
  const double agree =
      ours.argmax(-1).eq(fx->logits.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  std::printf("bf16 vs transformers fp32: max |dlogit| %.3g (scale %.3g), argmax agreement %.3f\n",
              diff, scale, agree);
  // bf16 weights and activations: ~3 significant digits per op, compounded over 4 layers.
  EXPECT_LT(diff, 0.05 * scale);
  EXPECT_GT(agree, 0.95);
}

// The same runner on CUDA (the GPU machine): fp32 and bf16 against transformers, and decode
// steps against the prefill logits, all on the device.
TEST(LlamaCuda, MatchesTransformers) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto fx = load_fixture();
  SKIP_WITHOUT_FIXTURE(fx);
  const double scale = fx->logits.abs().max().item<double>();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const LlamaModel m = LlamaModel::load(testing::tiny_model_dir(), torch::kCUDA, dtype);
    KvCache cache = m.new_cache();
    PrefillOptions opt;
    opt.chunk = 64;
    const torch::Tensor ours = m.prefill(fx->tokens, cache, opt);
    ASSERT_TRUE(ours.is_cuda());
    const torch::Tensor cpu = ours.cpu();
    const double diff = max_abs_diff(cpu, fx->logits);
    const double agree =
        cpu.argmax(-1).eq(fx->logits.argmax(-1)).to(torch::kFloat64).mean().item<double>();
    std::printf("CUDA %s vs transformers fp32: max |dlogit| %.3g, argmax agreement %.3f\n",
                c10::toString(dtype), diff, agree);
    if (dtype == torch::kFloat32) {
      EXPECT_LT(diff, 1e-3 * scale);
      EXPECT_EQ(agree, 1.0);
    } else {
      EXPECT_LT(diff, 0.05 * scale);
      EXPECT_GT(agree, 0.95);
    }
    // Re-run the last 8 tokens as decode steps over the same prefix.
    const int64_t T = int64_t(fx->tokens.size());
    KvCache dec = m.new_cache();
    m.prefill(std::vector<int32_t>(fx->tokens.begin(), fx->tokens.end() - 8), dec, opt);
    for (int64_t t = T - 8; t < T; ++t) {
      const torch::Tensor step = m.decode(fx->tokens[size_t(t)], dec).cpu();
      // Same math in another order (one query vs a chunk): fp32 rounding for fp32, a few bf16
      // ulps of the logits for bf16.
      EXPECT_LT(max_abs_diff(step, cpu[t]), dtype == torch::kFloat32 ? 1e-3 : 0.05 * scale)
          << "position " << t;
    }
  }
}

// ------------------------------------------------------------------ internal consistency

TEST(Llama, ChunkedPrefillEqualsUnchunked) {
  const LlamaModel& m = tiny_fp32();
  const auto ids = val_tokens(150);
  KvCache whole = m.new_cache(), chunked = m.new_cache();
  PrefillOptions one;
  one.chunk = int64_t(ids.size());
  const torch::Tensor a = m.prefill(ids, whole, one);
  PrefillOptions small;
  small.chunk = 17;  // does not divide 151: the last chunk is partial
  const torch::Tensor b = m.prefill(ids, chunked, small);
  ASSERT_EQ(a.sizes(), b.sizes());
  EXPECT_EQ(a.size(0), int64_t(ids.size()));
  EXPECT_LT(max_abs_diff(a, b), 1e-4);
  EXPECT_EQ(whole.size(), chunked.size());
  for (int l = 0; l < m.shape().num_layers; ++l) {
    EXPECT_LT(max_abs_diff(whole.keys(l), chunked.keys(l)), 1e-4) << "layer " << l;
    EXPECT_LT(max_abs_diff(whole.values(l), chunked.values(l)), 1e-4) << "layer " << l;
  }
  // Only the last position's logits, as a capture prefill asks for them.
  KvCache last_cache = m.new_cache();
  small.logits = LogitsMode::Last;
  const torch::Tensor last = m.prefill(ids, last_cache, small);
  ASSERT_EQ(last.sizes(), (std::vector<int64_t>{1, 256}));
  EXPECT_LT(max_abs_diff(last[0], a[-1]), 1e-4);
}

TEST(Llama, PrefillThenDecodeEqualsFullForward) {
  const LlamaModel& m = tiny_fp32();
  const auto ids = val_tokens(79);  // 80 tokens with BOS
  KvCache full_cache = m.new_cache();
  const torch::Tensor full = m.prefill(ids, full_cache);

  KvCache cache = m.new_cache(4);  // small reservation: decode must grow the cache
  const int64_t prompt = 60;
  const std::vector<int32_t> head(ids.begin(), ids.begin() + prompt);
  const torch::Tensor pre = m.prefill(head, cache);
  EXPECT_LT(max_abs_diff(pre, full.narrow(0, 0, prompt)), 1e-4);
  for (int64_t t = prompt; t < int64_t(ids.size()); ++t) {
    const torch::Tensor step = m.decode(ids[size_t(t)], cache);
    ASSERT_EQ(step.dim(), 1);
    EXPECT_LT(max_abs_diff(step, full[t]), 1e-4) << "position " << t;
    EXPECT_EQ(step.argmax().item<int64_t>(), full[t].argmax().item<int64_t>()) << "position " << t;
  }
  EXPECT_EQ(cache.size(), int64_t(ids.size()));
  EXPECT_GE(cache.capacity(), cache.size());
}

// Records what the hooks deliver.
struct Recorder : LlamaObserver {
  std::vector<int64_t> starts;
  std::vector<torch::Tensor> q, k, v;  // layer 2 only
  std::vector<torch::Tensor> probs;    // layer 2 decode steps
  void on_qkv(int layer, int64_t start, const torch::Tensor& q_pre, const torch::Tensor& k_pre,
              const torch::Tensor& v_) override {
    if (layer != 2) return;
    starts.push_back(start);
    q.push_back(q_pre);
    k.push_back(k_pre);
    v.push_back(v_);
  }
  bool wants_attention(int layer) const override { return layer == 2; }
  void on_attention(int layer, int64_t pos, const torch::Tensor& p) override {
    EXPECT_EQ(layer, 2);
    EXPECT_EQ(pos, starts.back());
    probs.push_back(p);
  }
};

// The hooks' pre-RoPE q/k, rotated by the kernels' CPU RoPE (the project's one RoPE
// reference), reproduce the cached keys and the reported attention rows.
TEST(Llama, ObserverSeesPreRopeQkvAndAttentionRows) {
  const LlamaModel& m = tiny_fp32();
  const ModelShape& s = m.shape();
  const int hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim, g = s.group_size();
  const auto ids = val_tokens(40);  // 41 tokens: prefill 38 in chunks of 16, then 3 decode steps
  Recorder rec;
  KvCache cache = m.new_cache();
  PrefillOptions opt;
  opt.chunk = 16;
  m.prefill(std::vector<int32_t>(ids.begin(), ids.begin() + 38), cache, opt, &rec);
  EXPECT_EQ(rec.starts, (std::vector<int64_t>{0, 16, 32}));
  EXPECT_TRUE(rec.probs.empty()) << "attention rows are for decode steps only";
  for (size_t t = 38; t < ids.size(); ++t) m.decode(ids[t], cache, &rec);
  ASSERT_EQ(rec.probs.size(), 3u);
  ASSERT_EQ(rec.q.size(), 6u);

  const torch::Tensor q_pre = torch::cat(rec.q, 0), k_pre = torch::cat(rec.k, 0);
  const int64_t T = int64_t(ids.size());
  ASSERT_EQ(q_pre.sizes(), (std::vector<int64_t>{T, hq, d}));
  ASSERT_EQ(k_pre.sizes(), (std::vector<int64_t>{T, hkv, d}));
  EXPECT_LT(max_abs_diff(torch::cat(rec.v, 0), cache.values(2)), 1e-6);

  const std::vector<float> inv = rope_inv_freq(s.rope, d);
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(t);
  torch::Tensor k_rot = k_pre.contiguous().clone(), q_rot = q_pre.contiguous().clone();
  kernels::rope_cpu(k_rot.data_ptr<float>(), int(T), hkv, d, pos.data(), inv.data(), false);
  kernels::rope_cpu(q_rot.data_ptr<float>(), int(T), hq, d, pos.data(), inv.data(), false);
  EXPECT_LT(max_abs_diff(k_rot, cache.keys(2)), 1e-4);

  for (int step = 0; step < 3; ++step) {
    const int64_t t = 38 + step, S = t + 1;
    const torch::Tensor p = rec.probs[size_t(step)];
    ASSERT_EQ(p.sizes(), (std::vector<int64_t>{hq, S}));
    EXPECT_EQ(p.scalar_type(), torch::kFloat32);
    EXPECT_LT(max_abs_diff(p.sum(-1), torch::ones({hq})), 1e-5);
    for (int h = 0; h < hq; ++h) {
      const torch::Tensor keys = k_rot.narrow(0, 0, S).select(1, h / g);  // [S, d]
      const torch::Tensor want = torch::softmax(torch::matmul(keys, q_rot[t][h]) * s.scale(), -1);
      EXPECT_LT(max_abs_diff(p[h], want), 1e-5) << "step " << step << " head " << h;
    }
  }
}

// ------------------------------------------------------------------ sanity and errors

TEST(Llama, BitsPerByteOnValidationText) {
  // The README reports 1.035 bits per byte for positions 0-8191; an interleaved-RoPE bug
  // gives about 6. 2 KB is enough to tell them apart.
  const auto ids = val_tokens(2048);
  const double bpb = bits_per_byte(tiny_fp32(), ids);
  std::printf("kvs-tiny-a fp32: %.4f bits per byte on 2048 validation bytes\n", bpb);
  RecordProperty("bits_per_byte", std::to_string(bpb));
  EXPECT_LT(bpb, 1.5);
  EXPECT_GT(bpb, 0.3);  // far below the README's figure would mean the text leaked into scoring
}

TEST(Llama, Bf16RunnerTracksFp32) {
  const auto ids = val_tokens(512);
  const double a = bits_per_byte(tiny_fp32(), ids), b = bits_per_byte(tiny_bf16(), ids);
  std::printf("bits per byte on 512 bytes: fp32 %.4f, bf16 %.4f\n", a, b);
  EXPECT_LT(std::abs(a - b), 0.02);
  KvCache cache = tiny_bf16().new_cache();
  tiny_bf16().prefill(ids, cache);
  EXPECT_EQ(cache.keys(0).scalar_type(), torch::kBFloat16);
}

TEST(Llama, RejectsBadInputs) {
  const LlamaModel& m = tiny_fp32();
  KvCache cache = m.new_cache();
  try {
    m.prefill({2, 65, 300}, cache);
    ADD_FAILURE() << "id 300 accepted by a 256-token vocabulary";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("300"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.size(), 0) << "a refused call must not advance the cache";
  KvCache foreign;  // not made by new_cache()
  EXPECT_THROW(m.decode(2, foreign), std::invalid_argument);
  PrefillOptions zero;
  zero.chunk = 0;
  EXPECT_THROW(m.prefill({2}, cache, zero), std::invalid_argument);
  EXPECT_THROW(LlamaModel::load(testing::tiny_model_dir(), torch::kCPU, torch::kFloat16),
               std::invalid_argument);
  EXPECT_THROW(LlamaModel::load("/nonexistent-model", torch::kCPU, torch::kFloat32),
               std::runtime_error);
}

}  // namespace
}  // namespace kvs
