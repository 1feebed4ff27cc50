// Weight matmuls for the CPU backend, reading stacked layer weights in place.
//
//   xlaserve_matmul      x [M, K] f32, layer [] i32, w_j [L, K, N_j] f32 (j = 1..n)
//                        -> y_j [M, N_j] = x @ w_j[layer]          (or w_j [K, N_j], no layer)
//   xlaserve_matmul_nt   x [M, K] f32, w [N, K] f32  -> y [M, N] = x @ w^T
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
#include "stats.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int kTileVecs = 3;
constexpr int kTileN = kTileVecs * kLanes;
constexpr int kMaxRows = kVectorRegisters >= 32 ? 8 : 4;  // MR: kMaxRows x 3 accumulators
// Software prefetch distance of a register tile, in weight rows ahead: kPrefetchRows for
// unpacked weights (rows N floats apart); on packed panels, measured on the development box
// (30 SmolLM2 layers), tiles of one or two rows stream at 31 GB/s with 6 rows ahead against
// 28-29 with 32, while four to eight rows want 32 (8 rows: 18 ms against 21).
constexpr int kPrefetchRows = 32;
constexpr int packed_prefetch_rows(int mr) { return mr <= 2 ? 6 : kPrefetchRows; }
constexpr int kNtRowsPerItem = 64;
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kStreamRows = 4;
constexpr int64_t kPackRows = 64;    // from this many rows, weight panels are packed first
constexpr int64_t kMBlock = 64;      // rows of x run over the packed panels at a time

// y[0:MR, 0:NV*kLanes] = x[0:MR, :] @ w[:, 0:NV*kLanes]; x rows ldx apart, w rows ldw apart.
// With `res` (rows ldy apart, as y), y = res + x @ w.
template <int MR, int NV, int PF = kPrefetchRows>
void tile_nn(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t ldw,
             float* __restrict y, int64_t ldy, int64_t K, const float* __restrict res = nullptr) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wr = w + k * ldw;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      __builtin_prefetch(wr + PF * ldw + j * kLanes, 0, 3);
    Vec wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = load(wr + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      Vec s = splat(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = fma(s, wv[j], acc[i][j]);
    }
  }
  if (res != nullptr) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        store(y + i * ldy + j * kLanes, add(acc[i][j], load(res + i * ldy + j * kLanes)));
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) store(y + i * ldy + j * kLanes, acc[i][j]);
}

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
  ScopedTimer timer(Kernel::kMatmul);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int32_t l = *layer.typed_data();
  if (weights.size() != outputs.size() || weights.size() == 0)
    return ffi::Error::InvalidArgument("xlaserve_matmul: one output per weight, at least one");
  std::vector<Operand> ops;
  std::vector<ColumnTile> tiles;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(j);
    auto y = outputs.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("xlaserve_matmul: weights and outputs must be f32");
    auto wd = w->dimensions();
    const int64_t rank = static_cast<int64_t>(wd.size());
    if ((rank != 2 && rank != 3) || wd[rank - 2] != K)
      return ffi::Error::InvalidArgument("xlaserve_matmul: weight must be [L, K, N] or [K, N] "
                                         "with K = x.shape[1]");
    const int64_t N = wd[rank - 1];
    int64_t offset = 0;
    if (rank == 3) {
      if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("xlaserve_matmul: layer out of range");
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

// -- packed weights ---------------------------------------------------------------------------
//
//   xlaserve_matmul_packed   x [M, K] f32, layer [] i32, p_j [L, T_j, K, kTileN] f32
//                            -> y_j [M, N_j] = x @ w_j[layer], T_j = ceil(N_j / kTileN)
//   xlaserve_matmul_packed_add    x [M, K], layer, residual [M, N], p [L, T, K, kTileN]
//                            -> y [M, N] = residual + x @ w[layer]      (o: the residual update)
//   xlaserve_matmul_packed_gated  gate [M, F], up [M, F] f32, layer [] i32, p [L, T, F, kTileN]
//                            [, residual [M, N]]
//                            -> y [M, N] = [residual +] (silu(gate) * up) @ w[layer]  (down)
//
// The same weights stored as column panels (kernels/matmul.py packs them once at load):
// p[l, t, k, c] = w[l, k, t * kTileN + c], zero past N.  A panel is one contiguous run of
// K x kTileN floats, so a tile streams it from memory at any M (no rows N floats apart), and
// the small-M and large-M paths become one: register tiles of up to kMaxRows rows walk the
// panel, rows taken kMBlock at a time so that x's block and the item's panels share L2.

int64_t tile_n() { return kTileN; }

// y[0:rows, n0:n0 + width) from one panel (plus res[...] when res is given: [rows, N] as y);
// width < kTileN for a weight's last tile.
void panel_rows(const float* x, int64_t rows, int64_t K, const float* panel, float* y,
                int64_t N, int64_t n0, const float* res) {
  const int64_t width = std::min<int64_t>(kTileN, N - n0);
  float tmp[kMaxRows * kTileN];
  auto run = [&](auto mr, int64_t m) {
    constexpr int MR = decltype(mr)::value;
    if (width == kTileN) {
      tile_nn<MR, kTileVecs, packed_prefetch_rows(MR)>(x + m * K, K, panel, kTileN,
                                                       y + m * N + n0, N, K,
                                                       res ? res + m * N + n0 : nullptr);
    } else {
      tile_nn<MR, kTileVecs, packed_prefetch_rows(MR)>(x + m * K, K, panel, kTileN, tmp,
                                                       kTileN, K);
      for (int i = 0; i < MR; ++i)
        for (int64_t c = 0; c < width; ++c)
          y[(m + i) * N + n0 + c] = tmp[i * kTileN + c] +
                                    (res ? res[(m + i) * N + n0 + c] : 0.0f);
    }
  };
  int64_t m = 0;
  for (; m + kMaxRows <= rows; m += kMaxRows) run(std::integral_constant<int, kMaxRows>(), m);
  if (rows - m >= 4) { run(std::integral_constant<int, 4>(), m); m += 4; }
  if (rows - m >= 2) { run(std::integral_constant<int, 2>(), m); m += 2; }
  if (rows - m >= 1) run(std::integral_constant<int, 1>(), m);
}

struct Panel {
  const float* p;    // [K, kTileN]
  float* y;          // [M, N]
  int64_t N, n0;
  const float* res;  // [M, N] added to y, or nullptr
};

// The panels of layer l of one packed weight wd = [L, T, K, kTileN] writing y [M, N]; an
// error message if the shapes do not fit.
const char* add_panels(const float* w, ffi::Span<const int64_t> wd, float* y, int64_t M,
                       int64_t N, int64_t ym, int64_t K, int32_t l, std::vector<Panel>& out,
                       const float* res = nullptr) {
  if (wd[2] != K || wd[3] != kTileN || wd[1] != (N + kTileN - 1) / kTileN || ym != M)
    return "panels must be [L, ceil(N / tile_n), K, tile_n] for x [M, K] and y [M, N]";
  if (l < 0 || l >= wd[0]) return "layer out of range";
  const float* base = w + static_cast<int64_t>(l) * wd[1] * K * kTileN;
  for (int64_t t = 0; t < wd[1]; ++t)
    out.push_back({base + t * K * kTileN, y, N, t * kTileN, res});
  return nullptr;
}

// Every panel's columns of y = x @ w for all M rows of x [M, K].
void run_panels(const float* xp, int64_t M, int64_t K, const std::vector<Panel>& panels) {
  const int64_t count = static_cast<int64_t>(panels.size());
  // Few rows: memory-bound, so long contiguous runs a thread; more rows: finer items balance.
  const int64_t per_thread = M <= kStreamRows ? 2 : kItemsPerThread;
  const int64_t items = std::min<int64_t>(count, per_thread * num_threads());
  parallel_for(items, [&](int64_t item) {
    const int64_t b = count * item / items, e = count * (item + 1) / items;
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock)
      for (int64_t i = b; i < e; ++i) {
        const Panel& p = panels[i];
        panel_rows(xp + m0 * K, std::min<int64_t>(kMBlock, M - m0), K, p.p, p.y + m0 * p.N,
                   p.N, p.n0, p.res ? p.res + m0 * p.N : nullptr);
      }
  });
}

ffi::Error MatmulPacked(ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S32, 0> layer,
                        ffi::RemainingArgs weights, ffi::RemainingRets outputs) {
  ScopedTimer timer(Kernel::kMatmul);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int32_t l = *layer.typed_data();
  if (weights.size() != outputs.size() || weights.size() == 0)
    return ffi::Error::InvalidArgument("xlaserve_matmul_packed: one output per weight");
  std::vector<Panel> panels;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::Buffer<ffi::F32, 4>>(j);
    auto y = outputs.get<ffi::Buffer<ffi::F32, 2>>(j);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("xlaserve_matmul_packed: weights [L, T, K, TN] f32, "
                                         "outputs [M, N] f32");
    auto yd = (*y)->dimensions();
    if (const char* bad = add_panels(w->typed_data(), w->dimensions(), (*y)->typed_data(), M,
                                     yd[1], yd[0], K, l, panels))
      return ffi::Error::InvalidArgument(std::string("xlaserve_matmul_packed: ") + bad);
  }
  run_panels(x.typed_data(), M, K, panels);
  return ffi::Error::Success();
}

// y = residual + x @ w[layer] (the residual stream's update by o or down, in one pass).
ffi::Error MatmulPackedAdd(ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S32, 0> layer,
                           ffi::Buffer<ffi::F32, 2> residual, ffi::Buffer<ffi::F32, 4> w,
                           ffi::ResultBuffer<ffi::F32, 2> y) {
  ScopedTimer timer(Kernel::kMatmul);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  auto yd = y->dimensions();
  if (residual.dimensions()[0] != yd[0] || residual.dimensions()[1] != yd[1])
    return ffi::Error::InvalidArgument("xlaserve_matmul_packed_add: residual must be [M, N] "
                                       "as y");
  std::vector<Panel> panels;
  if (const char* bad = add_panels(w.typed_data(), w.dimensions(), y->typed_data(), M, yd[1],
                                   yd[0], K, *layer.typed_data(), panels,
                                   residual.typed_data()))
    return ffi::Error::InvalidArgument(std::string("xlaserve_matmul_packed_add: ") + bad);
  run_panels(x.typed_data(), M, K, panels);
  return ffi::Error::Success();
}

// h[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i] for i in [0, n).
void silu_mul(const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  const Vec one = splat(1.0f);
  for (; i + kLanes <= n; i += kLanes) {
    const Vec gv = load(g + i);
    store(h + i, mul(div(gv, add(one, exp(sub(zero(), gv)))), load(u + i)));
  }
  for (; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// The MLP's down projection with its gate folded in: y = (silu(gate) * up) @ w[layer].  The
// gated activations are made once into a scratch [M, F] (over the workers when there are
// many), then the panels run as in MatmulPacked: XLA's fused silu runs on one thread and
// was ~17 ms of a 512-token prefill step.
ffi::Error MatmulPackedGated(ffi::Buffer<ffi::F32, 2> gate, ffi::Buffer<ffi::F32, 2> up,
                             ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::F32, 4> w,
                             ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32, 2> y) {
  ScopedTimer timer(Kernel::kMatmul);
  const int64_t M = gate.dimensions()[0], F = gate.dimensions()[1];
  if (up.dimensions()[0] != M || up.dimensions()[1] != F)
    return ffi::Error::InvalidArgument("xlaserve_matmul_packed_gated: gate and up must have "
                                       "one shape [M, F]");
  auto yd = y->dimensions();
  const float* res = nullptr;   // an optional residual [M, N], added to y
  if (rest.size() > 1)
    return ffi::Error::InvalidArgument("xlaserve_matmul_packed_gated: one residual at most");
  if (rest.size() == 1) {
    auto r = rest.get<ffi::Buffer<ffi::F32, 2>>(0);
    if (!r.has_value() || r->dimensions()[0] != yd[0] || r->dimensions()[1] != yd[1])
      return ffi::Error::InvalidArgument("xlaserve_matmul_packed_gated: residual must be "
                                         "[M, N] f32 as y");
    res = r->typed_data();
  }
  std::vector<Panel> panels;
  if (const char* bad = add_panels(w.typed_data(), w.dimensions(), y->typed_data(), M, yd[1],
                                   yd[0], F, *layer.typed_data(), panels, res))
    return ffi::Error::InvalidArgument(std::string("xlaserve_matmul_packed_gated: ") + bad);
  thread_local std::vector<float> scratch;   // the calling thread's: workers get `h`
  scratch.resize(M * F);
  float* h = scratch.data();
  const float* g = gate.typed_data();
  const float* u = up.typed_data();
  constexpr int64_t kRowsPerItem = 16;
  if (M <= kRowsPerItem) {
    silu_mul(g, u, h, M * F);
  } else {
    parallel_for((M + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
      const int64_t m0 = item * kRowsPerItem, m1 = std::min(M, m0 + kRowsPerItem);
      silu_mul(g + m0 * F, u + m0 * F, h + m0 * F, (m1 - m0) * F);
    });
  }
  run_panels(h, M, F, panels);
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
  ScopedTimer timer(Kernel::kMatmulNt);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K)
    return ffi::Error::InvalidArgument("xlaserve_matmul_nt: w must be [N, K] with K = x.shape[1]");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatmul, xlaserve::Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()  // x
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .RemainingArgs()                  // w_j
                                  .RemainingRets());                // y_j

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatmulPacked, xlaserve::MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()  // x
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .RemainingArgs()         // p_j
                                  .RemainingRets());       // y_j

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatmulPackedGated, xlaserve::MatmulPackedGated,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()     // gate
                                  .Arg<xlaserve::F32_2>()     // up
                                  .Arg<xlaserve::S32_0>()     // layer
                                  .Arg<xlaserve::F32_4>()     // p
                                  .RemainingArgs()            // [residual]
                                  .Ret<xlaserve::F32_2>());   // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatmulPackedAdd, xlaserve::MatmulPackedAdd,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()     // x
                                  .Arg<xlaserve::S32_0>()     // layer
                                  .Arg<xlaserve::F32_2>()     // residual
                                  .Arg<xlaserve::F32_4>()     // p
                                  .Ret<xlaserve::F32_2>());   // y

extern "C" int64_t xlaserve_matmul_tile_n() { return xlaserve::tile_n(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatmulNt, xlaserve::MatmulNt,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()   // x
                                  .Arg<xlaserve::F32_2>()   // w
                                  .Ret<xlaserve::F32_2>());  // y
