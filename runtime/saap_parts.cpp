#include "runtime/saap_parts.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvs {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

}  // namespace

int SaapParts::layer_slot(int layer) const {
  const auto it = std::find(layers.begin(), layers.end(), layer);
  return it == layers.end() ? -1 : int(it - layers.begin());
}

void SaapParts::allocate() {
  const size_t C = size_t(num_clusters), H = size_t(hidden_dim), d = size_t(head_dim);
  const size_t hq = size_t(num_q_heads), hkv = size_t(num_kv_heads);
  per_layer.assign(layers.size(), SaapLayerParts{});
  for (SaapLayerParts& p : per_layer) {
    p.centroids.assign(hkv * C * d, 0.f);
    p.w1.assign(hq * H * d, 0.f);
    p.b1.assign(hq * H, 0.f);
    p.bn_mean.assign(hq * H, 0.f);
    p.bn_var.assign(hq * H, 1.f);
    p.bn_weight.assign(hq * H, 1.f);
    p.bn_bias.assign(hq * H, 0.f);
    p.w2.assign(hq * C * H, 0.f);
    p.b2.assign(hq * C, 0.f);
  }
}

void SaapParts::validate(const ModelShape* shape) const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("saap parts: " + what);
  };
  need(num_clusters >= 1, "num_clusters must be >= 1, got " + str(num_clusters));
  need(hidden_dim >= 8 && hidden_dim % 8 == 0,
       "hidden_dim must be a positive multiple of 8, got " + str(hidden_dim));
  need(head_dim >= 2 && head_dim % 2 == 0, "head_dim must be even and >= 2, got " + str(head_dim));
  need(num_kv_heads >= 1 && num_q_heads >= num_kv_heads && num_q_heads % num_kv_heads == 0,
       "num_q_heads " + str(num_q_heads) + " must be a positive multiple of num_kv_heads " +
           str(num_kv_heads));
  need(bn_eps > 0.0, "bn_eps must be > 0");
  need(probes >= 1 && probes <= num_clusters,
       "probes " + str(probes) + " outside [1, num_clusters = " + str(num_clusters) + "]");
  need(sink_tokens >= 0 && recent_tokens >= 1,
       "sink_tokens must be >= 0 and recent_tokens >= 1, got " + str(sink_tokens) + " and " +
           str(recent_tokens));
  if (shape) {
    need(num_q_heads == shape->num_q_heads,
         "num_q_heads " + str(num_q_heads) + ", the model has " + str(shape->num_q_heads));
    need(num_kv_heads == shape->num_kv_heads,
         "num_kv_heads " + str(num_kv_heads) + ", the model has " + str(shape->num_kv_heads));
    need(head_dim == shape->head_dim,
         "head_dim " + str(head_dim) + ", the model has " + str(shape->head_dim));
  }
  need(per_layer.size() == layers.size(), "per_layer has " + str(int64_t(per_layer.size())) +
                                              " entries for " + str(int64_t(layers.size())) +
                                              " layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const int l = layers[i];
    need(i == 0 || layers[i - 1] < l, "layers must be ascending and distinct");
    need(l >= 0 && (!shape || l < shape->num_layers), "layer " + str(l) + " outside the model's " +
                                                          (shape ? str(shape->num_layers) : "?") +
                                                          " layers");
    need(std::find(dense_layers.begin(), dense_layers.end(), l) == dense_layers.end(),
         "layer " + str(l) + " is both indexed and in dense_layers");
    const SaapLayerParts& p = per_layer[i];
    const size_t C = size_t(num_clusters), H = size_t(hidden_dim), d = size_t(head_dim);
    const size_t hq = size_t(num_q_heads), hkv = size_t(num_kv_heads);
    auto size_is = [&](const std::vector<float>& v, size_t n, const char* name) {
      need(v.size() == n, "layer " + str(l) + " " + name + " has " + str(int64_t(v.size())) +
                              " values, expected " + str(int64_t(n)));
    };
    size_is(p.centroids, hkv * C * d, "centroids");
    size_is(p.w1, hq * H * d, "w1");
    size_is(p.b1, hq * H, "b1");
    size_is(p.bn_mean, hq * H, "bn_mean");
    size_is(p.bn_var, hq * H, "bn_var");
    size_is(p.bn_weight, hq * H, "bn_weight");
    size_is(p.bn_bias, hq * H, "bn_bias");
    size_is(p.w2, hq * C * H, "w2");
    size_is(p.b2, hq * C, "b2");
    for (float v : p.bn_var)
      need(v >= 0.f && std::isfinite(v),
           "layer " + str(l) + " bn_var has a negative or non-finite value");
  }
}

namespace {

// Concatenates one array of every layer: [n, ...].
std::vector<float> stack(const SaapParts& p, std::vector<float> SaapLayerParts::*field) {
  std::vector<float> out;
  for (const SaapLayerParts& l : p.per_layer)
    out.insert(out.end(), (l.*field).begin(), (l.*field).end());
  return out;
}

}  // namespace

void write_saap_parts(const h5::Group& g, const SaapParts& p) {
  p.validate();
  g.set_attr_int("num_clusters", p.num_clusters);
  g.set_attr_int("hidden_dim", p.hidden_dim);
  g.set_attr_int("head_dim", p.head_dim);
  g.set_attr_int("num_q_heads", p.num_q_heads);
  g.set_attr_int("num_kv_heads", p.num_kv_heads);
  g.set_attr_double("bn_eps", p.bn_eps);
  g.set_attr_int("spherical", p.spherical ? 1 : 0);
  g.set_attr_string("query_model", "per_query_head");
  g.set_attr_int("probes", p.probes);
  g.set_attr_int("sink_tokens", p.sink_tokens);
  g.set_attr_int("recent_tokens", p.recent_tokens);
  g.set_attr_ints("dense_layers",
                  std::vector<int64_t>(p.dense_layers.begin(), p.dense_layers.end()));
  const int64_t n = int64_t(p.layers.size());
  const int64_t C = p.num_clusters, H = p.hidden_dim, d = p.head_dim;
  const int64_t hq = p.num_q_heads, hkv = p.num_kv_heads;
  std::vector<int32_t> layers(p.layers.begin(), p.layers.end());
  h5::write_dataset(g, "layers", layers, {n});
  h5::write_dataset(g, "centroids", stack(p, &SaapLayerParts::centroids), {n, hkv, C, d});
  h5::write_dataset(g, "w1", stack(p, &SaapLayerParts::w1), {n, hq, H, d});
  h5::write_dataset(g, "b1", stack(p, &SaapLayerParts::b1), {n, hq, H});
  h5::write_dataset(g, "bn_mean", stack(p, &SaapLayerParts::bn_mean), {n, hq, H});
  h5::write_dataset(g, "bn_var", stack(p, &SaapLayerParts::bn_var), {n, hq, H});
  h5::write_dataset(g, "bn_weight", stack(p, &SaapLayerParts::bn_weight), {n, hq, H});
  h5::write_dataset(g, "bn_bias", stack(p, &SaapLayerParts::bn_bias), {n, hq, H});
  h5::write_dataset(g, "w2", stack(p, &SaapLayerParts::w2), {n, hq, C, H});
  h5::write_dataset(g, "b2", stack(p, &SaapLayerParts::b2), {n, hq, C});
}

SaapParts read_saap_parts(const h5::Group& g, const ModelShape& shape) {
  SaapParts p;
  const std::string where = g.describe();
  try {
    p.num_clusters = int(g.attr_int("num_clusters"));
    p.hidden_dim = int(g.attr_int("hidden_dim"));
    p.head_dim = int(g.attr_int("head_dim"));
    p.num_q_heads = int(g.attr_int("num_q_heads"));
    p.num_kv_heads = int(g.attr_int("num_kv_heads"));
    p.bn_eps = g.attr_double("bn_eps");
    p.spherical = g.attr_int("spherical") != 0;
    const std::string model = g.attr_string("query_model");
    if (model != "per_query_head")
      throw std::invalid_argument("query_model '" + model + "', this build reads 'per_query_head'");
    p.probes = int(g.attr_int("probes"));
    p.sink_tokens = int(g.attr_int("sink_tokens"));
    p.recent_tokens = int(g.attr_int("recent_tokens"));
    p.dense_layers.clear();
    for (int64_t l : g.attr_ints("dense_layers")) p.dense_layers.push_back(int(l));
    // The attributes must fit the model before they are used to check array shapes.
    SaapParts head_check = p;
    head_check.validate(&shape);
    const int64_t C = p.num_clusters, H = p.hidden_dim, d = p.head_dim;
    const int64_t hq = p.num_q_heads, hkv = p.num_kv_heads;
    const std::vector<int32_t> layers =
        h5::open_dataset(g, "layers", h5::DType::I32, {-1}).read<int32_t>();
    const int64_t n = int64_t(layers.size());
    p.layers.assign(layers.begin(), layers.end());
    p.per_layer.assign(size_t(n), SaapLayerParts{});
    auto read = [&](const char* name, const h5::Shape& s,
                    std::vector<float> SaapLayerParts::*field) {
      const std::vector<float> all = h5::open_dataset(g, name, h5::DType::F32, s).read<float>();
      const size_t per = all.size() / size_t(std::max<int64_t>(n, 1));
      for (int64_t i = 0; i < n; ++i)
        (p.per_layer[size_t(i)].*field).assign(all.begin() + i * per, all.begin() + (i + 1) * per);
    };
    read("centroids", {n, hkv, C, d}, &SaapLayerParts::centroids);
    read("w1", {n, hq, H, d}, &SaapLayerParts::w1);
    read("b1", {n, hq, H}, &SaapLayerParts::b1);
    read("bn_mean", {n, hq, H}, &SaapLayerParts::bn_mean);
    read("bn_var", {n, hq, H}, &SaapLayerParts::bn_var);
    read("bn_weight", {n, hq, H}, &SaapLayerParts::bn_weight);
    read("bn_bias", {n, hq, H}, &SaapLayerParts::bn_bias);
    read("w2", {n, hq, C, H}, &SaapLayerParts::w2);
    read("b2", {n, hq, C}, &SaapLayerParts::b2);
    p.validate(&shape);
  } catch (const h5::Error& e) {
    throw std::invalid_argument(std::string(e.what()) + " (saap parts " + where + ")");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + ": " + e.what());
  }
  return p;
}

FoldedMlp fold_batch_norm(const SaapParts& p, int slot) {
  if (slot < 0 || slot >= int(p.per_layer.size()))
    throw std::out_of_range("fold_batch_norm: slot " + str(slot) + " outside [0, " +
                            str(int64_t(p.per_layer.size())) + ")");
  const SaapLayerParts& l = p.per_layer[size_t(slot)];
  const size_t H = size_t(p.hidden_dim), d = size_t(p.head_dim), hq = size_t(p.num_q_heads);
  FoldedMlp f;
  f.w1.resize(l.w1.size());
  f.b1.resize(l.b1.size());
  for (size_t h = 0; h < hq; ++h)
    for (size_t j = 0; j < H; ++j) {
      const size_t r = h * H + j;
      const double s = double(l.bn_weight[r]) / std::sqrt(double(l.bn_var[r]) + p.bn_eps);
      for (size_t k = 0; k < d; ++k) f.w1[r * d + k] = float(s * l.w1[r * d + k]);
      f.b1[r] = float(s * (double(l.b1[r]) - l.bn_mean[r]) + l.bn_bias[r]);
    }
  f.w2 = l.w2;
  f.b2 = l.b2;
  return f;
}

}  // namespace kvs
