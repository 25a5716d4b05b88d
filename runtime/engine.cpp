#include "runtime/engine.h"

#include <stdexcept>

#include "runtime/attnpred_engine.h"
#include "runtime/dense_engine.h"
#include "runtime/magicpig_engine.h"
#include "runtime/mac_engine.h"
#include "runtime/saap_engine.h"
#include "runtime/tactic_engine.h"

namespace kvs {

const char* to_string(Method m) {
  switch (m) {
    case Method::Dense: return "dense";
    case Method::Tactic: return "tactic";
    case Method::MagicPig: return "magicpig";
    case Method::Mac: return "mac";
    case Method::Saap: return "saap";
    case Method::AttnPred: return "attnpred";
  }
  return "?";
}

const char* to_string(Backend b) { return b == Backend::Cpu ? "cpu" : "cuda"; }

Method method_from_string(const std::string& name) {
  if (name == "dense") return Method::Dense;
  if (name == "tactic") return Method::Tactic;
  if (name == "mac") return Method::Mac;
  if (name == "magicpig") return Method::MagicPig;
  if (name == "saap") return Method::Saap;
  if (name == "attnpred") return Method::AttnPred;
  throw std::invalid_argument("unknown method '" + name +
                              "' (known: dense, tactic, mac, magicpig, saap, attnpred)");
}

Backend backend_from_string(const std::string& name) {
  if (name == "cpu") return Backend::Cpu;
  if (name == "cuda") return Backend::Cuda;
  throw std::invalid_argument("unknown backend '" + name + "' (known: cpu, cuda)");
}

Engine::Engine(const ModelShape& shape, const EngineConfig& config)
    : shape_(shape), config_(config) {
  shape_.validate();
  if (config_.max_batch <= 0)
    throw std::invalid_argument("EngineConfig: max_batch must be > 0, got " +
                                std::to_string(config_.max_batch));
}

void Engine::bind_workspace(Workspace ws) {
  const size_t need = workspace_bytes();
  if (need > 0 && (ws.ptr == nullptr || ws.bytes < need))
    throw std::invalid_argument(std::string(to_string(method())) + " engine: workspace of " +
                                std::to_string(ws.bytes) + " bytes, needs " +
                                std::to_string(need) + " for max_batch " +
                                std::to_string(config_.max_batch));
  if (need > 0 && reinterpret_cast<uintptr_t>(ws.ptr) % kWorkspaceAlignment != 0)
    throw std::invalid_argument(std::string(to_string(method())) + " engine: workspace at " +
                                std::to_string(reinterpret_cast<uintptr_t>(ws.ptr)) + " is not " +
                                std::to_string(kWorkspaceAlignment) + "-byte aligned");
  workspace_ = ws;
}

void Engine::check_decode_args(int layer, const PagedKV& kv, const bf16* q,
                               const bf16* out) const {
  const std::string who = std::string(to_string(method())) + " engine decode: ";
  if (layer < 0 || layer >= shape_.num_layers)
    throw std::out_of_range(who + "layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(shape_.num_layers) + ")");
  if (kv.batch <= 0 || kv.batch > config_.max_batch)
    throw std::invalid_argument(who + "batch " + std::to_string(kv.batch) + " outside [1, " +
                                std::to_string(config_.max_batch) + "] (EngineConfig.max_batch)");
  if (kv.num_kv_heads != shape_.num_kv_heads || kv.head_dim != shape_.head_dim)
    throw std::invalid_argument(who + "KV cache has " + std::to_string(kv.num_kv_heads) +
                                " kv heads of dim " + std::to_string(kv.head_dim) +
                                ", the model has " + std::to_string(shape_.num_kv_heads) +
                                " of dim " + std::to_string(shape_.head_dim));
  if (!q || !out || !kv.k || !kv.v || !kv.page_table || !kv.seq_lens)
    throw std::invalid_argument(who + "null q, out or KV pointer");
  if (workspace_bytes() > 0 && workspace_.ptr == nullptr)
    throw std::logic_error(who + "no workspace bound (call bind_workspace)");
}

void validate_stored_parts(Method method, const h5::Group& group, const ModelShape& shape) {
  switch (method) {
    case Method::MagicPig: check_magicpig_projection(group, shape); return;
    case Method::Saap: read_saap_parts(group, shape); return;
    case Method::AttnPred: load_attnpred_params(group, shape); return;
    default:
      break;
  }
  throw std::invalid_argument(group.describe() + ": method '" + to_string(method) +
                              "' has no stored parts to put in a bundle");
}

h5::Group require_bundle_group(const Bundle* bundle, const std::string& method,
                               const ModelShape& shape) {
  if (bundle == nullptr)
    throw std::invalid_argument("method '" + method +
                                "' needs a bundle with its stored parts (make one with "
                                "kvs-indexbuild; pass it to make_engine / kvs-eval --bundle)");
  bundle->check_model(shape);
  if (!bundle->has_method(method))
    throw std::invalid_argument("bundle " + bundle->path() + " has no '" + method +
                                "' group (rebuild it with kvs-indexbuild including " + method + ")");
  return bundle->method_group(method);
}

std::unique_ptr<Engine> make_engine(Method method, const ModelShape& shape,
                                    const EngineConfig& config, const Bundle* bundle) {
  switch (method) {
    case Method::Dense: return std::make_unique<DenseEngine>(shape, config);
    case Method::Tactic: return std::make_unique<TacticEngine>(shape, config);
    case Method::MagicPig: return make_magicpig_engine(shape, config, bundle);
    case Method::Mac: return std::make_unique<MacEngine>(shape, config);
    case Method::Saap:
      return std::make_unique<SaapEngine>(
          shape, config, read_saap_parts(require_bundle_group(bundle, "saap", shape), shape));
    case Method::AttnPred:
      return std::make_unique<AttnPredEngine>(
          shape, config,
          load_attnpred_params(require_bundle_group(bundle, "attnpred", shape), shape));
  }
  throw std::invalid_argument("make_engine: unknown method");
}

}  // namespace kvs
