#include "artifacts/model_io.h"

#include <climits>
#include <stdexcept>

namespace kvs {
namespace {

const char* const kIntFields[] = {"num_layers", "num_q_heads",  "num_kv_heads",
                                  "head_dim",   "max_position", "rope_original_max_position"};
const char* const kDoubleFields[] = {"rope_theta", "rope_factor", "rope_low_freq_factor",
                                     "rope_high_freq_factor", "softmax_scale"};
const char* const kStringFields[] = {"model_name", "rope_type", "weights_hash"};

int read_int(const h5::Group& g, const char* name) {
  const int64_t v = g.attr_int(name);
  if (v < INT_MIN || v > INT_MAX)
    throw h5::Error(g.describe() + ": attribute '" + name + "' = " + std::to_string(v) +
                    " does not fit an int");
  return int(v);
}

}  // namespace

void write_model_shape(const h5::Group& g, const ModelShape& s) {
  try {
    s.validate();
  } catch (const std::invalid_argument& e) {
    throw h5::Error(g.describe() + ": refusing to write an invalid " + e.what());
  }
  g.set_attr_string("model_name", s.name);
  g.set_attr_int("num_layers", s.num_layers);
  g.set_attr_int("num_q_heads", s.num_q_heads);
  g.set_attr_int("num_kv_heads", s.num_kv_heads);
  g.set_attr_int("head_dim", s.head_dim);
  g.set_attr_int("max_position", s.max_position);
  g.set_attr_string("rope_type", to_string(s.rope.type));
  g.set_attr_double("rope_theta", s.rope.theta);
  g.set_attr_double("rope_factor", s.rope.factor);
  g.set_attr_double("rope_low_freq_factor", s.rope.low_freq_factor);
  g.set_attr_double("rope_high_freq_factor", s.rope.high_freq_factor);
  g.set_attr_int("rope_original_max_position", s.rope.original_max_position);
  g.set_attr_double("softmax_scale", s.softmax_scale);
  g.set_attr_string("weights_hash", s.weights_hash);
}

ModelShape read_model_shape(const h5::Group& g) {
  // All missing names in one message: a file from another tool usually lacks several.
  std::string missing;
  auto need = [&](const char* name) {
    if (!g.has_attr(name)) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  for (const char* n : kIntFields) need(n);
  for (const char* n : kDoubleFields) need(n);
  for (const char* n : kStringFields) need(n);
  if (!missing.empty())
    throw h5::Error(g.describe() + ": missing model shape attributes: " + missing);

  ModelShape s;
  s.name = g.attr_string("model_name");
  s.num_layers = read_int(g, "num_layers");
  s.num_q_heads = read_int(g, "num_q_heads");
  s.num_kv_heads = read_int(g, "num_kv_heads");
  s.head_dim = read_int(g, "head_dim");
  s.max_position = read_int(g, "max_position");
  try {
    s.rope.type = rope_type_from_string(g.attr_string("rope_type"));
  } catch (const std::invalid_argument& e) {
    throw h5::Error(g.describe() + ": attribute 'rope_type': " + e.what());
  }
  s.rope.theta = g.attr_double("rope_theta");
  s.rope.factor = g.attr_double("rope_factor");
  s.rope.low_freq_factor = g.attr_double("rope_low_freq_factor");
  s.rope.high_freq_factor = g.attr_double("rope_high_freq_factor");
  s.rope.original_max_position = read_int(g, "rope_original_max_position");
  s.softmax_scale = g.attr_double("softmax_scale");
  s.weights_hash = g.attr_string("weights_hash");
  try {
    s.validate();
  } catch (const std::invalid_argument& e) {
    throw h5::Error(g.describe() + ": invalid " + e.what());
  }
  return s;
}

}  // namespace kvs
