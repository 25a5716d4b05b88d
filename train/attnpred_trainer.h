// AttentionPredictor trainer (spec shared/specs/attnpred.md section 2.2): the paper's CNN in
// libtorch, trained on the block-pooled decode attention rows of capture files.
//
// Samples: for a captured layer (not a dense one), query head (kv head when
// knobs.group_history: the row is the largest of the group's query heads' rows, as the
// runtime's grouped history keeps it) and decode step s with at least
// `history` rows up to s, the input is rows s - history + 1 .. s and the target is row s + 1,
// both sliced to the candidate columns the runtime predicts: [sink / block,
// Geometry::candidate_end(n)) with n the context of row s (the target's newest keys, in the
// recent window, are not predicted, as the paper trains). Inputs narrower than 3 columns are
// skipped (the runtime selects every candidate there). Batches hold samples of one width, so no
// padding changes the CNN's edges. One model for every layer and head. Loss: MSE. Optimiser: Adam.
// Split: units (capture, sequence, layer, query or kv head) are shuffled with the seed and
// val_fraction of them held out; the epoch with the best validation recovery (the pooled
// form of the paper's Eq. 1 at the budget: the target's block mass in the predicted top
// blocks over its total) is kept (ties: the lower validation loss).
// Deterministic: the seed fixes the initialisation, the split and the batch order; torch runs
// with deterministic algorithms on `threads` threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "artifacts/model_shape.h"
#include "runtime/attnpred_engine.h"

namespace kvs::train {

struct AttnPredTrainConfig {
  std::vector<std::string> captures;  ///< kvs-capture files of one model
  AttnPredParams knobs;               ///< geometry and runtime defaults written with the weights
  int epochs = 30;                    ///< paper: 30
  int batch_size = 64;                ///< samples per step (of one width)
  double learning_rate = 1e-3;        ///< Adam
  double val_fraction = 0.1;          ///< held-out units
  int max_samples = 0;                ///< cap on training samples per epoch (0: all)
  uint64_t seed = 0;
  int threads = 1;  ///< torch intra-op threads
};

struct AttnPredEpoch {
  int epoch = 0;
  double train_loss = 0, val_loss = 0, val_recovery = 0;
};

struct AttnPredTrainResult {
  ModelShape shape;
  AttnPredParams params;  ///< knobs + the best epoch's weights
  std::vector<AttnPredEpoch> curve;
  int best_epoch = 0;
  int64_t train_samples = 0, val_samples = 0;
};

using TrainProgress = std::function<void(const std::string& line)>;

// Throws std::invalid_argument naming the file when a capture is of another model, has no
// attention rows for a compressed layer, or has too few decode steps for `history`.
AttnPredTrainResult train_attnpred(const AttnPredTrainConfig& config,
                                   const TrainProgress& progress = {});

// The trained file (artifacts/trained_file.h): /attnpred = the bundle group layout
// (write_attnpred_params) plus loss_curve [epochs, 4] (epoch, train MSE, validation MSE,
// validation recovery) and the training settings as attributes.
void write_attnpred_trained(const std::string& path, const AttnPredTrainConfig& config,
                            const AttnPredTrainResult& result);

}  // namespace kvs::train
