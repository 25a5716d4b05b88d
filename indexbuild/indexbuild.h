// Assembles the per-model artifact bundle (artifacts/bundle.h) from the trainers' outputs
// (artifacts/trained_file.h), after checking each belongs to the model and loads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "artifacts/model_shape.h"

namespace kvs {

// MagicPIG's stored part is not trained: a seeded Gaussian projection d x (K * L), shared by
// all layers and heads, generated here so every engine made from the bundle hashes alike.
struct MagicPigBundlePart {
  bool include = false;
  int bits = 10;    ///< K
  int tables = 150; ///< L
  uint64_t seed = 0x4D414749435049ull;
};

struct IndexbuildInputs {
  ModelShape shape;                        ///< the model the bundle is for (with weights hash)
  std::vector<std::string> trained_files;  ///< kvs-train outputs, one method each
  MagicPigBundlePart magicpig;
};

// Writes `out` atomically. Throws naming the file when a trained file is for another model
// (both fingerprints and the differing fields), two files carry the same method, or a
// method's group does not validate (validate_stored_parts).
void build_bundle(const std::string& out, const IndexbuildInputs& inputs);

}  // namespace kvs
