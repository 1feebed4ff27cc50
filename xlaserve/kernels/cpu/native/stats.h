// Wall time spent inside each native kernel, for `xlaserve bench step --breakdown`: the same
// step's time split into the kernels' share and the rest (XLA's own ops, launch overhead).
//
//   ScopedTimer t(Kernel::kMatmul);        adds this call's nanoseconds and one call
//   xlaserve_kernel_stats(out)             (C, for ctypes) out[2k] = ns, out[2k + 1] = calls
//   xlaserve_kernel_stats_reset()
//
// Two clock reads per call (~50 ns against calls of 10 us and more).  Calls from several
// threads at once (two engines) add up.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace xlaserve {

enum class Kernel : int { kMatmul = 0, kMatmulNt = 1, kPagedAttention = 2, kTopK = 3, kCount = 4 };

struct KernelCounters {
  std::atomic<int64_t> ns[static_cast<int>(Kernel::kCount)] = {};
  std::atomic<int64_t> calls[static_cast<int>(Kernel::kCount)] = {};
};

inline KernelCounters& counters() {
  static KernelCounters c;
  return c;
}

class ScopedTimer {
 public:
  explicit ScopedTimer(Kernel k) : k_(static_cast<int>(k)),
                                   start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start_).count();
    counters().ns[k_].fetch_add(ns, std::memory_order_relaxed);
    counters().calls[k_].fetch_add(1, std::memory_order_relaxed);
  }

 private:
  int k_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace xlaserve
