// Work sharing for the CPU kernels: a small pool of worker threads that spin between calls.
//
//   parallel_for(n, body)   body(i) for every i in [0, n), items taken one at a time from an
//                           atomic counter by the calling thread and every worker
//
// Why not XLA's intra-op pool (ffi::ThreadPool): measured on the 2-core development box, a task
// scheduled on it starts 15-20 us after Schedule() and the caller then waits ~40 us for it at
// the end of each call; a decode step makes ~120 weight-matmul calls of ~150 us each, so the
// second core was idle a quarter of the time (30-layer SmolLM2 matmuls at batch 1: 24-26 ms on
// XLA's pool, 18 ms with these workers).  Here a worker polls for the next call for
// kSpinMicros before it sleeps, so back-to-back calls start on every core within a
// microsecond; idle, the pool sleeps on a condition variable.
//
// Sharing the cores: a server also runs Python (the engine's scheduling, the HTTP event loop)
// on the same cores, which preempts whichever thread it lands on.  So nothing waits long by
// spinning: the caller polls for workers still inside an item for kSpinMicros, then yields
// its core to them; workers spin between calls only briefly; and callers cut their work into
// several items per thread, so a preempted thread holds back one small item, not half the
// call.
//
// Threads: std::thread::hardware_concurrency(), capped by $XLASERVE_CPU_THREADS (read once); the
// caller is one of them.  One call uses the workers at a time: a call made while another runs
// (two engines in one process) runs on its own thread alone rather than waiting.
// Protocol: the caller publishes the job under `mu_`, bumps `generation_` and wakes sleepers;
// each worker that sees the new generation joins by incrementing `joined_`, drains the counter
// and decrements `running_`; the caller drains too, then waits until every joined worker has
// left.  A worker that wakes after the caller returned sees `job_ == nullptr` and goes back.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define XLASERVE_PAUSE() _mm_pause()
#else
#define XLASERVE_PAUSE() std::this_thread::yield()
#endif

namespace xlaserve {

class WorkerPool {
 public:
  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers outlive main()
    return *pool;
  }

  int64_t num_threads() const { return static_cast<int64_t>(workers_.size()) + 1; }

  template <typename Body>
  void parallel_for(int64_t n, const Body& body) {
    if (n <= 0) return;
    std::unique_lock<std::mutex> busy(call_mu_, std::try_to_lock);
    if (n == 1 || workers_.empty() || !busy.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    Job job{n, [](const void* b, int64_t i) { (*static_cast<const Body*>(b))(i); }, &body};
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    job.drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = nullptr;  // late workers find nothing to join
    }
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; job.running.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 64 || std::chrono::steady_clock::now() - start <
                            std::chrono::microseconds(kSpinMicros))
        XLASERVE_PAUSE();
      else
        std::this_thread::yield();   // a worker holding an item was preempted: let it run
    }
  }

 private:
  struct Job {
    int64_t total;
    void (*call)(const void*, int64_t);
    const void* body;
    std::atomic<int64_t> next{0};
    std::atomic<int> running{0};  // workers inside drain()

    Job(int64_t t, void (*c)(const void*, int64_t), const void* b) : total(t), call(c), body(b) {}
    void drain() {
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) call(body, i);
    }
  };

  static constexpr int64_t kSpinMicros = 50;

  WorkerPool() {
    int64_t threads = std::max(1u, std::thread::hardware_concurrency());
    if (const char* env = std::getenv("XLASERVE_CPU_THREADS"))
      threads = std::clamp<int64_t>(std::atoll(env), 1, threads);
    for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
    for (auto& w : workers_) w.detach();
  }

  void work() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        XLASERVE_PAUSE();
        if (++spins % 1024 == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(kSpinMicros)) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      Job* job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        if (job != nullptr) job->running.fetch_add(1, std::memory_order_acq_rel);
      }
      if (job != nullptr) {
        job->drain();
        job->running.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel call at a time
  std::mutex mu_;       // guards job_ handover and sleeping
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
  Job* job_ = nullptr;
};

template <typename Body>
void parallel_for(int64_t n, const Body& body) {
  WorkerPool::instance().parallel_for(n, body);
}

inline int64_t num_threads() { return WorkerPool::instance().num_threads(); }

}  // namespace xlaserve
