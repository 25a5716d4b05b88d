// The attention-relevant shape of a Llama-family model, its RoPE, and its fingerprint.
//
// Capture files carry it as root attributes and bundles carry it with a fingerprint, so
// that the runtime can refuse a bundle made for another model. RoPE frequencies are
// computed here and only here (rope_inv_freq); kernels take the resulting array.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvs {

enum class RopeType { Default, Linear, Llama3 };

struct RopeParams {
  double theta = 10000.0;             ///< rope_theta
  RopeType type = RopeType::Default;  ///< rope_type / rope_scaling.type
  double factor = 1.0;                ///< linear and llama3 scaling factor
  double low_freq_factor = 1.0;       ///< llama3
  double high_freq_factor = 4.0;      ///< llama3
  int original_max_position = 8192;   ///< llama3 original_max_position_embeddings
};

const char* to_string(RopeType type);
RopeType rope_type_from_string(const std::string& name);  // throws on an unknown name

struct ModelShape {
  std::string name;           ///< informational (e.g. the model folder's name)
  int num_layers = 0;
  int num_q_heads = 0;        ///< Hq
  int num_kv_heads = 0;       ///< Hkv; Hq % Hkv == 0
  int head_dim = 0;
  int max_position = 0;       ///< max_position_embeddings
  RopeParams rope;
  double softmax_scale = 0.0; ///< 0 means 1/sqrt(head_dim)
  std::string weights_hash;   ///< hash of the model's weights, "" when unknown

  int group_size() const { return num_q_heads / num_kv_heads; }
  double scale() const;

  // Throws std::invalid_argument naming the first field that is out of range.
  void validate() const;

  // Canonical one-line text of every field that changes attention (not `name`), and its
  // 64-bit FNV-1a hash in hex. Two shapes are the same model iff fingerprints match.
  std::string canonical() const;
  std::string fingerprint() const;

  // The fields that differ, as "field: this vs other" lines; empty when equal.
  std::string diff(const ModelShape& other) const;
};

// 64-bit FNV-1a over bytes, continuing from `h`: the one hash of the project (fingerprints,
// weights hashes). Not cryptographic: it tells models apart, it does not authenticate them.
constexpr uint64_t kHashSeed = 1469598103934665603ull;
uint64_t hash64(const void* data, size_t bytes, uint64_t h = kHashSeed);
std::string hash_hex(uint64_t h);  // 16 lowercase hex digits

// head_dim/2 inverse frequencies after scaling, fp32, as transformers computes them.
std::vector<float> rope_inv_freq(const RopeParams& rope, int head_dim);

}  // namespace kvs
