// Ragged paged attention for the CPU backend: decode and prefill tokens of many sequences in one
// flat batch, reading the paged KV cache in place.
//
//   q             [T, H, D]        f32   query of every token in the step (RoPE applied)
//   k_cache       [L*N*bs, KVH, D] f32   the whole stacked cache, flat (the buffer the layer
//   v_cache       [L*N*bs, KVH, D] f32   loop carries: a 5-D reshape would be copied per layer)
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
// Scheme: consecutive tokens of one row are cut into query tiles of up to kQueryTile tokens; a
// work item is (tile, kv head) and covers the tile's tokens x the G = H / KVH query heads that
// share the kv head, so each K/V block is loaded once for all of them.  Items are spread over
// the workers (parallel.h).  An item walks the row's blocks from the first any of its queries sees
// to the last, and per block and query: scores of the bs keys (dot products, `Vec` lanes over
// D), masked to the query's window, then one online-softmax update (running max m, sum l,
// unnormalised output acc[D]; exp vectorised over the block's keys).  Out = acc / l.
// Positions beyond the table, and block ids outside [0, N), are clamped: a bad plan reads the
// wrong keys but never memory outside the cache.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "buffers.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int kQueryTile = 8;
constexpr int kMaxBlockSize = 256;

struct Geometry {
  int64_t T, H, KVH, D, G, R, W, N, bs;
  int64_t layer;
  float scale, soft_cap;
  int64_t window;  // 0 = no sliding window
};

struct Tile {
  int64_t t0, nq;  // tokens t0 .. t0 + nq - 1, all of one row
  int32_t row;
};

float dot(const float* a, const float* b, int64_t D) {
  const int64_t dv = D - D % kLanes;
  Vec s = zero();
  for (int64_t d = 0; d < dv; d += kLanes) s = fma(load(a + d), load(b + d), s);
  float r = hsum(s);
  for (int64_t d = dv; d < D; ++d) r += a[d] * b[d];
  return r;
}

// acc[0:D] = acc * c + sum_j p[j] * v_j, v_j at v + j * stride
void accumulate(float* acc, float c, const float* p, const float* v, int64_t stride, int64_t n,
                int64_t D) {
  const int64_t dv = D - D % kLanes;
  for (int64_t d = 0; d < dv; d += kLanes) {
    Vec a = mul(load(acc + d), splat(c));
    for (int64_t j = 0; j < n; ++j) a = fma(splat(p[j]), load(v + j * stride + d), a);
    store(acc + d, a);
  }
  for (int64_t d = dv; d < D; ++d) {
    float a = acc[d] * c;
    for (int64_t j = 0; j < n; ++j) a += p[j] * v[j * stride + d];
    acc[d] = a;
  }
}

// s[0:n] = cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
void soft_cap_scores(float* s, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

// p[0:n] = exp(s[0:n] - m), returns their sum; n <= kMaxBlockSize, -inf scores give 0.
float exp_block(const float* s, float m, float* p, int64_t n) {
  float sum = 0.0f;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Vec e = exp(sub(load(s + j), splat(m)));
    store(p + j, e);
    sum += hsum(e);
  }
  for (; j < n; ++j) {
    p[j] = std::exp(s[j] - m);
    sum += p[j];
  }
  return sum;
}

void attend_tile(const Geometry& g, const Tile& tile, int64_t kvh, const float* q,
                 const float* k_cache, const float* v_cache, const int32_t* positions,
                 const int32_t* block_tables, float* out) {
  const int64_t D = g.D, bs = g.bs, rows = tile.nq * g.G;
  const int64_t stride = g.KVH * D;  // floats between consecutive slots of one kv head
  const int64_t max_pos = g.W * bs - 1;
  thread_local std::vector<float> scratch;
  scratch.resize(rows * (2 * D + 2) + 2 * kMaxBlockSize);
  float* qs = scratch.data();        // [rows, D] scaled queries
  float* acc = qs + rows * D;        // [rows, D]
  float* m = acc + rows * D;         // [rows]
  float* l = m + rows;               // [rows]
  float* s = l + rows;               // [bs] scores of one query
  float* p = s + kMaxBlockSize;      // [bs] their exps
  int64_t lo = max_pos, hi = 0;
  std::vector<int64_t> qpos(tile.nq), qlo(tile.nq);
  for (int64_t i = 0; i < tile.nq; ++i) {
    const int64_t pos = std::clamp<int64_t>(positions[tile.t0 + i], 0, max_pos);
    qpos[i] = pos;
    qlo[i] = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1) : 0;
    lo = std::min(lo, qlo[i]);
    hi = std::max(hi, pos);
    for (int64_t h = 0; h < g.G; ++h) {
      const float* src = q + ((tile.t0 + i) * g.H + kvh * g.G + h) * D;
      float* dst = qs + (i * g.G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * g.scale;
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  const int32_t* table = block_tables + static_cast<int64_t>(tile.row) * g.W;
  for (int64_t b = lo / bs; b <= hi / bs; ++b) {
    const int64_t block = std::clamp<int64_t>(table[b], 0, g.N - 1);
    const int64_t base = ((g.layer * g.N + block) * bs) * stride + kvh * D;
    const float* kb = k_cache + base;
    const float* vb = v_cache + base;
    const int64_t first = b * bs;
    for (int64_t i = 0; i < tile.nq; ++i) {
      // keys of this block the query sees: [j0, j1)
      const int64_t j0 = std::max<int64_t>(0, qlo[i] - first);
      const int64_t j1 = std::min<int64_t>(bs, qpos[i] - first + 1);
      if (j1 <= j0) continue;
      for (int64_t h = 0; h < g.G; ++h) {
        const int64_t r = i * g.G + h;
        const float* qr = qs + r * D;
        for (int64_t j = j0; j < j1; ++j) s[j - j0] = dot(qr, kb + j * stride, D);
        const int64_t n = j1 - j0;
        if (g.soft_cap > 0.0f) soft_cap_scores(s, n, g.soft_cap);
        float block_max = s[0];
        for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, s[j]);
        const float m_new = std::max(m[r], block_max);
        const float correction = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
        l[r] = l[r] * correction + exp_block(s, m_new, p, n);
        m[r] = m_new;
        accumulate(acc + r * D, correction, p, vb + j0 * stride, stride, n, D);
      }
    }
  }
  for (int64_t i = 0; i < tile.nq; ++i)
    for (int64_t h = 0; h < g.G; ++h) {
      const int64_t r = i * g.G + h;
      float* dst = out + ((tile.t0 + i) * g.H + kvh * g.G + h) * D;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32, 3> q,
                          ffi::Buffer<ffi::F32, 3> k_cache, ffi::Buffer<ffi::F32, 3> v_cache,
                          ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 1> token_rows,
                          ffi::Buffer<ffi::S32, 1> positions,
                          ffi::Buffer<ffi::S32, 2> block_tables,
                          ffi::ResultBuffer<ffi::F32, 3> out, int64_t num_blocks,
                          int64_t block_size, float scale, float soft_cap,
                          int64_t sliding_window) {
  Geometry g;
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
  if (g.KVH <= 0 || g.H % g.KVH || k_cache.dimensions()[2] != g.D ||
      v_cache.dimensions()[0] != k_cache.dimensions()[0] ||
      v_cache.dimensions()[1] != g.KVH || v_cache.dimensions()[2] != g.D)
    return ffi::Error::InvalidArgument("xlaserve_paged_attention: q [T, H, D] and caches "
                                       "[L*N*bs, KVH, D] disagree");
  if (g.bs <= 0 || g.bs > kMaxBlockSize || g.N <= 0 || k_cache.dimensions()[0] % (g.N * g.bs))
    return ffi::Error::InvalidArgument("xlaserve_paged_attention: cache rows are not a "
                                       "multiple of num_blocks x block_size");
  g.G = g.H / g.KVH;
  const int64_t num_layers = k_cache.dimensions()[0] / (g.N * g.bs);
  g.layer = *layer.typed_data();
  if (g.layer < 0 || g.layer >= num_layers)
    return ffi::Error::InvalidArgument("xlaserve_paged_attention: layer out of range");
  if (token_rows.dimensions()[0] != g.T || positions.dimensions()[0] != g.T)
    return ffi::Error::InvalidArgument("xlaserve_paged_attention: token_rows and positions "
                                       "must have one entry per query token");
  const int32_t* rows = token_rows.typed_data();
  const int32_t* pos = positions.typed_data();
  float* o = out->typed_data();
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
    tiles.push_back({t, n, r});
    t += n;
  }
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const int32_t* bt = block_tables.typed_data();
  parallel_for(static_cast<int64_t>(tiles.size()) * g.KVH, [&](int64_t item) {
    attend_tile(g, tiles[item / g.KVH], item % g.KVH, qp, kp, vp, pos, bt, o);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttention, xlaserve::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_3>()  // q
                                  .Arg<xlaserve::F32_3>()  // k_cache
                                  .Arg<xlaserve::F32_3>()  // v_cache
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
