// The C entry points of stats.h, read by kernels/cpu/build.py through ctypes.

#include "stats.h"

extern "C" {

// out[2k] = nanoseconds inside kernel k, out[2k + 1] = its calls (k in stats.h's Kernel order).
void xlaserve_kernel_stats(int64_t* out) {
  for (int k = 0; k < static_cast<int>(xlaserve::Kernel::kCount); ++k) {
    out[2 * k] = xlaserve::counters().ns[k].load();
    out[2 * k + 1] = xlaserve::counters().calls[k].load();
  }
}

void xlaserve_kernel_stats_reset() {
  for (int k = 0; k < static_cast<int>(xlaserve::Kernel::kCount); ++k) {
    xlaserve::counters().ns[k].store(0);
    xlaserve::counters().calls[k].store(0);
  }
}

}  // extern "C"
