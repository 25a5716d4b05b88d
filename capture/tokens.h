// Model input ids: raw bytes for a byte-level model, or pre-tokenized ids from a text file.
// No tokenizer library: a model with a real tokenizer is fed ids made elsewhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "capture/hf_config.h"

namespace kvs {

// A byte-level model has a 256-token vocabulary where id = byte value (kvs-tiny-a).
bool is_byte_level(const HfConfig& cfg);

// BOS (when the config has one) followed by the bytes of `text`. Throws std::invalid_argument
// when the model is not byte-level.
std::vector<int32_t> byte_tokens(const HfConfig& cfg, const std::string& text);

// Whitespace-separated decimal ids, used as they are (include BOS in the file if the model
// wants it). Throws naming `source`, the line and the token for a non-integer, a negative id
// or an id >= vocab_size.
std::vector<int32_t> parse_token_ids(const std::string& text, int vocab_size,
                                     const std::string& source);
std::vector<int32_t> load_token_ids(const std::string& path, int vocab_size);

// Ids from a 1-D integer dataset of an HDF5 file (int32 or int64, e.g. what h5py writes from
// a tokenizer's output). Throws naming the file, the dataset and the first bad id.
std::vector<int32_t> load_token_ids_h5(const std::string& path, const std::string& dataset,
                                       int vocab_size);

}  // namespace kvs
