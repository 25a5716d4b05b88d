// The paged bf16 KV cache of DESIGN.md, owned by the runtime (or viewed by a user who owns
// their own pages: PagedKV is all an engine needs).
//
// Per layer, K and V pools of [num_pages, page_size, Hkv, d]; one page table and one length
// per sequence slot, shared by all layers. Page allocation is host bookkeeping done ahead of
// the decode steps (reserve); the per-step work (begin_step, append) is device work with no
// host sync, so a whole decode step can be captured in a CUDA graph and replayed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"

namespace kvs {

enum class Device { Cpu, Cuda };

struct KVCacheConfig {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;     ///< tokens per page; page_size == max_seq_len is contiguous
  int num_pages = 0;      ///< pages in the shared pool (0: enough for max_batch * max_seq_len)
  int max_batch = 1;      ///< sequence slots
  int max_seq_len = 0;    ///< longest sequence; sets the page-table width
  Device device = Device::Cuda;
};

class KVCache {
 public:
  explicit KVCache(const KVCacheConfig& config);
  ~KVCache();
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  const KVCacheConfig& config() const { return config_; }

  // The calls below that copy to the device (reserve, release, set_lengths, write) are host
  // calls, outside a captured step: each first waits for the work queued on every stream of
  // the device (cudaDeviceSynchronize), since a decode step queued before it may still read
  // the lengths, page tables and pages, even on a stream that the copy would not wait for;
  // and each returns only once its copies have landed, so that work queued next on any
  // stream reads them (a cudaMemcpy from device memory, or from pageable host memory, may
  // return before its bytes are in place).

  // Makes room for `capacity` tokens in slot b, taking pages from the pool (throws, naming
  // the numbers, when the pool or max_seq_len is exceeded). Copies the slot's page-table row
  // to the device synchronously.
  void reserve(int b, int capacity);
  // Returns slot b's pages to the pool and sets its length to 0.
  void release(int b);

  // Sets the current lengths of slots [0, lens.size()) (each within its reservation); the
  // active batch becomes lens.size(). Synchronous copy to the device.
  void set_lengths(const std::vector<int>& lens);
  const std::vector<int>& lengths() const { return host_lens_; }
  int batch() const { return batch_; }

  // Writes tokens [start, start + n) of slot b in `layer` from k, v [n, Hkv, d] (memory of
  // the cache's device). For prefill; the rows must lie within the slot's reservation.
  void write(int layer, int b, int start, int n, const bf16* k, const bf16* v);

  // One decode step: every active sequence grows by one token (device lengths += 1; the host
  // mirror too). Then append() per layer writes that token's k, v [batch, Hkv, d] at
  // position length - 1. Both are single kernels on CUDA, capturable in a graph.
  void begin_step(cudaStream_t stream);
  // begin_step in its two halves, for CUDA graphs: capture enqueue_step (device lengths
  // += 1) in the graph, and call commit_step (checks reservations, host mirror += 1) once
  // per replay.
  void enqueue_step(cudaStream_t stream);
  void commit_step();
  void append(int layer, const bf16* k_new, const bf16* v_new, cudaStream_t stream);

  // The view an engine reads: the current batch, lengths and page tables of `layer`.
  PagedKV view(int layer) const;

  size_t bytes() const;  // K + V pool bytes of all layers

 private:
  void check_slot(int b, const char* what) const;
  void upload_table_row(int b);

  KVCacheConfig config_;
  int pages_per_seq_ = 0;
  int64_t layer_elems_ = 0;             // elements of one layer's K (or V) pool
  bf16* k_ = nullptr;                   // [layers][num_pages, page_size, Hkv, d]
  bf16* v_ = nullptr;
  int32_t* page_table_ = nullptr;       // device (or host) [max_batch, pages_per_seq]
  int32_t* seq_lens_ = nullptr;         // device (or host) [max_batch]
  std::vector<int32_t> host_table_;
  std::vector<int> host_lens_;          // current lengths of the active slots
  std::vector<int> host_capacity_;      // reserved tokens per slot
  std::vector<int32_t> free_pages_;
  int batch_ = 0;
};

}  // namespace kvs
