#include "runtime/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"

namespace kvs {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

template <typename T>
T* allocate(Device device, int64_t count) {
  if (count == 0) return nullptr;
  if (device == Device::Cuda) {
    void* p = nullptr;
    KVS_CUDA_CHECK(cudaMalloc(&p, size_t(count) * sizeof(T)));
    return static_cast<T*>(p);
  }
  return new T[size_t(count)]();
}

template <typename T>
void deallocate(Device device, T* p) {
  if (!p) return;
  if (device == Device::Cuda) {
    cudaFree(p);  // a destructor must not throw; a failure here leaves nothing to recover
  } else {
    delete[] p;
  }
}

void copy(Device device, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (device == Device::Cuda) {
    KVS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  } else {
    std::memcpy(dst, src, bytes);
  }
}

// The host calls that copy into the device's lengths, page tables or pages first wait for
// every stream's queued work: a decode step queued before the call may still read them, and
// a copy on the legacy default stream is not ordered after work on a non-blocking stream (the
// step index kernel of a SAAP step queued on one read a length of the next step and failed,
// docs/gpu.md).
void wait_for_device(Device device) {
  if (device == Device::Cuda) KVS_CUDA_CHECK(cudaDeviceSynchronize());
}

// ... and they return only once their own copies have landed. CUDA's documented behavior
// lets a cudaMemcpy between device buffers return before it runs, and one from pageable host
// memory once its bytes are staged, before the DMA lands; both run on the legacy stream,
// which a kernel queued next on a non-blocking stream is not ordered after. On an H200
// (driver 580) both forms had landed by their return in every try (4 x 128 MiB, then a
// reader queued at once; docs/gpu.md), so no test provokes this: the wait follows the
// documented contract, not an observed failure.
void wait_for_copies(Device device) {
  if (device == Device::Cuda) KVS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

}  // namespace

KVCache::KVCache(const KVCacheConfig& c) : config_(c) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("KVCacheConfig: " + what);
  };
  need(c.num_layers > 0, "num_layers must be > 0, got " + str(c.num_layers));
  need(c.num_kv_heads > 0, "num_kv_heads must be > 0, got " + str(c.num_kv_heads));
  need(c.head_dim > 0 && c.head_dim % 8 == 0,
       "head_dim must be a positive multiple of 8, got " + str(c.head_dim));
  need(c.page_size > 0, "page_size must be > 0, got " + str(c.page_size));
  need(c.max_batch > 0, "max_batch must be > 0, got " + str(c.max_batch));
  need(c.max_seq_len > 0, "max_seq_len must be > 0, got " + str(c.max_seq_len));
  need(c.num_pages >= 0, "num_pages must be >= 0, got " + str(c.num_pages));
  pages_per_seq_ = (c.max_seq_len + c.page_size - 1) / c.page_size;
  if (config_.num_pages == 0) config_.num_pages = pages_per_seq_ * c.max_batch;
  layer_elems_ = int64_t(config_.num_pages) * c.page_size * c.num_kv_heads * c.head_dim;

  k_ = allocate<bf16>(c.device, layer_elems_ * c.num_layers);
  v_ = allocate<bf16>(c.device, layer_elems_ * c.num_layers);
  page_table_ = allocate<int32_t>(c.device, int64_t(c.max_batch) * pages_per_seq_);
  seq_lens_ = allocate<int32_t>(c.device, c.max_batch);
  host_table_.assign(size_t(c.max_batch) * pages_per_seq_, 0);
  host_capacity_.assign(c.max_batch, 0);
  // Hand out low page ids first: pop_back takes from the end.
  for (int p = config_.num_pages - 1; p >= 0; --p) free_pages_.push_back(p);
  copy(c.device, page_table_, host_table_.data(), host_table_.size() * sizeof(int32_t));
  const std::vector<int32_t> zeros(c.max_batch, 0);
  copy(c.device, seq_lens_, zeros.data(), zeros.size() * sizeof(int32_t));
  wait_for_copies(c.device);
}

KVCache::~KVCache() {
  deallocate(config_.device, k_);
  deallocate(config_.device, v_);
  deallocate(config_.device, page_table_);
  deallocate(config_.device, seq_lens_);
}

void KVCache::check_slot(int b, const char* what) const {
  if (b < 0 || b >= config_.max_batch)
    throw std::out_of_range(std::string("KVCache::") + what + ": slot " + str(b) +
                            " outside [0, max_batch=" + str(config_.max_batch) + ")");
}

void KVCache::upload_table_row(int b) {
  const size_t row = size_t(b) * pages_per_seq_;
  copy(config_.device, page_table_ + row, host_table_.data() + row,
       size_t(pages_per_seq_) * sizeof(int32_t));
}

void KVCache::reserve(int b, int capacity) {
  check_slot(b, "reserve");
  if (capacity < 0 || capacity > config_.max_seq_len)
    throw std::out_of_range("KVCache::reserve: capacity " + str(capacity) + " for slot " +
                            str(b) + " outside [0, max_seq_len=" + str(config_.max_seq_len) + "]");
  const int have = (host_capacity_[b] + config_.page_size - 1) / config_.page_size;
  const int want = (capacity + config_.page_size - 1) / config_.page_size;
  if (want - have > int(free_pages_.size()))
    throw std::runtime_error("KVCache::reserve: slot " + str(b) + " needs " + str(want - have) +
                             " more pages of " + str(config_.page_size) + " tokens but only " +
                             str(free_pages_.size()) + " of " + str(config_.num_pages) +
                             " are free");
  wait_for_device(config_.device);  // before the host's books change, should it throw
  for (int p = have; p < want; ++p) {
    host_table_[size_t(b) * pages_per_seq_ + p] = free_pages_.back();
    free_pages_.pop_back();
  }
  host_capacity_[b] = std::max(host_capacity_[b], want * config_.page_size);
  upload_table_row(b);
  wait_for_copies(config_.device);
}

void KVCache::release(int b) {
  check_slot(b, "release");
  wait_for_device(config_.device);
  const int have = (host_capacity_[b] + config_.page_size - 1) / config_.page_size;
  for (int p = have - 1; p >= 0; --p) {
    int32_t& slot = host_table_[size_t(b) * pages_per_seq_ + p];
    free_pages_.push_back(slot);
    slot = 0;
  }
  host_capacity_[b] = 0;
  upload_table_row(b);
  if (b < batch_) {
    host_lens_[b] = 0;
    const int32_t zero = 0;
    copy(config_.device, seq_lens_ + b, &zero, sizeof zero);
  }
  wait_for_copies(config_.device);
}

void KVCache::set_lengths(const std::vector<int>& lens) {
  if (lens.empty() || int(lens.size()) > config_.max_batch)
    throw std::out_of_range("KVCache::set_lengths: batch " + str(lens.size()) +
                            " outside [1, max_batch=" + str(config_.max_batch) + "]");
  for (size_t b = 0; b < lens.size(); ++b)
    if (lens[b] < 0 || lens[b] > host_capacity_[b])
      throw std::out_of_range("KVCache::set_lengths: length " + str(lens[b]) + " of slot " +
                              str(b) + " exceeds its reservation of " + str(host_capacity_[b]) +
                              " tokens (call reserve first)");
  wait_for_device(config_.device);
  host_lens_ = lens;
  batch_ = int(lens.size());
  const std::vector<int32_t> l(lens.begin(), lens.end());
  copy(config_.device, seq_lens_, l.data(), l.size() * sizeof(int32_t));
  wait_for_copies(config_.device);
}

void KVCache::write(int layer, int b, int start, int n, const bf16* k, const bf16* v) {
  check_slot(b, "write");
  if (layer < 0 || layer >= config_.num_layers)
    throw std::out_of_range("KVCache::write: layer " + str(layer) + " outside [0, " +
                            str(config_.num_layers) + ")");
  if (start < 0 || n < 0 || start + n > host_capacity_[b])
    throw std::out_of_range("KVCache::write: tokens [" + str(start) + ", " + str(start + n) +
                            ") of slot " + str(b) + " exceed its reservation of " +
                            str(host_capacity_[b]) + " tokens");
  const int64_t row = int64_t(config_.num_kv_heads) * config_.head_dim;
  bf16* kl = k_ + layer * layer_elems_;
  bf16* vl = v_ + layer * layer_elems_;
  wait_for_device(config_.device);
  // Contiguous runs within a page go in one copy each.
  for (int t = start; t < start + n;) {
    const int in_page = std::min(start + n - t, config_.page_size - t % config_.page_size);
    const int64_t page = host_table_[size_t(b) * pages_per_seq_ + t / config_.page_size];
    const int64_t dst = (page * config_.page_size + t % config_.page_size) * row;
    const size_t bytes = size_t(in_page) * row * sizeof(bf16);
    copy(config_.device, kl + dst, k + (t - start) * row, bytes);
    copy(config_.device, vl + dst, v + (t - start) * row, bytes);
    t += in_page;
  }
  wait_for_copies(config_.device);
}

void KVCache::begin_step(cudaStream_t stream) {
  commit_step();
  enqueue_step(stream);
}

void KVCache::commit_step() {
  for (int b = 0; b < batch_; ++b)
    if (host_lens_[b] + 1 > host_capacity_[b])
      throw std::out_of_range("KVCache::begin_step: slot " + str(b) + " would grow to " +
                              str(host_lens_[b] + 1) + " tokens beyond its reservation of " +
                              str(host_capacity_[b]) + " (reserve ahead of decoding)");
  for (int b = 0; b < batch_; ++b) ++host_lens_[b];
}

void KVCache::enqueue_step(cudaStream_t stream) {
  if (config_.device == Device::Cuda) {
    KVS_CUDA_CHECK(kernels::kv_begin_step_cuda(seq_lens_, batch_, stream));
  } else {
    kernels::kv_begin_step_cpu(seq_lens_, batch_);
  }
}

void KVCache::append(int layer, const bf16* k_new, const bf16* v_new, cudaStream_t stream) {
  if (layer < 0 || layer >= config_.num_layers)
    throw std::out_of_range("KVCache::append: layer " + str(layer) + " outside [0, " +
                            str(config_.num_layers) + ")");
  const PagedKV kv = view(layer);
  if (config_.device == Device::Cuda) {
    KVS_CUDA_CHECK(kernels::kv_append_cuda(kv, k_new, v_new, stream));
  } else {
    kernels::kv_append_cpu(kv, k_new, v_new);
  }
}

PagedKV KVCache::view(int layer) const {
  PagedKV kv;
  kv.k = k_ + layer * layer_elems_;
  kv.v = v_ + layer * layer_elems_;
  kv.page_table = page_table_;
  kv.seq_lens = seq_lens_;
  kv.batch = batch_;
  kv.num_pages = config_.num_pages;
  kv.page_size = config_.page_size;
  kv.num_kv_heads = config_.num_kv_heads;
  kv.head_dim = config_.head_dim;
  kv.max_pages_per_seq = pages_per_seq_;
  return kv;
}

size_t KVCache::bytes() const {
  return size_t(layer_elems_) * config_.num_layers * 2 * sizeof(bf16);
}

}  // namespace kvs
