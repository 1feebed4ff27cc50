// Weight matmuls over packed panels, float32 or int8 (weight-only quantized).
//
//   xlaserve_cpu_matmul_packed   x [M, K] f32, layer [] i32, rows [] i32, then per weight j:
//                            p_j [L, T_j, K, TN]
//                            (f32, or s8 followed by its scales s_j [L, T_j, K / G, TN] f32)
//                            -> y_j [M, N_j] = x @ w_j[layer], T_j = ceil(N_j / TN)
//   xlaserve_cpu_matmul_packed_normed x [M, K], layer, rows, norm [L, K] f32, then p_j [, s_j];
//                            attr eps -> y_j = rms_norm(x, norm[layer]) @ w_j[layer]  (q/k/v
//                            and gate/up take the layer's pre-norm in the same call)
//   xlaserve_cpu_matmul_packed_add    x [M, K], layer, rows, residual [M, N], p [L, T, K, TN] [, s]
//                            -> y [M, N] = residual + x @ w[layer]      (o: the residual update)
//   xlaserve_cpu_matmul_packed_gated  gate [M, F], up [M, F] f32, layer, rows, p [L, T, F, TN]
//                            [, s] [, residual [M, N]]
//                            -> y [M, N] = [residual +] (silu(gate) * up) @ w[layer]  (down)
//
// `rows`: only x's first `rows` rows are computed (clamped to [0, M]); y's later rows are zeros.
// A step's flat batch is padded at its end up to the bucket's T (serving/runner/host_step.py),
// so the padding costs no FMAs (a 157-token prompt in the 256 bucket: 39% of the work).
//
// The weights are stored as column panels (kernels/matmul.py packs them once at load):
// p[l, t, k, c] = w[l, k, t * TN + c], zero past N, TN = kTileN.  A panel is one contiguous run
// of K x TN elements, so a tile streams it from memory at any M (no rows N floats apart): register
// tiles of up to kMaxRows rows (tile.h) walk the panel, rows taken kMBlock at a time so that x's
// block and the item's panels share L2.
//
// An int8 panel holds q = round(w / s) in groups of G consecutive rows of K (s[l, t, g, c] =
// max |w[l, gG:(g+1)G, t * TN + c]| / 127, kernels/quantized.py), G = K / s.shape[2]; a decode
// step streams a quarter of the float32 bytes plus one scale per G weights (see run_panels).  Accumulation is float32
// either way, in a different order from XLA's dot: ~1e-6 relative to the jnp reference.

#include <algorithm>
#include <cmath>
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

// Up to this many rows, int8 panels run grouped tiles (4 rows each: the first streams the panel
// from memory, the others find it in L1); more rows dequantize each panel once per row block.
constexpr int64_t kGroupedRows = 16;
// An item's dequantized panels, kept for all its row blocks, up to this many bytes (in L2).
constexpr int64_t kDequantizedBytes = 2 << 20;

// Runs `tile(mr, m, dst, ldd, res)` over rows [0, rows) of one panel's columns [n0, n0 + width)
// of y [rows, N] (res: [rows, N] added, or nullptr): register tiles of kMaxRows, 4, 2, 1 rows
// (at most `max_rows`); a last panel narrower than kTileN writes through a scratch tile.
template <int kTop, typename Tile>
void over_rows(int64_t rows, float* y, int64_t N, int64_t n0, const float* res, Tile tile) {
  const int64_t width = std::min<int64_t>(kTileN, N - n0);
  float tmp[kMaxRows * kTileN];
  auto run = [&](auto mr, int64_t m) {
    constexpr int MR = decltype(mr)::value;
    if (width == kTileN) {
      tile(mr, m, y + m * N + n0, N, res ? res + m * N + n0 : nullptr);
      return;
    }
    tile(mr, m, tmp, kTileN, nullptr);
    for (int i = 0; i < MR; ++i)
      for (int64_t c = 0; c < width; ++c)
        y[(m + i) * N + n0 + c] = tmp[i * kTileN + c] + (res ? res[(m + i) * N + n0 + c] : 0.0f);
  };
  int64_t m = 0;
  for (; m + kTop <= rows; m += kTop) run(std::integral_constant<int, kTop>(), m);
  if (kTop > 4 && rows - m >= 4) { run(std::integral_constant<int, 4>(), m); m += 4; }
  if (rows - m >= 2) { run(std::integral_constant<int, 2>(), m); m += 2; }
  if (rows - m >= 1) run(std::integral_constant<int, 1>(), m);
}

// y[0:rows, n0:n0 + width) [+ res] from one float panel [K, kTileN].
void panel_rows(const float* x, int64_t rows, int64_t K, const float* panel, float* y,
                int64_t N, int64_t n0, const float* res) {
  over_rows<kMaxRows>(rows, y, N, n0, res, [&](auto mr, int64_t m, float* dst, int64_t ldd,
                                                const float* r) {
    constexpr int MR = decltype(mr)::value;
    tile_nn<MR, kTileVecs, packed_prefetch_rows(MR)>(x + m * K, K, panel, kTileN, dst, ldd, K,
                                                     r);
  });
}

// The same from an int8 panel q [K, kTileN] with its group scales [K / G, kTileN].
void panel_rows_grouped(const float* x, int64_t rows, int64_t K, const int8_t* q,
                        const float* scale, int64_t G, float* y, int64_t N, int64_t n0,
                        const float* res) {
  over_rows<4>(rows, y, N, n0, res, [&](auto mr, int64_t m, float* dst, int64_t ldd,
                                         const float* r) {
    constexpr int MR = decltype(mr)::value;
    tile_nn_grouped<MR, kTileVecs, packed_prefetch_rows(MR)>(x + m * K, K, q, kTileN, scale,
                                                             kTileN, G, dst, ldd, K, r);
  });
}

struct Panel {
  const void* p;       // [K, kTileN] float, or int8 when `scale` is set
  const float* scale;  // [K / group, kTileN] the int8 panel's scales; nullptr for float panels
  int64_t group;       // rows of K per scale (int8 panels)
  float* y;            // [M, N]
  int64_t N, n0;
  const float* res;    // [M, N] added to y, or nullptr
};

// One packed weight as the handlers receive it: the panels and, for int8, their scales.
struct PackedArg {
  const void* panels = nullptr;   // [L, T, K, kTileN] f32, or s8 when `scales` is set
  int64_t dims[4] = {};
  const float* scales = nullptr;  // [L, T, K / group, kTileN] for s8, else nullptr
  int64_t group = 0;
};

// Take the packed weight starting at args[i] (and its scales at args[i + 1] when it is int8),
// advancing i past them; an error message when the buffers do not fit.
const char* next_packed(ffi::RemainingArgs& args, size_t& i, PackedArg& out) {
  auto p = args.get<ffi::AnyBuffer>(i++);
  if (!p.has_value()) return "a weight argument is missing";
  auto wd = p->dimensions();
  if (wd.size() != 4) return "packed weights must be [L, T, K, tile_n]";
  out.panels = p->untyped_data();
  std::copy(wd.begin(), wd.end(), out.dims);
  out.scales = nullptr;
  if (p->element_type() == ffi::DataType::F32) return nullptr;
  if (p->element_type() != ffi::DataType::S8) return "packed weights must be f32 or s8";
  if (i >= args.size()) return "an s8 weight must be followed by its scales";
  auto s = args.get<ffi::Buffer<ffi::F32, 4>>(i++);
  if (!s.has_value()) return "the scales of an s8 weight must be [L, T, K / group, tile_n] f32";
  auto sd = s->dimensions();
  if (sd[0] != wd[0] || sd[1] != wd[1] || sd[3] != wd[3] || sd[2] < 1 || wd[2] % sd[2] != 0)
    return "the scales of an s8 weight [L, T, K, tile_n] must be [L, T, K / group, tile_n] "
           "with the group dividing K";
  out.scales = s->typed_data();
  out.group = wd[2] / sd[2];
  return nullptr;
}

// The panels of layer l of one packed weight writing y [M, N]; an error message if the shapes
// do not fit.
const char* add_panels(const PackedArg& w, float* y, int64_t M, int64_t N, int64_t ym,
                       int64_t K, int32_t l, std::vector<Panel>& out,
                       const float* res = nullptr) {
  const int64_t* wd = w.dims;
  if (wd[2] != K || wd[3] != kTileN || wd[1] != (N + kTileN - 1) / kTileN || ym != M)
    return "panels must be [L, ceil(N / tile_n), K, tile_n] for x [M, K] and y [M, N]";
  if (l < 0 || l >= wd[0]) return "layer out of range";
  const int64_t panel = K * kTileN, first = static_cast<int64_t>(l) * wd[1];
  for (int64_t t = 0; t < wd[1]; ++t) {
    if (w.scales == nullptr) {
      const float* base = static_cast<const float*>(w.panels);
      out.push_back({base + (first + t) * panel, nullptr, 0, y, N, t * kTileN, res});
    } else {
      const int8_t* base = static_cast<const int8_t*>(w.panels);
      const int64_t scales = K / w.group * kTileN;   // one panel's
      out.push_back({base + (first + t) * panel, w.scales + (first + t) * scales, w.group, y,
                     N, t * kTileN, res});
    }
  }
  return nullptr;
}

// out[k, :] = q[k, :] * s[k / G, :] for a panel's K rows of kTileN: the weight it stands for.
void dequantize_panel(const int8_t* q, const float* scale, int64_t K, int64_t G, float* out) {
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kTileVecs; ++j)
      store(out + k * kTileN + j * kLanes, mul(load_widened(q + k * kTileN + j * kLanes),
                                               load(scale + (k / G) * kTileN + j * kLanes)));
}

// Every panel's columns of y = x @ w for all M rows of x [M, K].  An int8 panel is widened in
// registers by grouped tiles when the rows are few (decode: the stream is what counts), or
// dequantized once per block of rows into a float copy that stays in L2 while the block's
// float tiles walk it (prefill: the FMAs are what counts, and the grouped tile adds work to
// each and runs four rows at most).
void run_panels(const float* xp, int64_t M, int64_t K, const std::vector<Panel>& panels) {
  const int64_t count = static_cast<int64_t>(panels.size());
  // Few rows: memory-bound, so long contiguous runs a thread; more rows: finer items balance.
  const int64_t per_thread = M <= kStreamRows ? 2 : kItemsPerThread;
  const int64_t items = std::min<int64_t>(count, per_thread * num_threads());
  parallel_for(items, [&](int64_t item) {
    thread_local std::vector<float> widened;   // int8 panels as floats, [K, kTileN] each
    const int64_t b = count * item / items, e = count * (item + 1) / items;
    const int64_t panel_floats = K * kTileN;
    // Several row blocks over int8 panels: dequantize the item's panels once, for every
    // block, when they fit the budget (each block would dequantize them again: 8 times for a
    // 512-token chunk, +11% on its step); else once per block and panel.
    const bool once = M > kMBlock && panels[b].scale != nullptr &&
                      (e - b) * panel_floats * 4 <= kDequantizedBytes;
    if (once) {
      widened.resize((e - b) * panel_floats);
      for (int64_t i = b; i < e; ++i)
        dequantize_panel(static_cast<const int8_t*>(panels[i].p), panels[i].scale, K,
                         panels[i].group, widened.data() + (i - b) * panel_floats);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock)
      for (int64_t i = b; i < e; ++i) {
        const Panel& p = panels[i];
        const int64_t rows = std::min<int64_t>(kMBlock, M - m0);
        float* y = p.y + m0 * p.N;
        const float* res = p.res ? p.res + m0 * p.N : nullptr;
        if (p.scale == nullptr) {
          panel_rows(xp + m0 * K, rows, K, static_cast<const float*>(p.p), y, p.N, p.n0, res);
        } else if (once) {
          panel_rows(xp + m0 * K, rows, K, widened.data() + (i - b) * panel_floats, y, p.N,
                     p.n0, res);
        } else if (rows <= kGroupedRows) {   // widened in registers
          panel_rows_grouped(xp + m0 * K, rows, K, static_cast<const int8_t*>(p.p), p.scale,
                             p.group, y, p.N, p.n0, res);
        } else {   // dequantized once for the block's tiles, into L2
          widened.resize(panel_floats);
          dequantize_panel(static_cast<const int8_t*>(p.p), p.scale, K, p.group,
                           widened.data());
          panel_rows(xp + m0 * K, rows, K, widened.data(), y, p.N, p.n0, res);
        }
      }
  });
}

// x's rows in use, `rows` clamped to [0, M].
int64_t rows_in_use(ffi::Buffer<ffi::S32, 0> rows, int64_t M) {
  return std::clamp<int64_t>(*rows.typed_data(), 0, M);
}

// y = x @ w over x's first `used` rows of M (run_panels), zeros in y's rows [used, M).
void run_used_rows(const float* xp, int64_t used, int64_t M, int64_t K,
                   const std::vector<Panel>& panels) {
  run_panels(xp, used, K, panels);
  for (const Panel& p : panels) {
    const int64_t width = std::min<int64_t>(kTileN, p.N - p.n0);
    for (int64_t m = used; m < M; ++m) std::fill_n(p.y + m * p.N + p.n0, width, 0.0f);
  }
}

// The panels of every (weight, output) pair of `weights` / `outputs` for x [M, K] at layer l;
// an error message naming `name` when they do not fit.
const char* collect_panels(ffi::RemainingArgs& weights, ffi::RemainingRets& outputs, int64_t M,
                           int64_t K, int32_t l, std::vector<Panel>& panels) {
  size_t i = 0, j = 0;
  for (; i < weights.size(); ++j) {
    PackedArg w;
    if (const char* bad = next_packed(weights, i, w)) return bad;
    if (j >= outputs.size()) return "one output per weight";
    auto y = outputs.get<ffi::Buffer<ffi::F32, 2>>(j);
    if (!y.has_value()) return "one output [M, N] f32 per weight";
    auto yd = (*y)->dimensions();
    if (const char* bad = add_panels(w, (*y)->typed_data(), M, yd[1], yd[0], K, l, panels))
      return bad;
  }
  if (j == 0 || j != outputs.size()) return "one output per weight";
  return nullptr;
}

ffi::Error MatmulPacked(ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S32, 0> layer,
                        ffi::Buffer<ffi::S32, 0> rows, ffi::RemainingArgs weights,
                        ffi::RemainingRets outputs) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  std::vector<Panel> panels;
  if (const char* bad = collect_panels(weights, outputs, M, K, *layer.typed_data(), panels))
    return ffi::Error::InvalidArgument(std::string("xlaserve_cpu_matmul_packed: ") + bad);
  run_used_rows(x.typed_data(), rows_in_use(rows, M), M, K, panels);
  return ffi::Error::Success();
}

// f(m0, m1) over rows [0, M) of a matmul's prologue (the norm, the silu gate): on the calling
// thread for up to 16 rows, else in items of 16 rows over the workers (a row is always one
// item's, whatever M).
template <typename F>
void by_row_items(int64_t M, F f) {
  constexpr int64_t kRowsPerItem = 16;
  if (M <= kRowsPerItem) {
    f(0, M);
    return;
  }
  parallel_for((M + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const int64_t m0 = item * kRowsPerItem;
    f(m0, std::min(M, m0 + kRowsPerItem));
  });
}

// h[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w for rows [m0, m1) of x [M, K]: RMSNorm
// as models/llama.py's reference computes it (the mean of squares in float32; the sum's order
// differs from XLA's, ~1 ulp).  Each row is one thread's, whatever M: batch invariant.
void rms_norm_rows(const float* x, const float* w, float eps, int64_t K, int64_t m0,
                   int64_t m1, float* h) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    Vec acc = zero();
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) acc = fma(load(xr + k), load(xr + k), acc);
    float ss = hsum(acc);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    const Vec iv = splat(inv);
    float* hr = h + m * K;
    for (k = 0; k + kLanes <= K; k += kLanes) store(hr + k, mul(mul(load(xr + k), iv),
                                                                load(w + k)));
    for (; k < K; ++k) hr[k] = xr[k] * inv * w[k];
  }
}

// y_j = rms_norm(x, norm[layer]) @ w_j[layer]: the layer's pre-norm made into a scratch [M, K]
// (over the workers when the rows are many), then the panels as in MatmulPacked.  XLA ran
// each norm as four small single-threaded fusions, eight a layer.
ffi::Error MatmulPackedNormed(ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S32, 0> layer,
                              ffi::Buffer<ffi::S32, 0> rows, ffi::Buffer<ffi::F32, 2> norm,
                              ffi::RemainingArgs weights,
                              ffi::RemainingRets outputs, float eps) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int32_t l = *layer.typed_data();
  if (norm.dimensions()[1] != K || l < 0 || l >= norm.dimensions()[0])
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul_packed_normed: norm must be [L, K] "
                                       "for x [M, K], with the layer in [0, L)");
  std::vector<Panel> panels;
  if (const char* bad = collect_panels(weights, outputs, M, K, l, panels))
    return ffi::Error::InvalidArgument(std::string("xlaserve_cpu_matmul_packed_normed: ") + bad);
  thread_local std::vector<float> scratch;   // the calling thread's: workers get `h`
  const int64_t used = rows_in_use(rows, M);
  scratch.resize(used * K);
  float* h = scratch.data();
  const float* w = norm.typed_data() + static_cast<int64_t>(l) * K;
  by_row_items(used, [&](int64_t m0, int64_t m1) {
    rms_norm_rows(x.typed_data(), w, eps, K, m0, m1, h);
  });
  run_used_rows(h, used, M, K, panels);
  return ffi::Error::Success();
}

// y = residual + x @ w[layer] (the residual stream's update by o or down, in one pass).
ffi::Error MatmulPackedAdd(ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S32, 0> layer,
                           ffi::Buffer<ffi::S32, 0> rows, ffi::Buffer<ffi::F32, 2> residual,
                           ffi::RemainingArgs rest,
                           ffi::ResultBuffer<ffi::F32, 2> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  auto yd = y->dimensions();
  if (residual.dimensions()[0] != yd[0] || residual.dimensions()[1] != yd[1])
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul_packed_add: residual must be [M, N] "
                                       "as y");
  size_t i = 0;
  PackedArg w;
  const char* bad = next_packed(rest, i, w);
  if (bad == nullptr && i != rest.size()) bad = "one weight only";
  std::vector<Panel> panels;
  if (bad == nullptr)
    bad = add_panels(w, y->typed_data(), M, yd[1], yd[0], K, *layer.typed_data(), panels,
                     residual.typed_data());
  if (bad)
    return ffi::Error::InvalidArgument(std::string("xlaserve_cpu_matmul_packed_add: ") + bad);
  run_used_rows(x.typed_data(), rows_in_use(rows, M), M, K, panels);
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
                             ffi::Buffer<ffi::S32, 0> layer, ffi::Buffer<ffi::S32, 0> rows,
                             ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32, 2> y) {
  const int64_t M = gate.dimensions()[0], F = gate.dimensions()[1];
  if (up.dimensions()[0] != M || up.dimensions()[1] != F)
    return ffi::Error::InvalidArgument("xlaserve_cpu_matmul_packed_gated: gate and up must have "
                                       "one shape [M, F]");
  auto yd = y->dimensions();
  size_t i = 0;
  PackedArg w;
  const char* bad = next_packed(rest, i, w);
  const float* res = nullptr;   // an optional residual [M, N], added to y
  if (bad == nullptr && i < rest.size()) {
    auto r = rest.get<ffi::Buffer<ffi::F32, 2>>(i++);
    if (!r.has_value() || r->dimensions()[0] != yd[0] || r->dimensions()[1] != yd[1])
      bad = "residual must be [M, N] f32 as y";
    else
      res = r->typed_data();
  }
  if (bad == nullptr && i != rest.size()) bad = "one weight and one residual at most";
  std::vector<Panel> panels;
  if (bad == nullptr)
    bad = add_panels(w, y->typed_data(), M, yd[1], yd[0], F, *layer.typed_data(), panels, res);
  if (bad)
    return ffi::Error::InvalidArgument(std::string("xlaserve_cpu_matmul_packed_gated: ") + bad);
  thread_local std::vector<float> scratch;   // the calling thread's: workers get `h`
  const int64_t used = rows_in_use(rows, M);
  scratch.resize(used * F);
  float* h = scratch.data();
  const float* g = gate.typed_data();
  const float* u = up.typed_data();
  by_row_items(used, [&](int64_t m0, int64_t m1) {
    silu_mul(g + m0 * F, u + m0 * F, h + m0 * F, (m1 - m0) * F);
  });
  run_used_rows(h, used, M, F, panels);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmulPacked, xlaserve::MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()  // x
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .Arg<xlaserve::S32_0>()  // rows
                                  .RemainingArgs()         // p_j [, s_j]
                                  .RemainingRets());       // y_j

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmulPackedNormed, xlaserve::MatmulPackedNormed,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()  // x
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .Arg<xlaserve::S32_0>()  // rows
                                  .Arg<xlaserve::F32_2>()  // norm [L, K]
                                  .RemainingArgs()         // p_j [, s_j]
                                  .RemainingRets()         // y_j
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmulPackedGated, xlaserve::MatmulPackedGated,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()     // gate
                                  .Arg<xlaserve::F32_2>()     // up
                                  .Arg<xlaserve::S32_0>()     // layer
                                  .Arg<xlaserve::S32_0>()     // rows
                                  .RemainingArgs()            // p [, s] [, residual]
                                  .Ret<xlaserve::F32_2>());   // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuMatmulPackedAdd, xlaserve::MatmulPackedAdd,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_2>()     // x
                                  .Arg<xlaserve::S32_0>()     // layer
                                  .Arg<xlaserve::S32_0>()     // rows
                                  .Arg<xlaserve::F32_2>()     // residual
                                  .RemainingArgs()            // p [, s]
                                  .Ret<xlaserve::F32_2>());   // y

extern "C" int64_t xlaserve_cpu_matmul_tile_n() { return xlaserve::kTileN; }
