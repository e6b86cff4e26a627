// A small persistent thread pool for the host kernels: parallel_for over row ranges.
//
// Why not OpenMP: torch ships its own libgomp in the same process, and a second OpenMP runtime (or a shared one
// whose global thread count we would change) interferes with torch's intra-op threads.
// One job runs at a time; a second caller waits for the first (calls come from a few Python host threads).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moge {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) { resize(threads); }
  ~ThreadPool() { stop_workers(); }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }  // the caller takes part too

  void resize(int threads) {
    std::lock_guard<std::mutex> job_guard(job_mutex_);
    stop_workers();
    threads = std::max(1, threads);
    stopping_ = false;
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, g = generation_] { worker_loop(g); });
  }

  // Calls body(begin, end) on disjoint chunks covering [0, n), in parallel; returns when all are done.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    if (n <= grain) {
      body(0, n);
      return;
    }
    std::lock_guard<std::mutex> job_guard(job_mutex_);
    if (workers_.empty()) {
      body(0, n);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      n_ = n;
      // About 4 chunks per thread: balances uneven rows without much scheduling overhead.
      chunk_ = std::max(grain, (n + 4 * threads() - 1) / (4 * threads()));
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    run_chunks();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    body_ = nullptr;
  }

 private:
  void run_chunks() {
    for (;;) {
      int64_t begin = next_.fetch_add(chunk_);
      if (begin >= n_) return;
      (*body_)(begin, std::min(n_, begin + chunk_));
    }
  }

  void worker_loop(uint64_t seen) {  // seen: the last job generation before this worker started
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      run_chunks();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--active_ == 0) done_.notify_one();
      }
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

// A process-wide pool made on first use (one thread until set_threads says otherwise).
class LazyPool {
 public:
  ThreadPool& get() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pool_) pool_.reset(new ThreadPool(1));
    return *pool_;
  }

  int set_threads(int threads) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pool_)
      pool_.reset(new ThreadPool(threads));
    else if (pool_->threads() != threads)
      pool_->resize(threads);
    return pool_->threads();
  }

 private:
  std::mutex mutex_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace moge
