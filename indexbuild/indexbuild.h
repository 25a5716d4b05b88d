// Assembles the per-model artifact bundle (artifacts/bundle.h) from the trainers' outputs
// (artifacts/trained_file.h), after checking each belongs to the model and loads.
#pragma once

#include <string>
#include <vector>

#include "artifacts/model_shape.h"

namespace kvs {

struct IndexbuildInputs {
  ModelShape shape;                        ///< the model the bundle is for (with weights hash)
  std::vector<std::string> trained_files;  ///< kvs-train outputs, one method each
};

// Writes `out` atomically. Throws naming the file when a trained file is for another model
// (both fingerprints and the differing fields), two files carry the same method, or a
// method's group does not validate (validate_stored_parts).
void build_bundle(const std::string& out, const IndexbuildInputs& inputs);

}  // namespace kvs
