// A fixed pool of worker threads: parallel_for with dynamic scheduling. MagicPIG's CPU half
// runs its query heads on it (heads retrieve very different candidate counts), and the SAAP
// engine its layers' router preparation. The calling thread works too, as worker 0, so a
// pool of 1 runs everything inline.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvs::kernels {

class ThreadPool {
 public:
  // threads <= 0: std::thread::hardware_concurrency().
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(i, worker) for every i in [0, n), worker in [0, size()), and returns when all
  // are done. The first exception thrown by fn is rethrown here (the others are dropped).
  // Not reentrant: one parallel_for at a time per pool.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn);

 private:
  void run(int worker);
  void work(int worker);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;           // workers still inside the current job
  uint64_t generation_ = 0;  // bumped per job
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace kvs::kernels
