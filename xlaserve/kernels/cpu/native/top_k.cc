// The k largest values of each row, for the sampler on the CPU backend.
//
//   x [B, V] f32  ->  values [B, k] f32 (descending), indices [B, k] i32
//
// Why: XLA:CPU lowers lax.top_k of a [32, 49152] batch to a full sort of every row inside the
// sampler's graph (~260 ms), longer than the model step; here one pass over a row keeps a
// min-heap of its k best, so a value below the heap's smallest costs one comparison.
// Ties keep the lower index first (as lax.top_k does; -0.0 ties with 0.0 here, XLA puts it
// below); NaN compares below every number.
// Rows are spread over the workers (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "buffers.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// (value, index) ordered by value, ties by the lower index first; NaN lowest.
bool better(float a, int32_t ia, float b, int32_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return !na && nb ? true : (na && nb ? ia < ib : false);
  return a > b || (a == b && ia < ib);
}

void top_k_row(const float* x, int64_t V, int64_t k, float* values, int32_t* indices) {
  using Entry = std::pair<float, int32_t>;
  // heap top = the worst entry kept
  auto worse_first = [](const Entry& a, const Entry& b) {
    return better(a.first, a.second, b.first, b.second);
  };
  thread_local std::vector<Entry> heap;
  heap.clear();
  for (int64_t i = 0; i < V; ++i) {
    const Entry e{x[i], static_cast<int32_t>(i)};
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), worse_first);
    } else if (better(e.first, e.second, heap.front().first, heap.front().second)) {
      std::pop_heap(heap.begin(), heap.end(), worse_first);
      heap.back() = e;
      std::push_heap(heap.begin(), heap.end(), worse_first);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), worse_first);   // best first
  for (int64_t j = 0; j < k; ++j) {
    values[j] = heap[j].first;
    indices[j] = heap[j].second;
  }
}

ffi::Error TopK(ffi::Buffer<ffi::F32, 2> x, ffi::ResultBuffer<ffi::F32, 2> values,
                ffi::ResultBuffer<ffi::S32, 2> indices) {
  const int64_t B = x.dimensions()[0], V = x.dimensions()[1], k = values->dimensions()[1];
  if (k < 1 || k > V || values->dimensions()[0] != B || indices->dimensions()[0] != B ||
      indices->dimensions()[1] != k)
    return ffi::Error::InvalidArgument("xlaserve_cpu_top_k: outputs must be [B, k], 1 <= k <= V");
  const float* xp = x.typed_data();
  float* vp = values->typed_data();
  int32_t* ip = indices->typed_data();
  parallel_for(B, [&](int64_t b) { top_k_row(xp + b * V, V, k, vp + b * k, ip + b * k); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuTopK, xlaserve::TopK,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()    // x
                                  .Ret<xlaserve::F32_2>()    // values
                                  .Ret<xlaserve::S32_2>());  // indices
