#include "capture/tokens.h"

#include <cctype>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kvs {

bool is_byte_level(const HfConfig& cfg) { return cfg.vocab_size == 256; }

std::vector<int32_t> byte_tokens(const HfConfig& cfg, const std::string& text) {
  if (!is_byte_level(cfg))
    throw std::invalid_argument(
        "model '" + cfg.shape.name + "' has vocab_size " + std::to_string(cfg.vocab_size) +
        ", not a 256-token byte vocabulary: pass pre-tokenized ids instead of text");
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (cfg.bos_token_id >= 0) ids.push_back(cfg.bos_token_id);
  for (unsigned char c : text) ids.push_back(int32_t(c));
  return ids;
}

std::vector<int32_t> parse_token_ids(const std::string& text, int vocab_size,
                                     const std::string& source) {
  std::vector<int32_t> ids;
  size_t line = 1, i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (std::isspace(c)) {
      if (c == '\n') ++line;
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
    const std::string word = text.substr(i, j - i);
    auto where = [&] {
      return "token ids '" + source + "' line " + std::to_string(line) + ", token " +
             std::to_string(ids.size()) + " ('" + word + "'): ";
    };
    bool digits = word.size() <= 10;
    for (char d : word) digits = digits && d >= '0' && d <= '9';
    if (!digits) throw std::invalid_argument(where() + "not a non-negative integer");
    const long long id = std::stoll(word);
    if (id >= vocab_size)
      throw std::invalid_argument(where() + "id >= vocab_size " + std::to_string(vocab_size));
    ids.push_back(int32_t(id));
    i = j;
  }
  if (ids.empty()) throw std::invalid_argument("token ids '" + source + "': no ids");
  return ids;
}

std::vector<int32_t> load_token_ids(const std::string& path, int vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("token ids '" + path + "': cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_token_ids(text.str(), vocab_size, path);
}

}  // namespace kvs
