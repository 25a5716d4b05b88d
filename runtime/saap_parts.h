// SAAP's stored parts: the layout of the saap group of a trained file (kvs-train saap) and of
// a bundle (kvs-indexbuild copies the group as it is). Written by the trainer, read and
// validated by the runtime; this file is the one definition of the layout.
//
//   /saap  attrs  num_clusters C, hidden_dim, head_dim, num_q_heads, num_kv_heads,
//                 bn_eps, spherical (0/1), query_model = "per_query_head",
//                 probes l, sink_tokens, recent_tokens, dense_layers (the knobs of training)
//          layers     int32 [n]                  indexed layers, ascending
//          centroids  float32 [n, Hkv, C, d]     k-means of pre-RoPE keys
//          w1         float32 [n, Hq, hidden, d] query MLP: Linear(d, hidden)
//          b1         float32 [n, Hq, hidden]
//          bn_mean, bn_var, bn_weight, bn_bias   float32 [n, Hq, hidden]  BatchNorm1d (eval)
//          w2         float32 [n, Hq, C, hidden] Linear(hidden, C)
//          b2         float32 [n, Hq, C]
// The MLP is Linear -> BatchNorm1d -> ReLU -> Linear -> softmax (spec 2.3), one per query head.
#pragma once

#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "artifacts/model_shape.h"

namespace kvs {

struct SaapLayerParts {
  std::vector<float> centroids;                            // [Hkv, C, d]
  std::vector<float> w1, b1;                               // [Hq, hidden, d], [Hq, hidden]
  std::vector<float> bn_mean, bn_var, bn_weight, bn_bias;  // [Hq, hidden]
  std::vector<float> w2, b2;                               // [Hq, C, hidden], [Hq, C]
};

struct SaapParts {
  int num_clusters = 1024;
  int hidden_dim = 1024;
  int head_dim = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  double bn_eps = 1e-5;
  bool spherical = true;
  // Knobs the parts were trained with (recorded; the runtime's are SaapConfig's).
  int probes = 32;
  int sink_tokens = 1;
  int recent_tokens = 2047;
  std::vector<int> dense_layers{0};
  std::vector<int> layers;                ///< indexed layers, ascending
  std::vector<SaapLayerParts> per_layer;  ///< parallel to layers

  // Position of `layer` in layers, -1 when it has no index.
  int layer_slot(int layer) const;
  // Resizes per_layer's arrays for layers.size() layers of this shape, zero-filled.
  void allocate();
  // Throws naming the field when sizes, heads or layers are inconsistent (within the parts,
  // and against `shape` when given).
  void validate(const ModelShape* shape = nullptr) const;
};

void write_saap_parts(const h5::Group& group, const SaapParts& parts);

// Reads and validates the group against `shape`: attributes match the model (head counts,
// head_dim), arrays have the shapes the attributes imply (the error names the dataset with
// expected and actual shapes), layers lie in the model and outside dense_layers.
SaapParts read_saap_parts(const h5::Group& group, const ModelShape& shape);

// The inference form of one query head's MLP: batch norm folded into the first layer,
// w1' = diag(s) w1, b1' = s (b1 - mean) + beta with s = gamma / sqrt(var + eps).
struct FoldedMlp {
  std::vector<float> w1, b1, w2, b2;  // all query heads of one layer, SaapLayerParts layout
};
FoldedMlp fold_batch_norm(const SaapParts& parts, int slot);

}  // namespace kvs
