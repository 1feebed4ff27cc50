// The register tile every weight matmul is built from, and the constants of its blocking.
//
//   tile_nn<MR, NV>(x, w, y):  y[0:MR, 0:NV*kLanes] (=|+=) x[0:MR, :] @ w[:, 0:NV*kLanes]
//
// MR rows x NV vectors of y live in registers while the tile walks the K rows of w, so each
// weight element is loaded once per MR rows.
//
//   tile_nn_grouped<MR, NV>(x, q, s, y):  the same over an int8 weight in groups of G rows,
//                                          w[k, c] = q[k, c] * s[k / G, c]
//
// Each group's sums are kept apart in a second set of registers and added in times the group's
// scales (y = sum_g s_g * (x_g @ q_g), the value of x @ w up to float rounding); q is widened
// to floats as it is loaded, so the memory stream is a quarter of float32's (plus the scales,
// one float per G weights).
#pragma once

#include <cstdint>

#include "simd.h"

namespace xlaserve {

// The largest tile, kMaxRows x kTileVecs accumulators, leaves registers for the kTileVecs weight
// vectors of a K row and one broadcast of x: 8 x 3 of AVX-512's 32, 6 x 2 of AVX2's 16.  A 4 x 3
// tile on AVX2 fills all 16, so the compiler re-reads each weight vector as an FMA's memory
// operand (12 loads a K row instead of 3): 42 GFLOP/s a core on a Zen 3 box against 6 x 2's 97,
// of a 100 GFLOP/s FMA peak (/tmp microbenchmark: one layer's gate, 256 rows, one thread).
constexpr int kTileVecs = kVectorRegisters >= 32 ? 3 : 2;
constexpr int kTileN = kTileVecs * kLanes;
constexpr int kMaxRows = kVectorRegisters >= 32 ? 8 : 6;  // MR
// Software prefetch distance of a register tile, in float32 weight rows ahead: kPrefetchRows
// for unpacked weights (rows N floats apart); on packed panels, measured on the development box
// (30 SmolLM2 layers), tiles of one or two rows stream at 31 GB/s with 6 rows ahead against
// 28-29 with 32, while four to eight rows want 32 (8 rows: 18 ms against 21).  An int8 panel's
// rows are a quarter as long, so it prefetches four times as many rows ahead (the same bytes).
constexpr int kPrefetchRows = 32;
constexpr int packed_prefetch_rows(int mr) { return mr <= 2 ? 6 : kPrefetchRows; }
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kStreamRows = 4;
constexpr int64_t kMBlock = 64;      // rows of x run over the packed panels at a time

// Whether a tile pins its K row's weight vectors in registers.  Tuned for znver3, g++ 12 makes
// each of a 4 x 2 tile's FMAs re-read its weight vector from memory (8 loads and 4 broadcasts a
// K row for 8 FMAs: load-bound), though registers are free; pinned, the loads are 2.  With fewer
// than four registers to spare (6 x 2 on AVX2) a pin makes the compiler spill: those tiles are
// left as compiled.  /tmp microbenchmark, one thread, gate at 256 rows on the Zen 3 box: 4 x 2
// 48-65 -> 94-97 GFLOP/s; 6 x 2 ~100 unpinned, ~78 pinned.  (keep_in_register is a no-op on
// AVX-512, whose tiles of 4 rows and more the compiler already keeps in registers.)
template <int MR, int NV>
constexpr bool kPinWeights = MR * NV + NV + 1 <= kVectorRegisters - 4;

// acc[i][j] (+)= x[i, k0:k1] @ w[k0:k1, j-th vector] for the tile's MR rows and NV vectors.
template <int MR, int NV, int64_t kAhead, int kPrefetches, typename WT>
inline void accumulate_rows(Vec (&acc)[MR][NV], const float* __restrict x, int64_t ldx,
                            const WT* __restrict w, int64_t ldw, int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    const WT* wr = w + k * ldw;
#pragma GCC unroll 4
    for (int j = 0; j < kPrefetches; ++j)
      __builtin_prefetch(wr + kAhead * ldw + j * kLanes, 0, 3);
    Vec wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      Vec w = load_widened(wr + j * kLanes);   // pinned as a copy: pinning wv[j] itself makes
      if constexpr (kPinWeights<MR, NV>) keep_in_register(w);   // the arrays memory, and every
      wv[j] = w;                               // acc is stored each K row (ValueTile's loop)
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      Vec s = splat(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = fma(s, wv[j], acc[i][j]);
    }
  }
}

// y[0:MR, 0:NV*kLanes] (= or res +) acc, y and res rows ldy apart.
template <int MR, int NV>
inline void store_tile(const Vec (&acc)[MR][NV], float* __restrict y, int64_t ldy,
                       const float* __restrict res) {
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
  accumulate_rows<MR, NV, PF, NV>(acc, x, ldx, w, ldw, 0, K);
  store_tile(acc, y, ldy, res);
}

// The same over int8 q (rows ldw bytes apart) in groups of G rows, scale rows lds floats apart:
// y = [res +] sum_g (x[:, g] @ q[g, :]) * s[g, :].  MR <= 4: the group's sums take a second
// MR x NV registers.  An int8 row is a quarter of a float row, so the prefetch runs four times
// as many rows ahead (the same bytes), one prefetch a row (a row is under a cache line).
template <int MR, int NV, int PF>
void tile_nn_grouped(const float* __restrict x, int64_t ldx, const int8_t* __restrict q,
                     int64_t ldw, const float* __restrict scale, int64_t lds, int64_t G,
                     float* __restrict y, int64_t ldy, int64_t K,
                     const float* __restrict res = nullptr) {
  static_assert(MR <= 4, "a grouped tile holds two sets of MR x NV sums");
  Vec acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = zero();
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    Vec part[MR][NV];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) part[i][j] = zero();
    accumulate_rows<MR, NV, 4 * PF, 1>(part, x, ldx, q, ldw, g0, g0 + G);
    const float* sr = scale + (g0 / G) * lds;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const Vec sv = load(sr + j * kLanes);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = fma(part[i][j], sv, acc[i][j]);
    }
  }
  store_tile(acc, y, ldy, res);
}

}  // namespace xlaserve
