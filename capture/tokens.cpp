#include "capture/tokens.h"

#include "artifacts/h5.h"

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

std::vector<int32_t> load_token_ids_h5(const std::string& path, const std::string& dataset,
                                       int vocab_size) {
  const h5::File f = h5::File::open_read(path);
  const h5::Dataset ds = f.root().open_dataset(dataset);
  const std::string where = ds.describe();
  if (ds.rank() != 1)
    throw std::invalid_argument(where + ": token ids must be a 1-D dataset, got shape " +
                                h5::to_string(ds.shape()));
  const h5::DType t = ds.dtype();
  if (t != h5::DType::I32 && t != h5::DType::I64)
    throw std::invalid_argument(where + ": token ids must be int32 or int64, got " +
                                h5::to_string(t));
  const std::vector<int64_t> ids = ds.read<int64_t>();
  std::vector<int32_t> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size)
      throw std::invalid_argument(where + ": id " + std::to_string(ids[i]) + " at index " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab_size) + ")");
    out[i] = int32_t(ids[i]);
  }
  return out;
}

}  // namespace kvs
