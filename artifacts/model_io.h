// ModelShape as attributes of an HDF5 group (a capture file's or a bundle's root).
//
// Attribute names: model_name, num_layers, num_q_heads, num_kv_heads, head_dim,
// max_position, rope_type, rope_theta, rope_factor, rope_low_freq_factor,
// rope_high_freq_factor, rope_original_max_position, softmax_scale, weights_hash.
// Every field is written, whatever the RoPE type, so that files are uniform.
#pragma once

#include "artifacts/h5.h"
#include "artifacts/model_shape.h"

namespace kvs {

// Validates `shape` first (a file never gets a shape that read_model_shape would refuse).
void write_model_shape(const h5::Group& group, const ModelShape& shape);

// Throws naming the file, the group and every missing attribute, or the field that
// ModelShape::validate() rejects.
ModelShape read_model_shape(const h5::Group& group);

}  // namespace kvs
