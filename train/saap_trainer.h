// SAAP trainer (spec shared/specs/saap.md, sections 2.2-2.4): from capture files, per layer
// and kv head, Faiss k-means of the pre-RoPE keys; per query head, the paper's MLP router
// (Linear(d, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, C) -> softmax) trained in
// libtorch with KL(A H_k || f(q)) (PyTorch's KLDivLoss convention, spec 8.8).
//
// Targets (decode-faithful variant of spec 8.6, the pairs the runtime probes for): for a
// query at position p, the attention it pays (RoPE'd q and k, the model's scale) to keys
// j in [sink, p + 1 - recent) -- the part outside the dense window at decode -- normalised
// over those keys (8.7), summed per k-means bucket of the key. Only queries with at least one
// such key are used ("long-range pairs beyond the dense window"). Each batch comes from one
// prompt (sequence). Train/validation split: per sequence, the last val_fraction of its
// eligible query positions are held out; the validation KL is reported before training and
// every eval_every iterations.
//
// Deterministic under `seed` on the CPU (sampling from a seeded std::mt19937_64 per head,
// torch::manual_seed per head); on CUDA as far as libtorch's kernels are.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "artifacts/model_shape.h"
#include "runtime/saap_parts.h"

namespace kvs::train {

struct KMeansOptions {
  int num_clusters = 1024;            ///< C
  int iterations = 10;                ///< Lloyd iterations (App. A)
  bool spherical = true;              ///< unit-norm centroids (spec 8.1)
  int seed = 1234;                    ///< Faiss's initialisation and subsampling seed
  int max_points_per_centroid = 256;  ///< Faiss subsamples above C times this
};

// Faiss k-means of x [n, d] (row-major): centroids [C, d]. `what` names the data in errors
// (e.g. "layer 3 kv head 1"); throws when n < C.
std::vector<float> kmeans(const float* x, int64_t n, int d, const KMeansOptions& options,
                          const std::string& what);

struct SaapTrainOptions {
  std::vector<int> layers;           ///< empty: every captured layer not in dense_layers
  std::vector<int> dense_layers{0};  ///< recorded in the parts; never trained
  KMeansOptions kmeans;
  int hidden = 1024;           ///< MLP width (spec 2.3)
  int iterations = 40000;      ///< Adam steps per query head (App. A)
  int batch = 1000;            ///< queries per step, all from one sequence (App. A)
  double lr = 1e-5;            ///< Adam learning rate (App. A)
  int sink = 1;                ///< sink tokens, excluded from the targets and the index
  int recent = 2047;           ///< dense window: targets cover keys before it
  int probes = 32;             ///< recorded in the parts (the runtime's default l)
  double val_fraction = 0.2;   ///< held-out share of each sequence's eligible queries
  int max_val_queries = 2000;  ///< validation queries per head (evenly spread over the held-out)
  int eval_every = 0;          ///< validation KL every this many steps; 0: iterations / 10
  uint64_t seed = 0x5AA9;
  std::string device = "cpu";  ///< libtorch device for the MLP and the targets
  int key_chunk = 16384;       ///< keys per target chunk (memory: batch x key_chunk floats)
};

struct SaapHeadReport {
  int layer = 0, q_head = 0;
  int train_queries = 0, val_queries = 0;
  double val_kl_init = 0.0;       ///< validation KL of the untrained MLP
  double val_kl_final = 0.0;      ///< after training
  double kmeans_imbalance = 0.0;  ///< C * sum n_c^2 / N^2 of the kv head's training keys
  std::vector<float> loss;        ///< training KL per step
  std::vector<float> val_kl;      ///< at steps 0, eval_every, 2 eval_every, ..., iterations
};

struct SaapTrainResult {
  ModelShape shape;
  SaapParts parts;
  std::vector<SaapHeadReport> heads;
  std::vector<int> val_steps;  ///< the steps of SaapHeadReport::val_kl
};

// (stage, done, total, last loss)
using SaapProgress = std::function<void(const std::string&, int64_t, int64_t, double)>;

// Throws naming the file when captures disagree on the model, a requested layer was not
// captured or is dense, a head has no eligible query (sequences shorter than sink + recent),
// or a kv head has fewer training keys than C.
SaapTrainResult train_saap(const std::vector<std::string>& captures,
                           const SaapTrainOptions& options, const SaapProgress& progress = {});

// Writes the trained file (artifacts/trained_file.h): /saap (runtime/saap_parts.h) and the
// curves in /training: heads int32 [n, 2] (layer, query head), loss [n, iterations], val_kl
// [n, evals], val_steps [evals], val_kl_init/final [n], train/val query counts.
void write_saap_trained(const std::string& path, const SaapTrainResult& result,
                        const SaapTrainOptions& options);

// The query model (spec 2.3) and its export into parts.per_layer[slot] for query head q_head.
torch::nn::Sequential make_query_model(int head_dim, int hidden, int num_clusters);
void export_query_model(torch::nn::Sequential& model, SaapParts& parts, int slot, int q_head);

}  // namespace kvs::train
