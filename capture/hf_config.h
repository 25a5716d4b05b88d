// Hugging Face config.json -> the model shape kvsparse works with, plus what the runner needs.
//
// Only models whose attention is exactly Llama's are accepted (LlamaForCausalLM, and
// MistralForCausalLM without a sliding window): anything else would make the captured
// q/k/v and attention maps wrong in ways no later step could detect. Plain C++, no torch.
#pragma once

#include <string>
#include <vector>

#include "artifacts/model_shape.h"

namespace kvs {

struct HfConfig {
  ModelShape shape;          ///< attention shape + RoPE; name = the model folder's name
  std::string architecture;  ///< e.g. "LlamaForCausalLM"
  std::string model_type;    ///< e.g. "llama"
  int hidden_size = 0;
  int intermediate_size = 0;  ///< SwiGLU width
  int vocab_size = 0;
  double rms_norm_eps = 1e-6;  ///< transformers' LlamaConfig default
  bool tie_word_embeddings = false;
  int bos_token_id = -1;           ///< -1 when the config has none
  std::vector<int> eos_token_ids;  ///< empty when the config has none
  std::string torch_dtype;         ///< "bfloat16", "float16", "float32" or "" when absent
};

// Parses the text of a config.json; `source` (a path) is named in every error message.
// Throws std::invalid_argument for unsupported architectures, RoPE types or features.
HfConfig parse_hf_config(const std::string& json_text, const std::string& source);

// Reads `<folder>/config.json` (or `path` itself when it names a file).
HfConfig load_hf_config(const std::string& folder_or_file);

}  // namespace kvs
