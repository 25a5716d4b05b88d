#include "runtime/engine_support.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace kvs {

DeviceCounters::DeviceCounters(int count)
    : ptr_(device_alloc<unsigned long long>(count)), count_(count) {
  reset();
}

OwnedStreamFork::OwnedStreamFork(bool greatest_priority, int raise) {
  int least = 0, greatest = 0;  // numerically greatest <= least
  KVS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  KVS_CUDA_CHECK(cudaStreamCreateWithPriority(
      &fork_.side, cudaStreamNonBlocking,
      greatest_priority ? greatest : std::max(greatest, least - std::max(0, raise))));
  KVS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_.forked, cudaEventDisableTiming));
  KVS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_.joined, cudaEventDisableTiming));
}

OwnedStreamFork::~OwnedStreamFork() {
  if (fork_.side) cudaStreamSynchronize(fork_.side);
  if (fork_.forked) cudaEventDestroy(fork_.forked);
  if (fork_.joined) cudaEventDestroy(fork_.joined);
  if (fork_.side) cudaStreamDestroy(fork_.side);
}

DeviceCounters::~DeviceCounters() {
  if (ptr_) cudaFree(ptr_);
}

DeviceCounters::DeviceCounters(DeviceCounters&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}

DeviceCounters& DeviceCounters::operator=(DeviceCounters&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    count_ = std::exchange(o.count_, 0);
  }
  return *this;
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  if (bytes > 0) KVS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  KVS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  KVS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void zero_on_device(void* dst, size_t bytes) {
  if (bytes == 0) return;
  KVS_CUDA_CHECK(cudaMemset(dst, 0, bytes));
  KVS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

std::vector<uint64_t> DeviceCounters::read() const {
  std::vector<unsigned long long> c(size_t(count_), 0);
  if (ptr_) copy_to_host(c.data(), ptr_, c.size() * sizeof(unsigned long long));
  return std::vector<uint64_t>(c.begin(), c.end());
}

void DeviceCounters::read_into(EngineStats* s, int rows_read, int selection_bytes,
                               int context_rows) const {
  const std::vector<uint64_t> c = read();
  s->kv_rows_read = c.at(size_t(rows_read));
  s->selection_bytes_read = c.at(size_t(selection_bytes));
  s->kv_rows_context = c.at(size_t(context_rows));
}

void DeviceCounters::reset() {
  if (!ptr_) return;
  KVS_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel of any stream still adding
  zero_on_device(ptr_, size_t(count_) * sizeof(unsigned long long));
}

void check_prefill_args(const std::string& who, int layer, const PagedKV& kv,
                        const ModelShape& shape, int max_batch) {
  auto str = [](int x) { return std::to_string(x); };
  if (layer < 0 || layer >= shape.num_layers)
    throw std::out_of_range(who + "layer " + str(layer) + " outside [0, " + str(shape.num_layers) +
                            ")");
  if (kv.batch <= 0 || kv.batch > max_batch)
    throw std::invalid_argument(who + "batch " + str(kv.batch) + " outside [1, " + str(max_batch) +
                                "] (EngineConfig.max_batch)");
  if (kv.num_kv_heads != shape.num_kv_heads || kv.head_dim != shape.head_dim)
    throw std::invalid_argument(who + "KV cache has " + str(kv.num_kv_heads) + " kv heads of dim " +
                                str(kv.head_dim) + ", the model has " + str(shape.num_kv_heads) +
                                " of dim " + str(shape.head_dim));
}

std::vector<int32_t> host_seq_lens(const PagedKV& kv, Backend backend, cudaStream_t stream) {
  std::vector<int32_t> lens(size_t(kv.batch));
  if (backend == Backend::Cuda) {
    KVS_CUDA_CHECK(cudaMemcpyAsync(lens.data(), kv.seq_lens, lens.size() * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream));
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    std::copy(kv.seq_lens, kv.seq_lens + kv.batch, lens.begin());
  }
  return lens;
}

std::vector<std::vector<int32_t>> read_kv_head_lists(const kernels::tactic::Selection& sel, int b,
                                                     int num_kv_heads) {
  const int hkv = num_kv_heads;
  std::vector<int32_t> counts(static_cast<size_t>(hkv));
  copy_to_host(counts.data(), sel.counts + size_t(b) * hkv, counts.size() * sizeof(int32_t));
  std::vector<std::vector<int32_t>> lists(static_cast<size_t>(hkv));
  for (int h = 0; h < hkv; ++h) {
    auto& t = lists[size_t(h)];
    t.resize(size_t(counts[size_t(h)]));
    copy_to_host(t.data(), sel.tokens + (size_t(b) * hkv + h) * sel.max_tokens,
                 t.size() * sizeof(int32_t));
  }
  return lists;
}

std::vector<std::vector<int32_t>> per_query_head_lists(
    std::vector<std::vector<int32_t>> per_kv_head, int group_size, bool sort) {
  std::vector<std::vector<int32_t>> out;
  out.reserve(per_kv_head.size() * size_t(group_size));
  for (auto& list : per_kv_head) {
    if (sort) std::sort(list.begin(), list.end());
    for (int j = 0; j < group_size; ++j) out.push_back(list);
  }
  return out;
}

}  // namespace kvs
