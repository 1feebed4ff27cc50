// Weight matmuls for the CPU backend, reading stacked layer weights in place (the weights as
// stored; packed panels, float32 or int8, are matmul_packed.cc's; the register tile, tile.h).
//
//   xlaserve_cpu_matmul      x [M, K] f32, layer [] i32, w_j [L, K, N_j] f32 (j = 1..n)
//                        -> y_j [M, N_j] = x @ w_j[layer]          (or w_j [K, N_j], no layer)
//   xlaserve_cpu_matmul_nt   x [M, K] f32, w [N, K] f32  -> y [M, N] = x @ w^T
//                        (the output head over a tied embedding table, stored [V, E])
//
// Why: under lax.scan over stacked weights XLA:CPU copies each layer's slice before its dot,
// and batch-1 dots run single-threaded.  Here the kernel takes the whole stack plus the layer
// index, so every weight byte is read once per step, straight from the stacked parameter.
//
// Scheme (matmul), M <= kStreamRows (decode of a few rows): memory-bound, so every thread
// streams contiguous weight rows.  Each w_j is cut along K into a few chunks per thread; a work
// item (j, chunk) accumulates x[:, chunk] @ w_j[chunk, :] into its own partial [M, N_j],
// four weight rows per pass over the partial (which stays in L1), and the caller adds the
// partials up.  Items run largest first.  (Cutting the columns instead makes each thread read
// 200-byte pieces of rows N floats apart: ~22 GB/s on the development box against ~32 GB/s.)
//
// Scheme (matmul), larger M: the output columns of all w_j are cut into tiles of kTileVecs
// vectors (48 floats on AVX-512); the tiles are spread over the workers (parallel.h).  A tile computes
// MR rows x kTileVecs vectors of y in registers while walking the K rows of its weight panel
// (so each weight element is loaded once per MR rows, and the panel stays in L2 for the next MR
// rows), prefetching the panel kPrefetchRows rows ahead: the rows are N floats apart, which
// defeats the hardware prefetcher at batch 1.  Column tails narrower than a tile use one-vector
// tiles, then scalar code.
//
// Scheme (matmul_nt): rows of w are dot products with rows of x; a tile holds NR w rows x MR x
// rows of lane-wise partial sums over K and reduces each at the end.  Work items are chunks of
// kNtRowsPerItem w rows.
//
// Accumulation is float32 in a different order from XLA's dot: results agree to ~1e-6 relative.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "buffers.h"
#include "parallel.h"
#include "simd.h"
#include "tile.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int kNtRowsPerItem = 64;
constexpr int64_t kPackRows = 64;    // from this many rows, weight panels are packed first

// One column tile [n0, n0 + width) of y = x @ w over all M rows, in row blocks of MR.
template <int NV>
void column_tile(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                 int64_t n0) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    tile_nn<kMaxRows, NV>(x + m * K, K, w + n0, N, y + m * N + n0, N, K);
  if (M - m >= 4) { tile_nn<4, NV>(x + m * K, K, w + n0, N, y + m * N + n0, N, K); m += 4; }
  if (M - m >= 2) { tile_nn<2, NV>(x + m * K, K, w + n0, N, y + m * N + n0, N, K); m += 2; }
  if (M - m >= 1) tile_nn<1, NV>(x + m * K, K, w + n0, N, y + m * N + n0, N, K);
}

// Full-width column tiles [n0_i, n0_i + kTileN) of one weight, for many rows (prefill): each
// tile's panel w[:, n0:n0 + kTileN] is copied once into a contiguous [K, kTileN] buffer (the
// panel's rows are N floats apart in w), then rows are run kMBlock at a time over all the
// tiles, so that the packed panels and one block of x stay in L2 together.
void packed_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                  const int64_t* n0, int64_t count) {
  thread_local std::vector<float> packed;
  packed.resize(count * K * kTileN);
  for (int64_t t = 0; t < count; ++t)
    for (int64_t k = 0; k < K; ++k)
      std::copy(w + k * N + n0[t], w + k * N + n0[t] + kTileN,
                packed.data() + (t * K + k) * kTileN);
  for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
    const int64_t rows = std::min<int64_t>(kMBlock, M - m0);
    for (int64_t t = 0; t < count; ++t) {
      const float* pw = packed.data() + t * K * kTileN;
      float* yt = y + m0 * N + n0[t];
      const float* xt = x + m0 * K;
      int64_t m = 0;
      for (; m + kMaxRows <= rows; m += kMaxRows)
        tile_nn<kMaxRows, kTileVecs>(xt + m * K, K, pw, kTileN, yt + m * N, N, K);
      for (; m < rows; ++m) tile_nn<1, kTileVecs>(xt + m * K, K, pw, kTileN, yt + m * N, N, K);
    }
  }
}

void scalar_columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                    int64_t n0, int64_t width) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n0 + width; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[k * N + n];
      y[m * N + n] = s;
    }
}

// partial[0:M, 0:N] = x[:, k0:k1] @ w[k0:k1, :] (x rows K apart, w rows N apart).
void stream_rows(const float* __restrict x, int64_t M, int64_t K, const float* __restrict w,
                 int64_t N, int64_t k0, int64_t k1, float* __restrict partial) {
  std::fill(partial, partial + M * N, 0.0f);
  const int64_t nv = N - N % kLanes;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const float* w0 = w + k * N;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    Vec s[kStreamRows][4];
    for (int64_t m = 0; m < M; ++m)
      for (int u = 0; u < 4; ++u) s[m][u] = splat(x[m * K + k + u]);
    // Each weight vector is loaded once for all M rows: the stream from memory never waits
    // for a pass over rows it has already brought in.
    for (int64_t n = 0; n < nv; n += kLanes) {
      const Vec v0 = load(w0 + n), v1 = load(w1 + n), v2 = load(w2 + n), v3 = load(w3 + n);
#pragma GCC unroll 4
      for (int64_t m = 0; m < kStreamRows; ++m) {
        if (m >= M) break;
        float* y = partial + m * N + n;
        Vec a = load(y);
        a = fma(s[m][0], v0, a);
        a = fma(s[m][1], v1, a);
        a = fma(s[m][2], v2, a);
        a = fma(s[m][3], v3, a);
        store(y, a);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K + k;
      float* y = partial + m * N;
      for (int64_t n = nv; n < N; ++n)
        y[n] += xr[0] * w0[n] + xr[1] * w1[n] + xr[2] * w2[n] + xr[3] * w3[n];
    }
  }
  for (; k < k1; ++k) {
    const float* wr = w + k * N;
    for (int64_t m = 0; m < M; ++m) {
      const float s = x[m * K + k];
      float* y = partial + m * N;
      for (int64_t n = 0; n < N; ++n) y[n] += s * wr[n];
    }
  }
}

struct ColumnTile {
  int operand;    // which w_j / y_j
  int64_t n0;     // first column
  int64_t width;  // kTileN, kLanes, or < kLanes (scalar tail)
};

std::vector<ColumnTile> column_tiles(int operand, int64_t N) {
  std::vector<ColumnTile> tiles;
  int64_t n = 0;
  for (; n + kTileN <= N; n += kTileN) tiles.push_back({operand, n, kTileN});
  for (; n + kLanes <= N; n += kLanes) tiles.push_back({operand, n, kLanes});
  if (n < N) tiles.push_back({operand, n, N - n});
  return tiles;
}

struct Operand {
  const float* w;  // this layer's [K, N] matrix
  float* y;        // [M, N]
  int64_t N;
};

// The small-M path (see the scheme above): items (operand, K chunk), partials, one sum.
void stream(const float* x, int64_t M, int64_t K, const std::vector<Operand>& ops) {
  struct Item {
    int operand;
    int64_t k0, k1;
    float* partial;
  };
  const int64_t chunks = std::min<int64_t>(kItemsPerThread * num_threads(),
                                           std::max<int64_t>(1, K / 16));
  thread_local std::vector<float> partials;
  int64_t need = 0;
  for (const Operand& o : ops) need += chunks * M * o.N;
  partials.resize(need);
  std::vector<Item> items;
  float* at = partials.data();
  for (size_t j = 0; j < ops.size(); ++j)
    for (int64_t c = 0; c < chunks; ++c, at += M * ops[j].N)
      items.push_back({static_cast<int>(j), K * c / chunks, K * (c + 1) / chunks, at});
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return ops[a.operand].N > ops[b.operand].N;
  });
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    const Operand& o = ops[it.operand];
    stream_rows(x, M, K, o.w, o.N, it.k0, it.k1, it.partial);
  });
  at = partials.data();
  for (const Operand& o : ops) {  // y = sum of the operand's chunk partials
    const int64_t size = M * o.N;
    std::copy(at, at + size, o.y);
    for (int64_t c = 1; c < chunks; ++c)
      for (int64_t i = 0; i < size; ++i) o.y[i] += at[c * size + i];
    at += chunks * size;
  }
}

ffi::Error Matmul(ffi::Buffer<ffi::F32, 2> x,
                  ffi::Buffer<ffi::S32, 0> layer, ffi::RemainingArgs weights,
                  ffi::RemainingRets outputs) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int32_t l = *layer.typed_data();
  if (weights.size() != outputs.size() || weights.size() == 0)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: one output per weight, at least one");
  std::vector<Operand> ops;
  std::vector<ColumnTile> tiles;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(j);
    auto y = outputs.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: weights and outputs must be f32");
    auto wd = w->dimensions();
    const int64_t rank = static_cast<int64_t>(wd.size());
    if ((rank != 2 && rank != 3) || wd[rank - 2] != K)
      return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: weight must be [L, K, N] or [K, N] "
                                         "with K = x.shape[1]");
    const int64_t N = wd[rank - 1];
    int64_t offset = 0;
    if (rank == 3) {
      if (l < 0 || l >= wd[0])
        return ffi::Error::InvalidArgument("xlaserve_cpu_matmul: layer out of range");
      offset = static_cast<int64_t>(l) * K * N;
    }
    ops.push_back({w->typed_data() + offset, (*y)->typed_data(), N});
    auto t = column_tiles(static_cast<int>(j), N);
    tiles.insert(tiles.end(), t.begin(), t.end());
  }
  const float* xp = x.typed_data();
  if (M <= kStreamRows) {
    stream(xp, M, K, ops);
    return ffi::Error::Success();
  }
  // Work items are runs of adjacent tiles, a few per thread: each thread then streams long
  // stretches of every weight row, which the hardware prefetcher follows.
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t items = std::min<int64_t>(num_tiles, kItemsPerThread * num_threads());
  parallel_for(items, [&](int64_t item) {
    const int64_t end = num_tiles * (item + 1) / items;
    for (int64_t i = num_tiles * item / items; i < end;) {
      const ColumnTile& t = tiles[i];
      const Operand& o = ops[t.operand];
      if (M >= kPackRows && t.width == kTileN) {   // a run of full tiles of one operand
        int64_t n0[64], count = 0;
        while (i < end && count < 64 && tiles[i].operand == t.operand &&
               tiles[i].width == kTileN)
          n0[count++] = tiles[i++].n0;
        packed_tiles(xp, M, K, o.w, o.N, o.y, n0, count);
        continue;
      }
      if (t.width == kTileN) column_tile<kTileVecs>(xp, M, K, o.w, o.N, o.y, t.n0);
      else if (t.width == kLanes) column_tile<1>(xp, M, K, o.w, o.N, o.y, t.n0);
      else scalar_columns(xp, M, K, o.w, o.N, o.y, t.n0, t.width);
      ++i;
    }
  });
  return ffi::Error::Success();
}

// y[m, n] for n in [n0, n1), m in [m0, m0 + MR): NR w rows at a time.
template <int MR, int NR>
void tile_nt(const float* __restrict x, const float* __restrict w, float* __restrict y,
             int64_t N, int64_t K, int64_t n) {
  Vec acc[NR][MR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[r][i] = zero();
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    Vec xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = load(x + i * K + k);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      Vec wv = load(w + (n + r) * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[r][i] = fma(xv[i], wv, acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) {
      float s = hsum(acc[r][i]);
      for (int64_t k = kv; k < K; ++k) s += x[i * K + k] * w[(n + r) * K + k];
      y[i * N + n + r] = s;
    }
}

template <int NR>
void nt_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
             int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_nt<4, NR>(x + m * K, w, y + m * N, N, K, n);
  if (M - m >= 2) { tile_nt<2, NR>(x + m * K, w, y + m * N, N, K, n); m += 2; }
  if (M - m >= 1) tile_nt<1, NR>(x + m * K, w, y + m * N, N, K, n);
}

ffi::Error MatmulNt(ffi::Buffer<ffi::F32, 2> x,
                    ffi::Buffer<ffi::F32, 2> w, ffi::ResultBuffer<ffi::F32, 2> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul_nt: w must be [N, K] with "
                                       "K = x.shape[1]");
  constexpr int NR = kVectorRegisters >= 32 ? 4 : 2;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t items = (N + kNtRowsPerItem - 1) / kNtRowsPerItem;
  parallel_for(items, [&](int64_t item) {
    const int64_t n1 = std::min(N, (item + 1) * kNtRowsPerItem);
    int64_t n = item * kNtRowsPerItem;
    for (; n + NR <= n1; n += NR) nt_rows<NR>(xp, M, K, wp, N, yp, n);
    for (; n < n1; ++n) nt_rows<1>(xp, M, K, wp, N, yp, n);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmul, xlaserve::Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()  // x
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .RemainingArgs()                  // w_j
                                  .RemainingRets());                // y_j

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmulNt, xlaserve::MatmulNt,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()   // x
                                  .Arg<xlaserve::F32_2>()   // w
                                  .Ret<xlaserve::F32_2>());  // y
