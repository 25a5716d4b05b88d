#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "capture/hf_config.h"
#include "capture/tokens.h"
#include "tests/torch/test_util.h"

namespace kvs {
namespace {

// Meta-Llama-3.1-8B's config.json as published (transformers 4.43 spelling).
const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Replaces the first occurrence of `from` in kLlama31 by `to`.
std::string llama31_with(const std::string& from, const std::string& to) {
  std::string s = kLlama31;
  const auto at = s.find(from);
  if (at == std::string::npos) throw std::logic_error("'" + from + "' not in the config");
  return s.replace(at, from.size(), to);
}

void expect_config_error(const std::string& json, const std::vector<std::string>& needles) {
  try {
    parse_hf_config(json, "test/config.json");
    ADD_FAILURE() << "accepted a config it should refuse";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("test/config.json"), std::string::npos) << msg;
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

TEST(HfConfig, TinyModel) {
  const HfConfig c = load_hf_config(testing::tiny_model_dir());
  EXPECT_EQ(c.shape.name, "kvs-tiny-a");
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.shape.num_layers, 4);
  EXPECT_EQ(c.shape.num_q_heads, 8);
  EXPECT_EQ(c.shape.num_kv_heads, 2);
  EXPECT_EQ(c.shape.head_dim, 128);
  EXPECT_EQ(c.shape.max_position, 32768);
  EXPECT_EQ(c.shape.rope.theta, 500000.0);
  EXPECT_EQ(c.shape.rope.type, RopeType::Default);
  EXPECT_EQ(c.shape.softmax_scale, 0.0);
  EXPECT_EQ(c.hidden_size, 512);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 2);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{3});
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_TRUE(is_byte_level(c));
}

TEST(HfConfig, Llama31WithRopeScaling) {
  const HfConfig c = parse_hf_config(kLlama31, "test/config.json");
  EXPECT_EQ(c.shape.num_layers, 32);
  EXPECT_EQ(c.shape.num_q_heads, 32);
  EXPECT_EQ(c.shape.num_kv_heads, 8);
  EXPECT_EQ(c.shape.head_dim, 128);  // absent: hidden_size / num_attention_heads
  EXPECT_EQ(c.shape.max_position, 131072);
  EXPECT_EQ(c.shape.rope.type, RopeType::Llama3);
  EXPECT_EQ(c.shape.rope.theta, 500000.0);
  EXPECT_EQ(c.shape.rope.factor, 8.0);
  EXPECT_EQ(c.shape.rope.low_freq_factor, 1.0);
  EXPECT_EQ(c.shape.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.shape.rope.original_max_position, 8192);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_FALSE(is_byte_level(c));
}

TEST(HfConfig, RopeParametersSpellingAndOldTypeKey) {
  // transformers 5 nests everything in rope_parameters.
  const std::string v5 =
      llama31_with(R"("rope_scaling": {)", R"("rope_parameters": {"rope_theta": 500000.0,)");
  const HfConfig a = parse_hf_config(v5, "test/config.json");
  const HfConfig b = parse_hf_config(kLlama31, "test/config.json");
  EXPECT_EQ(a.shape.fingerprint(), b.shape.fingerprint());

  // Pre-4.45 configs say "type" instead of "rope_type".
  const HfConfig lin =
      parse_hf_config(llama31_with(R"("rope_scaling": {)",
                                   R"("rope_scaling": {"type": "linear", "factor": 2.0}, "x": {)"),
                      "test/config.json");
  EXPECT_EQ(lin.shape.rope.type, RopeType::Linear);
  EXPECT_EQ(lin.shape.rope.factor, 2.0);

  // head_dim given explicitly wins over hidden_size / heads.
  const HfConfig hd = parse_hf_config(
      llama31_with(R"("hidden_size": 4096)", R"("hidden_size": 4096, "head_dim": 64)"),
      "test/config.json");
  EXPECT_EQ(hd.shape.head_dim, 64);
}

TEST(HfConfig, RejectsOtherArchitectures) {
  expect_config_error(llama31_with("LlamaForCausalLM", "Qwen2ForCausalLM"),
                      {"unsupported architecture 'Qwen2ForCausalLM'"});
  expect_config_error(llama31_with(R"("model_type": "llama")", R"("model_type": "gemma")"),
                      {"model_type 'gemma'"});
  expect_config_error(llama31_with(R"("attention_bias": false)", R"("attention_bias": true)"),
                      {"attention_bias"});
  expect_config_error(llama31_with(R"("hidden_act": "silu")", R"("hidden_act": "gelu")"),
                      {"hidden_act 'gelu'"});
}

TEST(HfConfig, MistralOnlyWithoutSlidingWindow) {
  std::string m = llama31_with("LlamaForCausalLM", "MistralForCausalLM");
  m.replace(m.find(R"("model_type": "llama")"), 21, R"("model_type": "mistral")");
  const std::string windowed =
      m.substr(0, m.find(R"("vocab_size")")) + R"("sliding_window": 4096, "vocab_size": 128256})";
  expect_config_error(windowed, {"sliding_window 4096"});
  const std::string full =
      m.substr(0, m.find(R"("vocab_size")")) + R"("sliding_window": null, "vocab_size": 128256})";
  EXPECT_EQ(parse_hf_config(full, "test/config.json").architecture, "MistralForCausalLM");
}

TEST(HfConfig, RejectsUnsupportedRope) {
  expect_config_error(llama31_with(R"("rope_type": "llama3")", R"("rope_type": "yarn")"),
                      {"rope_scaling", "'yarn'"});
  expect_config_error(llama31_with(R"("low_freq_factor": 1.0,)", ""),
                      {"rope_scaling", "low_freq_factor"});
  expect_config_error(
      llama31_with(R"("rope_theta": 500000.0)",
                   R"("rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0})"),
      {"disagree"});
}

TEST(HfConfig, RejectsMissingAndMalformedFields) {
  expect_config_error(llama31_with(R"("num_hidden_layers": 32,)", ""),
                      {"missing 'num_hidden_layers'"});
  expect_config_error(llama31_with(R"("num_key_value_heads": 8)", R"("num_key_value_heads": 5)"),
                      {"num_kv_heads"});
  expect_config_error(llama31_with(R"("hidden_size": 4096)", R"("hidden_size": "big")"),
                      {"'hidden_size'", "'big'"});
  expect_config_error("{ not json", {"invalid JSON"});
}

TEST(Tokens, ByteTokensAndIdFiles) {
  HfConfig c;
  c.vocab_size = 256;
  c.bos_token_id = 2;
  EXPECT_EQ(byte_tokens(c, "A\xff"), (std::vector<int32_t>{2, 65, 255}));
  c.vocab_size = 32000;
  EXPECT_THROW(byte_tokens(c, "A"), std::invalid_argument);

  EXPECT_EQ(parse_token_ids(" 1 2\n\t30\n", 256, "ids.txt"), (std::vector<int32_t>{1, 2, 30}));
  auto expect_error = [](const std::string& text, const std::string& needle) {
    try {
      parse_token_ids(text, 256, "ids.txt");
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("ids.txt"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  expect_error("1 2\n3 x4", "line 2, token 3 ('x4')");
  expect_error("1 -2", "'-2'");
  expect_error("1 256", "vocab_size 256");
  expect_error("1 2.5", "'2.5'");
  expect_error("  \n", "no ids");

  testing::TempDir dir;
  testing::write_file(dir.file("ids.txt"), "2 72 105\n");
  EXPECT_EQ(load_token_ids(dir.file("ids.txt"), 256), (std::vector<int32_t>{2, 72, 105}));
  EXPECT_THROW(load_token_ids(dir.file("none.txt"), 256), std::runtime_error);
}

}  // namespace
}  // namespace kvs

namespace kvs {
namespace {

TEST(Tokens, IdsFromAnHdf5Dataset) {
  kvs::testing::TempDir dir;
  const std::string path = dir.file("ids.h5");
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "input_ids", std::vector<int64_t>{2, 72, 105, 255}, {4});
    h5::write_dataset(w.root(), "bad", std::vector<int32_t>{1, 256}, {2});
    h5::write_dataset(w.root(), "matrix", std::vector<int32_t>{1, 2, 3, 4}, {2, 2});
    h5::write_dataset(w.root(), "floats", std::vector<float>{1.f}, {1});
    w.commit();
  }
  EXPECT_EQ(load_token_ids_h5(path, "input_ids", 256), (std::vector<int32_t>{2, 72, 105, 255}));
  auto message = [&](const std::string& ds) {
    try {
      load_token_ids_h5(path, ds, 256);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("bad").find("id 256 at index 1 is outside the vocabulary"), std::string::npos);
  EXPECT_NE(message("matrix").find("1-D"), std::string::npos);
  EXPECT_NE(message("floats").find("int32 or int64"), std::string::npos);
  EXPECT_NE(message("missing").find("missing"), std::string::npos);
}

}  // namespace
}  // namespace kvs
