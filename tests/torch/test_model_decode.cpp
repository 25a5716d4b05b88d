// The runtime's engines inside the runner's decode loop (capture/engine_attention.h) and the
// model-level evaluation built on it (capture/model_eval.h), on the real kvs-tiny-a weights
// (CPU reference engines): the dense engine reproduces the runner's own attention, an exact
// setting of a sparse method reproduces dense, engines that want prompt queries get them,
// misuse is refused with a message that says what was wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "capture/engine_attention.h"
#include "capture/model_eval.h"
#include "capture/tokens.h"
#include "tests/torch/test_util.h"

namespace kvs {
namespace {

const LlamaModel& model() {
  static const LlamaModel m =
      LlamaModel::load(testing::tiny_model_dir(), torch::kCPU, torch::kFloat32);
  return m;
}

std::vector<int32_t> val_tokens(size_t bytes, size_t skip = 0) {
  const std::string text = testing::validation_text(skip + bytes);
  return byte_tokens(model().config(), text.substr(skip));
}

torch::Tensor log_probs(const torch::Tensor& logits) {
  return torch::log_softmax(logits.to(torch::kFloat64), -1);
}

// Logits of `steps` teacher-forced decode steps after a prefill of ids[0, prompt), with the
// runner's own attention (method "") or with an engine on the model's device.
std::vector<torch::Tensor> decode_logits(const std::vector<int32_t>& ids, int prompt, int steps,
                                         const std::string& method,
                                         const LlamaModel& m = model()) {
  KvCache cache = m.new_cache(prompt + steps);
  PromptQueryRecorder queries(m.shape().num_layers, prompt, 512);
  PrefillOptions opts;
  opts.logits = LogitsMode::None;
  m.prefill(std::vector<int32_t>(ids.begin(), ids.begin() + prompt), cache, opts, &queries);
  std::unique_ptr<EngineAttention> ea;
  if (!method.empty()) {
    ea = std::make_unique<EngineAttention>(m, method, EngineConfig{}, nullptr, prompt + steps);
    ea->start(cache, &queries);
  }
  std::vector<torch::Tensor> out;
  for (int s = 0; s < steps; ++s) out.push_back(m.decode(ids[size_t(prompt + s)], cache, nullptr, ea.get()));
  return out;
}

double max_log_prob_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (log_probs(a[i]) - log_probs(b[i])).abs().max().item<double>());
  return worst;
}

// fn() must throw std::invalid_argument whose message contains `text`.
template <class F>
void expect_refused(F fn, const std::string& text, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << " was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(EngineAttention, DenseEngineReproducesTheRunnersAttention) {
  const std::vector<int32_t> ids = val_tokens(700);
  const auto runner = decode_logits(ids, 600, 8, "");
  const auto dense = decode_logits(ids, 600, 8, "dense");
  // The engine reads a bf16 copy of the fp32 cache: differences of that order, no more.
  const double diff = max_log_prob_diff(runner, dense);
  EXPECT_LT(diff, 0.05);
  EXPECT_GT(diff, 0.0);  // the engine really attended (bf16 rounding shows)
  for (size_t i = 0; i < runner.size(); ++i)
    EXPECT_EQ(runner[i].argmax().item<int64_t>(), dense[i].argmax().item<int64_t>()) << "step " << i;
}

TEST(EngineAttention, ExactSparseSettingsReproduceDense) {
  const std::vector<int32_t> ids = val_tokens(700);
  const auto dense = decode_logits(ids, 600, 6, "dense");
  // Tactic at P = 1 selects every cluster.
  EXPECT_LT(max_log_prob_diff(dense, decode_logits(ids, 600, 6, "tactic:target=1")), 1e-3);
  // MAC with an unreachable minimum context never reuses: every step is a miss (exact).
  EXPECT_LT(max_log_prob_diff(dense, decode_logits(ids, 600, 6, "mac:min_context=100000")), 1e-3);
}

TEST(EngineAttention, MacGetsThePromptQueriesAndReuses) {
  const LlamaModel& m = model();
  const std::vector<int32_t> ids = val_tokens(2600);
  const int prompt = 2500, steps = 16;
  KvCache cache = m.new_cache(prompt + steps);
  EngineAttention ea(m, "mac:min_context=1024", EngineConfig{}, nullptr, prompt + steps);
  ASSERT_GT(ea.prompt_queries_wanted(), 0);
  PromptQueryRecorder queries(m.shape().num_layers, prompt, ea.prompt_queries_wanted());
  PrefillOptions opts;
  opts.logits = LogitsMode::None;
  m.prefill(std::vector<int32_t>(ids.begin(), ids.begin() + prompt), cache, opts, &queries);
  ea.start(cache, &queries);
  for (int s = 0; s < steps; ++s) m.decode(ids[size_t(prompt + s)], cache, nullptr, &ea);
  const EngineStats st = ea.stats();
  EXPECT_EQ(st.decode_calls, uint64_t(steps * m.shape().num_layers));
  // Reuse means reading less than everything; the relative threshold makes some hits here.
  EXPECT_LT(st.kv_read_fraction(), 1.0);
  EXPECT_GT(st.kv_read_fraction(), 0.0);
}

TEST(EngineAttention, MisuseIsRefusedWithAReason) {
  const LlamaModel& m = model();
  const std::vector<int32_t> ids = val_tokens(300);
  KvCache cache = m.new_cache(300);
  PrefillOptions opts;
  opts.logits = LogitsMode::None;
  m.prefill(std::vector<int32_t>(ids.begin(), ids.begin() + 200), cache, opts);
  {
    EngineAttention ea(m, "dense", EngineConfig{}, nullptr, 300);
    EXPECT_THROW(m.decode(ids[200], cache, nullptr, &ea), std::logic_error);  // before start
  }
  cache.truncate(200);
  {
    EngineAttention ea(m, "dense", EngineConfig{}, nullptr, 150);
    expect_refused([&] { ea.start(cache, nullptr); }, "max_tokens is 150",
                   "a prompt longer than max_tokens");
  }
  {
    EngineAttention ea(m, "mac", EngineConfig{}, nullptr, 300);
    expect_refused([&] { ea.start(cache, nullptr); }, "PromptQueryRecorder",
                   "MAC without its prompt queries");
  }
  {
    EngineAttention ea(m, "dense", EngineConfig{}, nullptr, 300);
    ea.start(cache, nullptr);
    const torch::Tensor q = torch::zeros({m.shape().num_q_heads, m.shape().head_dim});
    const torch::Tensor k = torch::zeros({m.shape().num_kv_heads, m.shape().head_dim});
    expect_refused([&] { ea.attend(1, 200, q, q, k, k); }, "expected layer 0 of position 200",
                   "a step starting at layer 1");
  }
  EXPECT_THROW(EngineAttention(m, "nosuch", EngineConfig{}, nullptr, 300), std::invalid_argument);
  EXPECT_THROW(cache.truncate(201), std::out_of_range);
}

// The CUDA engines in a bf16 model on the GPU (skipped without one).
TEST(EngineAttentionCuda, EnginesOnTheGpuReproduceTheRunner) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  static const LlamaModel gpu =
      LlamaModel::load(testing::tiny_model_dir(), torch::kCUDA, torch::kBFloat16);
  const std::vector<int32_t> ids = val_tokens(2200);
  const auto runner = decode_logits(ids, 2100, 8, "", gpu);
  const auto dense = decode_logits(ids, 2100, 8, "dense", gpu);
  // bf16 activations: one bf16 step of a hidden state moves a logit by up to 1/8 here, so
  // the tolerance is a few such steps; the argmax must agree.
  auto same_argmax = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    int same = 0;
    for (size_t i = 0; i < a.size(); ++i) same += a[i].argmax().item<int64_t>() == b[i].argmax().item<int64_t>();
    return same;
  };
  EXPECT_LT(max_log_prob_diff(runner, dense), 0.5);
  EXPECT_GE(same_argmax(runner, dense), 7);
  for (const char* exact : {"tactic:target=1", "mac:min_context=100000"}) {
    const auto other = decode_logits(ids, 2100, 8, exact, gpu);
    EXPECT_LT(max_log_prob_diff(dense, other), 0.5) << exact;
    EXPECT_GE(same_argmax(dense, other), 7) << exact;
  }
  for (const char* method : {"magicpig", "mac:min_context=1024"}) {
    const auto sparse = decode_logits(ids, 2100, 8, method, gpu);
    for (const torch::Tensor& l : sparse) EXPECT_TRUE(torch::isfinite(l).all().item<bool>()) << method;
  }
}

TEST(ModelEval, PerplexityOfAnExactSettingEqualsDense) {
  std::vector<std::vector<int32_t>> windows{val_tokens(420), val_tokens(420, 5000)};
  PplConfig pc;
  pc.context = 400;
  pc.steps = 12;
  ModelEvalConfig mc;
  mc.methods = {"dense", "tactic:target=1", "tactic:target=0.5"};
  const std::vector<PplRow> rows = eval_perplexity(model(), windows, pc, mc);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].method, "dense");
  EXPECT_EQ(rows[0].tokens, 24);
  // A byte-level model on its own domain: about 1 bit per byte (README of the model: 1.035).
  EXPECT_GT(rows[0].bits_per_token, 0.3);
  EXPECT_LT(rows[0].bits_per_token, 3.0);
  EXPECT_DOUBLE_EQ(rows[0].delta_vs_dense, 0.0);
  EXPECT_NEAR(rows[0].kv_read_fraction, 1.0, 1e-12);
  EXPECT_NEAR(rows[1].bits_per_token, rows[0].bits_per_token, 1e-3);
  EXPECT_LT(rows[2].kv_read_fraction, 1.0);  // a real budget reads less
  for (const PplRow& r : rows) EXPECT_GT(r.tokens_per_second, 0.0);

  // Without a dense row there is nothing to compare with: the delta is unknown, not 0.
  mc.methods = {"tactic:target=1"};
  const std::vector<PplRow> alone = eval_perplexity(model(), windows, pc, mc);
  ASSERT_EQ(alone.size(), 1u);
  EXPECT_TRUE(std::isnan(alone[0].delta_vs_dense));
  std::ostringstream table, json;
  write_ppl_table(table, alone);
  write_ppl_json(json, alone, {});
  EXPECT_NE(json.str().find("\"delta_vs_dense\": null"), std::string::npos) << json.str();
  EXPECT_EQ(table.str().find("nan"), std::string::npos) << table.str();

  mc.methods = {"dense", "tactic:target=1", "tactic:target=0.5"};
  pc.steps = 30;  // 400 + 30 + 1 > 421 tokens
  expect_refused([&] { eval_perplexity(model(), windows, pc, mc); }, "window 0 has 421 tokens",
                 "a short window");
}

TEST(ModelEval, NeedlePromptPutsTheKeyOnItsOwnLineNearTheDepth) {
  const std::string hay = testing::validation_text(20000);
  for (double depth : {0.0, 0.5, 1.0}) {
    const NeedlePrompt p = make_needle_prompt(hay, 100, 3000, depth, 7);
    ASSERT_EQ(p.key.size(), 5u);
    EXPECT_EQ(p.prompt.size(), 3000u);
    const std::string line = "\nThe pass key is " + p.key + ".";
    const size_t at = p.prompt.find(line);
    ASSERT_NE(at, std::string::npos);
    EXPECT_NEAR(double(at) / 3000.0, depth, 0.08) << "depth " << depth;
    EXPECT_EQ(p.question.back(), ' ');
  }
  EXPECT_NE(make_needle_prompt(hay, 0, 3000, 0.5, 1).key, make_needle_prompt(hay, 0, 3000, 0.5, 2).key);
  EXPECT_THROW(make_needle_prompt(hay, 0, 3000, 1.5, 1), std::invalid_argument);
  EXPECT_THROW(make_needle_prompt(hay, 19000, 3000, 0.5, 1), std::invalid_argument);
  EXPECT_THROW(make_needle_prompt(hay, 0, 40, 0.5, 1), std::invalid_argument);
}

TEST(ModelEval, NeedleRunsEveryMethodOnTheSamePrompt) {
  NeedleConfig nc;
  nc.contexts = {1024};
  nc.depths = {0.5};
  nc.trials = 2;
  ModelEvalConfig mc;
  mc.methods = {"dense", "tactic:target=1"};
  const std::vector<NeedleRow> rows =
      eval_needle(model(), testing::validation_text(60000), nc, mc);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].trials, 2);
  // The exact setting answers exactly what dense answers.
  EXPECT_EQ(rows[0].correct, rows[1].correct);
  EXPECT_NEAR(rows[0].kv_read_fraction, 1.0, 1e-12);
}

}  // namespace
}  // namespace kvs
