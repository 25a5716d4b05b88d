// One interface for every attention method (DESIGN.md, "The runtime API shape").
//
// Plan/run with caller-owned workspace: bind_workspace() once (size from workspace_bytes()),
// then prefill() per layer after the prompt's K/V are in the cache, and decode() per layer
// and step after the new token's K/V were appended. decode() on the CUDA backend does no
// host sync, no allocation and no device-to-host copy, so a whole step can be captured in a
// CUDA graph. Capture whole steps: the SAAP and AttentionPredictor engines run work of a layer
// on a branch beside the later layers and join it in the decode of the step's last layer that
// is not dense, so a capture without that call ends with unjoined work. The CPU backend
// (exact, simple) is the oracle for tests and runs where there is no GPU: its pointers are
// host pointers and the stream is ignored.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "artifacts/bundle.h"
#include "artifacts/model_shape.h"
#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"
#include "runtime/attnpred_config.h"
#include "runtime/mac_config.h"
#include "runtime/magicpig_config.h"
#include "runtime/saap_config.h"
#include "runtime/tactic_config.h"

namespace kvs {

enum class Method { Dense, Tactic, Mac, MagicPig, Saap, AttnPred };
enum class Backend { Cpu, Cuda };

const char* to_string(Method m);
const char* to_string(Backend b);
Method method_from_string(const std::string& name);    // throws, listing the known names
Backend backend_from_string(const std::string& name);  // "cpu" or "cuda"

struct EngineConfig {
  Backend backend = Backend::Cuda;
  int max_batch = 1;           ///< largest batch decode() will see
  bool collect_stats = false;  ///< count KV rows read on the device (one extra tiny kernel)
  TacticConfig tactic;         ///< Method::Tactic knobs (runtime/tactic_config.h)
  MagicPigConfig magicpig;     ///< Method::MagicPig knobs (runtime/magicpig_config.h)
  MacConfig mac;               ///< Method::Mac knobs (runtime/mac_config.h)
  SaapConfig saap;             ///< Method::Saap knobs (runtime/saap_config.h)
  AttnPredConfig attnpred;     ///< Method::AttnPred knobs (runtime/attnpred_config.h)
};

// Counters since construction or reset_stats(). A "row" is one token of one KV head, K and V
// together: 2 * head_dim * 2 bytes.
struct EngineStats {
  uint64_t decode_calls = 0;     ///< decode() calls (one layer of one step each)
  uint64_t kv_rows_read = 0;     ///< rows the method read
  uint64_t kv_rows_context = 0;  ///< rows a dense read of the same calls would read
  /// Bytes a method reads to decide what to attend, apart from kv_rows_read (Tactic:
  /// centroids and the sampled keys of the budget fit). 0 for dense.
  uint64_t selection_bytes_read = 0;
  double kv_read_fraction() const {
    return kv_rows_context ? double(kv_rows_read) / double(kv_rows_context) : 0.0;
  }
};

struct Workspace {
  void* ptr = nullptr;  ///< device memory for Backend::Cuda, host memory for Backend::Cpu
  size_t bytes = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual Method method() const = 0;
  virtual Backend backend() const = 0;
  const ModelShape& shape() const { return shape_; }

  // Workspace decode() needs for up to config.max_batch sequences; bind it before decode().
  // Its pointer must be kWorkspaceAlignment-aligned (cudaMalloc's are): the kernels read
  // their parts of it with 16-byte loads.
  static constexpr size_t kWorkspaceAlignment = 256;
  virtual size_t workspace_bytes() const = 0;
  void bind_workspace(Workspace ws);

  // Builds the method's per-layer state from the prompt in kv (all tokens so far).
  virtual void prefill(int layer, const PagedKV& kv, cudaStream_t stream) = 0;

  // Methods that reuse past queries (MAC) also want the prompt's last queries: how many
  // (0 for the others), and the call that takes them after prefill(layer). q, q_pre
  // [n, Hq, d] are the post- and pre-RoPE queries of positions len - n .. len - 1 of
  // sequence b (len = kv.seq_lens[b]), in the backend's memory. Not graph-capturable.
  virtual int prompt_queries_wanted() const { return 0; }
  virtual void prefill_queries(int layer, int b, const bf16* q, const bf16* q_pre, int n,
                               const PagedKV& kv, cudaStream_t stream) {}

  // q [batch, Hq, d]: post-RoPE queries; q_pre: the same before RoPE (methods that match
  // or classify queries use it; may be null for methods that do not); out [batch, Hq, d];
  // lse [batch, Hq] (may be null). kv holds the new token already.
  virtual void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv,
                      bf16* out, float* lse, cudaStream_t stream) = 0;

  virtual EngineStats stats() const = 0;
  virtual void reset_stats() = 0;

  // For evaluation: the tokens each query head of sequence b attended in the last decode()
  // of `layer`, ascending ([Hq][...]). Empty means every token (a dense read). On the CUDA
  // backend this and stats() (and reset_stats() before it zeroes) wait for the whole device
  // first, so they see what decodes queued on any stream wrote, a non-blocking one included;
  // never call them inside a step or while a stream is being captured.
  virtual std::vector<std::vector<int32_t>> last_read(int layer, int b) const { return {}; }

 protected:
  Engine(const ModelShape& shape, const EngineConfig& config);
  // Throws, naming the mismatch, when kv or the batch do not fit this engine.
  void check_decode_args(int layer, const PagedKV& kv, const bf16* q, const bf16* out) const;

  ModelShape shape_;
  EngineConfig config_;
  Workspace workspace_;
};

// Methods with trained or stored parts (SAAP, AttentionPredictor; MagicPIG's projection)
// read them from `bundle` (artifacts/bundle.h), which must have been made for `shape`: the
// bundle's fingerprint is checked here, and a missing method group is an error that says
// how to make one (kvs-indexbuild). Methods without stored parts ignore it.
std::unique_ptr<Engine> make_engine(Method method, const ModelShape& shape,
                                    const EngineConfig& config, const Bundle* bundle = nullptr);

// Checks that `group` holds stored parts `method` can load for `shape` (kvs-indexbuild
// calls it before a trained file's group goes into a bundle). Throws naming the group and
// what is wrong; methods without stored parts throw saying so.
void validate_stored_parts(Method method, const h5::Group& group, const ModelShape& shape);

// The bundle group `method` of `bundle`, after checking the bundle belongs to `shape`;
// throws naming the method and the bundle when it is absent or made for another model.
h5::Group require_bundle_group(const Bundle* bundle, const std::string& method,
                               const ModelShape& shape);

}  // namespace kvs
