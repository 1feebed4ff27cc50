// Ragged paged attention for the CPU backend: decode and prefill tokens of many sequences in one
// flat batch, reading the paged KV cache in place.
//
//   q             [T, H, D]        f32   query of every token in the step (RoPE applied)
//   k_cache       [L*N*bs, KVH, D] f32   the whole stacked cache, flat (the buffer the layer
//   v_cache       [L*N*bs, KVH, D] f32   loop carries: a 5-D reshape would be copied per layer),
//                 or f16 / bf16 (read in place for decode tokens, widened as they are loaded;
//                 widened into floats span by span for prefill tiles),
//                 or [L*N*bs, KVH, D + 4] s8: int8 rows, each followed by its float scale
//                 (kernels/kv_quant.py), dequantized span by span as they are read
//   layer         []               i32
//   token_rows    [T]              i32   the row (sequence) of each token; -1 = padding
//   positions     [T]              i32   the token's position in its sequence
//   block_tables  [R, W]           i32   each row's physical blocks
//   attrs: num_blocks N, block_size bs, scale, soft_cap (0 = off), sliding_window (0 = off)
//   -> out        [T, H, D]        f32   zeros for padding tokens
//
// Token t of row r at position p attends to row r's keys at positions
// max(0, p - window + 1) .. p (every key is in the cache already: the step writes its own
// tokens' KV before attending), key j read from slot (layer * N + table[r][j / bs]) * bs + j % bs.
//
// Scheme.  Consecutive tokens of one row are cut into query tiles of up to kQueryTile tokens.
// A work item is a tile and a run of its key blocks (a tile's blocks are split into several
// items when there are too few tiles to keep every thread busy, flash-decoding style; their
// partial softmax states are merged at the end, over the workers; a tile that is one item
// writes its output itself).  An item walks its blocks in order, a span of about kSpanKeys
// keys at a time, and for each span every kv head and the tile's query rows that read it
// (tokens x the G = H / KVH query heads sharing the kv head): one block's K and V for all
// heads are contiguous (bs x KVH x D floats), so an item streams them, reading each span's
// blocks ahead of the compute (only the blocks some token of the tile sees: on a prefill's
// diagonal that trims the span).  Per (span, kv head) the tile's query rows (up to kQueryTile x
// G) make two products.  Scores = q @ k^T: with at most kDirectRows rows (a decode token's G
// heads), each row against the keys in place, kLanes keys at a time (score_keys); with more, the
// keys are transposed once (kLanes x kLanes register transposes) and the rows run as register
// tiles, kSR rows x kSV vectors at a time (tile.h's accumulate_rows, as the weight matmuls),
// each key vector loaded once for kSR rows.  Then per row one online-softmax step over the
// span's visible keys (running max m, sum l, exp vectorised: per 16-key block it cost more
// than the scores), its invisible keys' p set to exactly 0; then acc = acc * c + p @ v, acc in
// registers over the span's keys (register tiles again).  Out = acc / l.  Items run
// longest first.  Measured on the Zen 5 box (BENCHMARKS.md, "Prefill attention as two
// products"): a 512-token prefill's attention 1.7-1.9 -> 1.0-1.1 ms a layer.
// Positions beyond the table, and block ids outside [0, N), are clamped: a bad plan reads the
// wrong keys but never memory outside the cache.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "buffers.h"
#include "parallel.h"
#include "simd.h"
#include "tile.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

// A 512-token prefill's attention a layer, tiles of kQueryTile tokens x spans of kSpanKeys
// keys: 16 x 64 1.14-1.22 ms, 16 x 128 1.10-1.17, 32 x 64 1.13-1.23, 32 x 128 1.06-1.10.
constexpr int kQueryTile = 32;
constexpr int kMaxBlockSize = 256;
constexpr int64_t kItemsPerThread = 2;
constexpr int64_t kMinChunkBlocks = 4;
constexpr int64_t kSpanKeys = 128;   // keys (whole blocks) one online-softmax step covers

struct Geometry {
  int64_t T, H, KVH, D, G, R, W, N, bs;
  int64_t layer;
  float scale, soft_cap;
  int64_t window;  // 0 = no sliding window
};

struct Tile {
  int64_t t0, nq;  // tokens t0 .. t0 + nq - 1, all of one row
  int32_t row;
  int64_t b_lo, b_hi;  // table entries [b_lo, b_hi) some token of the tile sees
};

struct Item {
  int64_t tile, b0, b1;  // blocks [b0, b1) of tiles[tile]
  int64_t part;          // which of the tile's items (0 when the tile is not split)
};

// The running softmax state of one query row.
struct RowState {
  float m, l;
  float* acc;  // [D]
};

// kt[d * ld + j] = k_j[d] for j < bs: the block's keys of one kv head (k_j at kb + j * stride),
// transposed so that one query's scores over the keys come out as vectors.
void transpose_keys(const float* kb, int64_t stride, int64_t bs, int64_t D, float* kt,
                    int64_t ld) {
  const int64_t jv = bs - bs % kLanes, dv = D - D % kLanes;
  for (int64_t j = 0; j < jv; j += kLanes)
    for (int64_t d = 0; d < dv; d += kLanes)
      transpose_tile(kb + j * stride + d, stride, kt + d * ld + j, ld);
  for (int64_t j = 0; j < bs; ++j)
    for (int64_t d = (j < jv ? dv : 0); d < D; ++d) kt[d * ld + j] = kb[j * stride + d];
}

// The register tiles of the two products (tile.h's accumulate_rows): up to kSR query rows x kSV
// vectors, of keys for the scores and of head dims for the values, held in registers: 6 x 4 on
// AVX-512, 6 x 2 on AVX2 (its 4 x 2 ran a 256-token prefill's attention, 30 layers, in 39 ms on
// the Zen 3 box, 6 x 2 in 25).
constexpr int kSR = 6;
constexpr int kSV = kVectorRegisters >= 32 ? 4 : 2;
// Spans with at most this many query rows a kv head score the keys in place (score_keys);
// more rows share one transposed copy of the keys (transpose_keys + ScoreTile).
constexpr int64_t kDirectRows = 8;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// s[r * ld + j] = q_r . k_j for MR query rows (q rows D apart) and NV vectors of keys (kt: as
// transpose_keys writes it, rows ld apart): each key vector is loaded once for the MR rows, each
// query element broadcast once for the NV vectors.
template <int MR, int NV>
struct ScoreTile {
  static void run(const float* q, int64_t D, const float* kt, int64_t ld, float* s) {
    Vec acc[MR][NV];
    for (auto& row : acc)
      for (auto& a : row) a = zero();
    accumulate_rows<MR, NV, 0, 0>(acc, q, D, kt, ld, 0, D);
    store_tile(acc, s, ld, nullptr);
  }
};

// s[j] = q . k_j for the span's keys j < keys, k_j at blocks[j / bs] + (j % bs) * stride (one kv
// head's rows, read in place), kLanes keys at a time: each key's products summed lane-wise over
// D, then the kLanes sums reduced at once (hsums).  Scores up to the next whole vector are
// written too (a key past `keys` is read as the last one; softmax_step masks them).  For the few
// query rows of a decode token (its G heads) this costs less than transposing the keys for the
// register tiles: a 32-row decode's attention at 700 keys, 30 layers, 55 -> 50 ms on the Zen 3
// box, 39 -> 31 ms with the keys in cache (/tmp/attn/bench2.py, BENCHMARKS.md).
template <typename T>
void score_keys(const float* q, int64_t D, const T* const* blocks, int64_t bs, int64_t stride,
                int64_t keys, float* s) {
  const int64_t dv = D - D % kLanes;
  const T* k[kLanes];
  for (int64_t j = 0; j < keys; j += kLanes) {
    if (bs % kLanes == 0) {   // the kLanes keys are in one block
      const T* first = blocks[j / bs] + j % bs * stride;
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) k[i] = first + std::min<int64_t>(i, keys - 1 - j) * stride;
    } else {
      for (int i = 0; i < kLanes; ++i) {
        const int64_t key = std::min<int64_t>(j + i, keys - 1);
        k[i] = blocks[key / bs] + key % bs * stride;
      }
    }
    Vec acc[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) acc[i] = zero();
    for (int64_t d = 0; d < dv; d += kLanes) {
      const Vec qv = load(q + d);
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) acc[i] = fma(qv, load_widened(k[i] + d), acc[i]);
    }
    store(s + j, hsums(acc));
    for (int64_t d = dv; d < D; ++d)   // head dims past the last whole vector
      for (int i = 0; i < kLanes; ++i) s[j + i] += q[d] * to_float(k[i][d]);
  }
}

// acc_r[d0 : d0 + NV * kLanes] = acc_r * c_r + sum_{j < n} p[r * ld + j] * v_j for MR rows,
// v_j = blocks[j / bs][(j % bs) * stride + d0 ...]: the span's value rows, block by block, of
// element type T (float, or a 16-bit cache's read in place).
template <typename T>
struct ValueTile {
  template <int MR, int NV>
  struct Of {
    static void run(float* const* acc, int64_t d0, const float* c, const float* p, int64_t ld,
                    const T* const* blocks, int64_t bs, int64_t stride, int64_t n) {
      Vec a[MR][NV];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) a[r][j] = mul(load(acc[r] + d0 + j * kLanes), splat(c[r]));
      for (int64_t x = 0; x * bs < n; ++x)
        accumulate_rows<MR, NV, 0, 0>(a, p + x * bs, ld, blocks[x] + d0, stride, 0,
                                      std::min(bs, n - x * bs));
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) store(acc[r] + d0 + j * kLanes, a[r][j]);
    }
  };
};

// kTiles<F>[mr - 1][nv - 1] = F<mr, nv>::run for every tile shape up to kSR x kSV.
template <template <int, int> class F, int MR, int... V>
constexpr auto tile_row(std::integer_sequence<int, V...>) {
  return std::array{&F<MR, V + 1>::run...};
}
template <template <int, int> class F, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array{tile_row<F, R + 1>(std::make_integer_sequence<int, kSV>())...};
}
template <template <int, int> class F>
constexpr auto kTiles = tile_table<F>(std::make_integer_sequence<int, kSR>());

// One online-softmax step of a row over its span's scores s[0:n] (n whole vectors), of which
// keys [j0, j1) are visible: new m and l, and s becomes p = exp(s - m) there and exactly 0
// elsewhere (the soft cap applied first); returns the factor the row's acc is rescaled by.
float softmax_step(RowState& st, float* s, int64_t n, int64_t j0, int64_t j1, float soft_cap) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  if (soft_cap > 0.0f)
    for (int64_t j = j0; j < j1; ++j) s[j] = soft_cap * std::tanh(s[j] / soft_cap);
  std::fill(s, s + j0, kMinusInf);
  std::fill(s + j1, s + n, kMinusInf);
  Vec mx = splat(kMinusInf);
  for (int64_t j = 0; j < n; j += kLanes) mx = max(mx, load(s + j));
  const float block_max = hmax(mx);
  const float m_new = std::max(st.m, block_max);
  const float correction = std::exp(st.m - m_new);  // 0 on the first span (m = -inf)
  for (int64_t j = 0; j < n; j += kLanes) store(s + j, exp(sub(load(s + j), splat(m_new))));
  std::fill(s, s + j0, 0.0f);   // exactly 0, not exp's floor (~1e-38): p . v over a span's
  std::fill(s + j1, s + n, 0.0f);   // every key then adds nothing for the invisible ones
  Vec sum = zero();
  for (int64_t j = 0; j < n; j += kLanes) sum = add(sum, load(s + j));
  st.l = st.l * correction + hsum(sum);
  st.m = m_new;
  return correction;
}

// dst[r * D + d] = q_r[d] * s_r for `rows` int8 rows of D values, each followed by the 4 bytes
// of its float scale s_r (kernels/kv_quant.py): one kv block, for the float code below.
void dequantize_rows(const int8_t* src, int64_t rows, int64_t D, float* dst) {
  const int64_t row_bytes = D + 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* row = src + r * row_bytes;
    float scale;
    std::memcpy(&scale, row + D, sizeof scale);
    const Vec sv = splat(scale);
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) store(dst + r * D + d, mul(load_widened(row + d), sv));
    for (; d < D; ++d) dst[r * D + d] = static_cast<float>(row[d]) * scale;
  }
}

// dst[i] = src[i] as a float for i < n: a run of 16-bit cache rows (halves or bfloat16s).
template <typename T>
void widen(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_widened(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// Reads the span's nb blocks of K and V (`elements` values each) so that they are in cache when
// the compute loops come: a tight run of loads streams from memory ~1.8x faster than the loads
// the compute issues.  One load per 64-byte line, line i of every block before line i + 1 (2 nb
// streams at once: 32 rows x 700 keys, 30 layers, 48.6 -> 46.8 ms against a block at a time),
// into four independent sums (one chain of adds made a span that is in L2 already cost as much
// as its scores); returns a sum nobody uses but the compiler cannot drop.
// A 16-bit cache's blocks are read as floats here (the sum is of their bits, and unused).
template <typename T>
float warm(const T* const* k, const T* const* v, int64_t nb, int64_t elements) {
  constexpr int64_t kLine = std::max(64 / static_cast<int>(sizeof(float)), kLanes);
  const int64_t floats = elements * static_cast<int64_t>(sizeof(T)) / 4;
  auto at = [](const T* block, int64_t i) {
    return load(reinterpret_cast<const float*>(block) + i);
  };
  Vec a = zero(), b = zero(), c = zero(), d = zero();
  for (int64_t i = 0; i + kLanes <= floats; i += kLine) {
    int64_t x = 0;
    for (; x + 2 <= nb; x += 2) {
      a = add(a, at(k[x], i));
      b = add(b, at(v[x], i));
      c = add(c, at(k[x + 1], i));
      d = add(d, at(v[x + 1], i));
    }
    if (x < nb) {
      a = add(a, at(k[x], i));
      b = add(b, at(v[x], i));
    }
  }
  return hsum(add(add(a, b), add(c, d)));
}

// The cache's element type, and its K and V (rows of D elements; D + 4 bytes for int8).
enum class CacheType { kF32, kF16, kBF16, kS8 };
struct Cache {
  CacheType type;
  const void* k;
  const void* v;
};

// dst [rows, D] = `rows` rows of a 16-bit or int8 cache's k or v (base) from `row` on, as
// floats (a float32 cache is read in place instead).
void to_floats(CacheType type, const void* base, int64_t row, int64_t rows, int64_t D,
               float* dst) {
  if (type == CacheType::kF16)
    widen(static_cast<const Half*>(base) + row * D, rows * D, dst);
  else if (type == CacheType::kBF16)
    widen(static_cast<const BFloat16*>(base) + row * D, rows * D, dst);
  else
    dequantize_rows(static_cast<const int8_t*>(base) + row * (D + 4), rows, D, dst);
}

// Attend the tile's tokens to blocks [b0, b1) of their row; states[i * H + h] is token i,
// query head h, already initialised (and left unnormalised).  Blocks go span_blocks at a time
// (a span of about kSpanKeys keys): one softmax step per query row and span, not per block
// (with 16-key blocks the per-step max, sum and rescale cost more than the scores).  Per span
// and kv head, its query rows (token i, group head g at row i * G + g) make two products:
// scores [rows, keys] = q [rows, D] @ keys^T, then acc [rows, D] += p @ values.
void attend_blocks(const Geometry& g, const Tile& tile, int64_t b0, int64_t b1, const float* q,
                   const Cache& cache, const int32_t* positions, const int32_t* block_tables,
                   RowState* states) {
  const int64_t D = g.D, bs = g.bs, G = g.G, nq = tile.nq;
  const int64_t stride = g.KVH * D;  // floats between consecutive slots of one kv head
  const int64_t max_pos = g.W * bs - 1;
  const int64_t block_floats = bs * stride;
  const int64_t span_blocks = std::max<int64_t>(1, kSpanKeys / bs);   // span: <= kMaxBlockSize
  const int64_t ld = round_up(span_blocks * bs, kLanes);   // score rows: whole key vectors
  const int64_t rows = nq * G;                             // query rows per kv head
  const int64_t dv = D - D % kLanes;                       // head dims in whole vectors
  thread_local std::vector<float> scratch;
  scratch.resize(g.KVH * rows * D + D * ld + rows * ld + rows +
                 (cache.type == CacheType::kF32 ? 0 : 2 * span_blocks * block_floats));
  float* qs = scratch.data();              // [KVH, nq * G, D] scaled queries, by kv head
  float* kt = qs + g.KVH * rows * D;       // [D, ld] one kv head's keys, transposed
  float* s = kt + D * ld;                  // [nq * G, ld] scores, then their exps
  float* c = s + rows * ld;                // [nq * G] each row's rescale factor this span
  float* kf = c + rows;                    // other caches: [span_blocks, bs, KVH, D] the
  float* vf = kf + span_blocks * block_floats;   // span's keys and values, as floats
  thread_local std::vector<float*> acc;    // [nq * G] each row's acc[D], for one kv head
  acc.resize(rows);
  int64_t qpos[kQueryTile], qlo[kQueryTile];
  for (int64_t i = 0; i < nq; ++i) {
    qpos[i] = std::clamp<int64_t>(positions[tile.t0 + i], 0, max_pos);
    qlo[i] = g.window > 0 ? std::max<int64_t>(0, qpos[i] - g.window + 1) : 0;
    for (int64_t h = 0; h < g.H; ++h) {
      const float* src = q + ((tile.t0 + i) * g.H + h) * D;
      float* dst = qs + ((h / G * nq + i) * G + h % G) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * g.scale;
    }
  }
  const int32_t* table = block_tables + static_cast<int64_t>(tile.row) * g.W;
  auto first_row = [&](int64_t b) {   // the block's first (slot, kv head) row in the cache
    const int64_t block = std::clamp<int64_t>(table[b], 0, g.N - 1);
    return (g.layer * g.N + block) * bs * g.KVH;
  };
  float sink = 0.0f;
  for (int64_t b = b0; b < b1; b += span_blocks) {
    const int64_t nb = std::min(span_blocks, b1 - b), n = nb * bs;   // this span: n keys
    // Token i sees keys [j0[i], j1[i]) of the span; tokens [i0, i1) see some, keys [0, keys).
    const int64_t first = b * bs;
    int64_t j0[kQueryTile], j1[kQueryTile], i0 = nq, i1 = 0, keys = 0;
    for (int64_t i = 0; i < nq; ++i) {
      j0[i] = std::max<int64_t>(0, qlo[i] - first);
      j1[i] = std::min<int64_t>(n, qpos[i] - first + 1);
      if (j1[i] <= j0[i]) continue;
      i0 = std::min(i0, i);
      i1 = i + 1;
      keys = std::max(keys, j1[i]);
    }
    if (i1 <= i0) continue;
    const int64_t width = round_up(keys, kLanes), r0 = i0 * G, r1 = i1 * G;
    const int64_t nread = (keys + bs - 1) / bs;   // the blocks some token sees
    const bool direct = r1 - r0 <= kDirectRows;
    // The products of kv head kvh over the span's blocks kb, vb (of the cache's element type,
    // or floats converted from it): scores, one softmax step a row, acc = acc * c + p @ v.
    auto kv_head = [&](const auto* const* kb, const auto* const* vb, int64_t kvh) {
      using T = std::decay_t<decltype(**kb)>;
      const float* qk = qs + kvh * rows * D;
      const T* kk[kSpanKeys];
      const T* vk[kSpanKeys];
      for (int64_t x = 0; x < nread; ++x) {
        kk[x] = kb[x] + kvh * D;
        vk[x] = vb[x] + kvh * D;
      }
      bool scored = false;
      if constexpr (std::is_same_v<T, float>) {
        if (!direct) {
          for (int64_t x = 0; x < nread; ++x)
            transpose_keys(kk[x], stride, bs, D, kt + x * bs, ld);
          for (int64_t r = r0; r < r1; r += kSR) {
            const int mr = static_cast<int>(std::min<int64_t>(kSR, r1 - r));
            for (int64_t j = 0; j < width; j += kSV * kLanes) {
              const int nv = static_cast<int>(std::min<int64_t>(kSV, (width - j) / kLanes));
              kTiles<ScoreTile>[mr - 1][nv - 1](qk + r * D, D, kt + j, ld, s + r * ld + j);
            }
          }
          scored = true;
        }
      }
      if (!scored)
        for (int64_t r = r0; r < r1; ++r)
          score_keys(qk + r * D, D, kk, bs, stride, keys, s + r * ld);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r / G;
        RowState& st = states[i * g.H + kvh * G + r % G];
        acc[r] = st.acc;
        if (j1[i] > j0[i]) {
          c[r] = softmax_step(st, s + r * ld, width, j0[i], j1[i], g.soft_cap);
        } else {   // this token sees none of the span's keys
          c[r] = 1.0f;
          std::fill(s + r * ld, s + r * ld + width, 0.0f);
        }
      }
      for (int64_t r = r0; r < r1; r += kSR) {
        const int mr = static_cast<int>(std::min<int64_t>(kSR, r1 - r));
        for (int64_t d = 0; d < dv; d += kSV * kLanes) {
          const int nv = static_cast<int>(std::min<int64_t>(kSV, (dv - d) / kLanes));
          kTiles<ValueTile<T>::template Of>[mr - 1][nv - 1](acc.data() + r, d, c + r,
                                                            s + r * ld, ld, vk, bs, stride, keys);
        }
        for (int64_t d = dv; d < D; ++d)   // head dims past the last whole vector
          for (int64_t k = r; k < r + mr; ++k) {
            float a = acc[k][d] * c[k];
            for (int64_t j = 0; j < keys; ++j)
              a += s[k * ld + j] * to_float(vk[j / bs][j % bs * stride + d]);
            acc[k][d] = a;
          }
      }
    };
    // Float32 blocks are read in place, and so are a 16-bit cache's for a few query rows (the
    // scores and values widen them as they load); the span's blocks are read into cache first.
    // The span's blocks (at most kSpanKeys, of one key each): [bs, KVH, D] values each.
    auto in_place = [&](const auto* k_cache, const auto* v_cache) {
      using T = std::decay_t<decltype(*k_cache)>;
      const T* kb[kSpanKeys];
      const T* vb[kSpanKeys];
      for (int64_t x = 0; x < nread; ++x) {
        const int64_t row = first_row(b + x);
        kb[x] = k_cache + row * D;
        vb[x] = v_cache + row * D;
      }
      sink += warm(kb, vb, nread, block_floats);
      for (int64_t kvh = 0; kvh < g.KVH; ++kvh) kv_head(kb, vb, kvh);
    };
    if (cache.type == CacheType::kF32) {
      in_place(static_cast<const float*>(cache.k), static_cast<const float*>(cache.v));
    } else if (direct && cache.type == CacheType::kF16) {
      in_place(static_cast<const Half*>(cache.k), static_cast<const Half*>(cache.v));
    } else if (direct && cache.type == CacheType::kBF16) {
      in_place(static_cast<const BFloat16*>(cache.k), static_cast<const BFloat16*>(cache.v));
    } else {   // int8 rows, or 16-bit ones for many query rows: converted into floats first
      const float* kb[kSpanKeys];
      const float* vb[kSpanKeys];
      for (int64_t x = 0; x < nread; ++x) {
        const int64_t row = first_row(b + x);
        kb[x] = kf + x * block_floats;
        vb[x] = vf + x * block_floats;
        to_floats(cache.type, cache.k, row, bs * g.KVH, D, kf + x * block_floats);
        to_floats(cache.type, cache.v, row, bs * g.KVH, D, vf + x * block_floats);
      }
      for (int64_t kvh = 0; kvh < g.KVH; ++kvh) kv_head(kb, vb, kvh);
    }
  }
  volatile float keep = sink;
  (void)keep;
}

// The geometry and cache of a call, or the error naming what disagrees.
ffi::Error read_geometry(ffi::Buffer<ffi::F32, 3> q, ffi::AnyBuffer k_cache,
                         ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32, 0> layer,
                         ffi::Buffer<ffi::S32, 1> token_rows, ffi::Buffer<ffi::S32, 1> positions,
                         ffi::Buffer<ffi::S32, 2> block_tables, int64_t num_blocks,
                         int64_t block_size, float scale, float soft_cap, int64_t sliding_window,
                         Geometry& g, Cache& cache) {
  g.T = q.dimensions()[0];
  g.H = q.dimensions()[1];
  g.D = q.dimensions()[2];
  g.KVH = k_cache.dimensions()[1];
  g.R = block_tables.dimensions()[0];
  g.W = block_tables.dimensions()[1];
  g.N = num_blocks;
  g.bs = block_size;
  g.scale = scale;
  g.soft_cap = soft_cap;
  g.window = sliding_window;
  cache = Cache{CacheType::kF32, k_cache.untyped_data(), v_cache.untyped_data()};
  switch (k_cache.element_type()) {
    case ffi::DataType::F32: break;
    case ffi::DataType::F16: cache.type = CacheType::kF16; break;
    case ffi::DataType::BF16: cache.type = CacheType::kBF16; break;
    case ffi::DataType::S8: cache.type = CacheType::kS8; break;
    default:
      return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: the caches must be "
                                         "f32, f16, bf16 or s8");
  }
  if (v_cache.element_type() != k_cache.element_type())
    return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: k_cache and v_cache "
                                       "element types differ");
  const bool int8 = cache.type == CacheType::kS8;
  const int64_t row = int8 ? g.D + 4 : g.D;   // an int8 row carries its scale
  if (k_cache.dimensions().size() != 3 || v_cache.dimensions().size() != 3 || g.KVH <= 0 ||
      g.H % g.KVH || k_cache.dimensions()[2] != row ||
      v_cache.dimensions()[0] != k_cache.dimensions()[0] ||
      v_cache.dimensions()[1] != g.KVH || v_cache.dimensions()[2] != row)
    return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: q [T, H, D] and caches "
                                       "[L*N*bs, KVH, D] (D + 4 for s8) disagree");
  if (g.bs <= 0 || g.bs > kMaxBlockSize || g.N <= 0 || g.W <= 0 ||
      k_cache.dimensions()[0] % (g.N * g.bs))
    return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: cache rows are not a "
                                       "multiple of num_blocks x block_size");
  g.G = g.H / g.KVH;
  const int64_t num_layers = k_cache.dimensions()[0] / (g.N * g.bs);
  g.layer = *layer.typed_data();
  if (g.layer < 0 || g.layer >= num_layers)
    return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: layer out of range");
  if (token_rows.dimensions()[0] != g.T || positions.dimensions()[0] != g.T)
    return ffi::Error::InvalidArgument("xlaserve_cpu_paged_attention: token_rows and "
                                       "positions must have one entry per query token");
  return ffi::Error::Success();
}

// Consecutive tokens of one row cut into tiles of up to kQueryTile, each with the table
// entries some token of it sees; padding tokens' outputs are zeroed here.  Adds the tiles'
// blocks to total_blocks.
std::vector<Tile> cut_tiles(const Geometry& g, const int32_t* rows, const int32_t* pos,
                            float* o, int64_t& total_blocks) {
  const int64_t max_pos = g.W * g.bs - 1;
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < g.T;) {
    const int32_t r = rows[t];
    if (r < 0 || r >= g.R) {  // padding (or a row id outside the table): zeros
      std::fill(o + t * g.H * g.D, o + (t + 1) * g.H * g.D, 0.0f);
      ++t;
      continue;
    }
    int64_t n = 1;
    while (t + n < g.T && n < kQueryTile && rows[t + n] == r) ++n;
    int64_t lo = max_pos, hi = 0;
    for (int64_t i = t; i < t + n; ++i) {
      const int64_t p = std::clamp<int64_t>(pos[i], 0, max_pos);
      lo = std::min(lo, g.window > 0 ? std::max<int64_t>(0, p - g.window + 1) : 0);
      hi = std::max(hi, p);
    }
    tiles.push_back({t, n, r, lo / g.bs, hi / g.bs + 1});
    total_blocks += hi / g.bs + 1 - lo / g.bs;
    t += n;
  }
  return tiles;
}

// The work items: every tile whole, unless that leaves threads idle; then long tiles are split
// into runs of about total / (kItemsPerThread x threads) blocks (at least kMinChunkBlocks).
// first_item[i] .. first_item[i + 1] - 1 are tile i's items.
std::vector<Item> plan_items(const std::vector<Tile>& tiles, int64_t total_blocks,
                             std::vector<int64_t>& first_item) {
  const int64_t want = kItemsPerThread * num_threads();
  const int64_t chunk = static_cast<int64_t>(tiles.size()) >= want ? 0 :
      std::max<int64_t>(kMinChunkBlocks, (total_blocks + want - 1) / want);
  std::vector<Item> items;
  first_item.assign(tiles.size() + 1, 0);
  for (size_t i = 0; i < tiles.size(); ++i) {
    first_item[i] = static_cast<int64_t>(items.size());
    const Tile& tl = tiles[i];
    const int64_t parts = chunk ? std::max<int64_t>(1, (tl.b_hi - tl.b_lo) / chunk) : 1;
    for (int64_t c = 0; c < parts; ++c)
      items.push_back({static_cast<int64_t>(i), tl.b_lo + (tl.b_hi - tl.b_lo) * c / parts,
                       tl.b_lo + (tl.b_hi - tl.b_lo) * (c + 1) / parts, c});
  }
  first_item[tiles.size()] = static_cast<int64_t>(items.size());
  return items;
}

// Runs every item over the workers, longest first (a prefill's last tiles see the most keys, so
// no thread is left with a long one at the end).  A tile that is one item writes its output;
// a split tile's items leave m, l, acc[D] per (token, head) in state, at item x kQueryTile x H
// rows of D + 2 floats.
void run_items(const Geometry& g, const std::vector<Tile>& tiles,
               const std::vector<Item>& items, const std::vector<int64_t>& first_item,
               const float* qp, const Cache& cache, const int32_t* pos, const int32_t* bt,
               float* state, float* o) {
  const int64_t row_floats = g.D + 2;
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return items[a].b1 - items[a].b0 > items[b].b1 - items[b].b0;
  });
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t x) {
    const int64_t it = order[x];
    const Item& item = items[it];
    const Tile& tile = tiles[item.tile];
    float* base = state + it * kQueryTile * g.H * row_floats;
    RowState rs[kQueryTile * 64];
    std::vector<RowState> big;
    RowState* st = rs;
    if (tile.nq * g.H > kQueryTile * 64) {
      big.resize(tile.nq * g.H);
      st = big.data();
    }
    for (int64_t r = 0; r < tile.nq * g.H; ++r) {
      st[r] = {-std::numeric_limits<float>::infinity(), 0.0f, base + r * row_floats + 2};
      std::fill(st[r].acc, st[r].acc + g.D, 0.0f);
    }
    attend_blocks(g, tile, item.b0, item.b1, qp, cache, pos, bt, st);
    if (first_item[item.tile + 1] - first_item[item.tile] == 1) {   // the whole tile: out
      for (int64_t r = 0; r < tile.nq * g.H; ++r) {
        float* dst = o + (tile.t0 * g.H + r) * g.D;
        const float inv = st[r].l > 0.0f ? 1.0f / st[r].l : 0.0f;
        for (int64_t d = 0; d < g.D; ++d) dst[d] = st[r].acc[d] * inv;
      }
      return;
    }
    for (int64_t r = 0; r < tile.nq * g.H; ++r) {
      base[r * row_floats] = st[r].m;
      base[r * row_floats + 1] = st[r].l;
    }
  });
}

// Merges the items of each split tile: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
void merge_split_tiles(const Geometry& g, const std::vector<Tile>& tiles,
                       const std::vector<int64_t>& first_item, const float* state, float* o) {
  const int64_t row_floats = g.D + 2;
  std::vector<int64_t> split;
  for (size_t i = 0; i < tiles.size(); ++i)
    if (first_item[i + 1] - first_item[i] > 1) split.push_back(static_cast<int64_t>(i));
  parallel_for(static_cast<int64_t>(split.size()), [&](int64_t x) {
    const int64_t i = split[x];
    const Tile& tile = tiles[i];
    for (int64_t r = 0; r < tile.nq * g.H; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t it = first_item[i]; it < first_item[i + 1]; ++it)
        M = std::max(M, state[(it * kQueryTile * g.H + r) * row_floats]);
      float* dst = o + (tile.t0 * g.H + r) * g.D;
      std::fill(dst, dst + g.D, 0.0f);
      float l = 0.0f;
      for (int64_t it = first_item[i]; it < first_item[i + 1]; ++it) {
        const float* src = state + (it * kQueryTile * g.H + r) * row_floats;
        if (src[1] == 0.0f) continue;  // this item saw no key of the row
        const float w = std::exp(src[0] - M);
        l += w * src[1];
        for (int64_t d = 0; d < g.D; ++d) dst[d] += w * src[2 + d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < g.D; ++d) dst[d] *= inv;
    }
  });
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32, 3> q,
                          ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> token_rows,
                          ffi::Buffer<ffi::S32, 1> positions,
                          ffi::Buffer<ffi::S32, 2> block_tables,
                          ffi::ResultBuffer<ffi::F32, 3> out, int64_t num_blocks,
                          int64_t block_size, float scale, float soft_cap,
                          int64_t sliding_window) {
  Geometry g;
  Cache cache{CacheType::kF32, nullptr, nullptr};
  ffi::Error bad = read_geometry(q, k_cache, v_cache, layer, token_rows, positions,
                                 block_tables, num_blocks, block_size, scale, soft_cap,
                                 sliding_window, g, cache);
  if (bad.failure()) return bad;
  const int32_t* pos = positions.typed_data();
  float* o = out->typed_data();
  int64_t total_blocks = 0;
  const std::vector<Tile> tiles = cut_tiles(g, token_rows.typed_data(), pos, o, total_blocks);
  std::vector<int64_t> first_item;
  const std::vector<Item> items = plan_items(tiles, total_blocks, first_item);
  // Per item and (token, head): m, l, acc[D].
  thread_local std::vector<float> state_buffer;   // reused: a fresh one per call page-faults
  state_buffer.resize(items.size() * kQueryTile * g.H * (g.D + 2));
  float* const state = state_buffer.data();       // (workers must not name the thread_local)
  run_items(g, tiles, items, first_item, q.typed_data(), cache, pos, block_tables.typed_data(),
            state, o);
  merge_split_tiles(g, tiles, first_item, state, o);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuPagedAttention, xlaserve::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_3>()  // q
                                  .Arg<ffi::AnyBuffer>()   // k_cache (f32, f16, bf16, s8)
                                  .Arg<ffi::AnyBuffer>()   // v_cache
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .Arg<xlaserve::S32_1>()  // token_rows
                                  .Arg<xlaserve::S32_1>()  // positions
                                  .Arg<xlaserve::S32_2>()  // block_tables
                                  .Ret<xlaserve::F32_3>()  // out
                                  .Attr<int64_t>("num_blocks")
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
