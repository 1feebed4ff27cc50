// RoPE and the KV-cache write of one layer, in one call (kernels/rope_kv_write.py).
//
//   q        [T, H, D]        f32   the step's queries, before RoPE
//   k        [T, KVH, D]      f32   its new keys, before RoPE
//   v        [T, KVH, D]      f32   its new values
//   cos, sin [T, D/2]         f32   each token's rotation (models/rope.rope_tables)
//   k_cache  [L*N*bs, KVH, D] f32   the whole stacked cache, flat; aliased to the k_cache out
//   v_cache  [L*N*bs, KVH, D] f32   aliased to the v_cache out
//   layer    []               i32
//   slots    [T]              i32   slot_mapping: the token's cell within a layer's N*bs rows
//   attr rows_per_layer = N*bs
//   -> q_out [T, H, D] (rotated), k_cache with row layer*N*bs + slots[t] = rope(k[t]),
//      v_cache with that row = v[t]
//
// Why: these were XLA's own small fusions between the q/k/v matmul and the attention call
// (the q rotation, a dynamic-update-slice per cache with its bounds check), five thunks a
// layer; one call writes the carried cache in place (on the Zen 5 box, BENCHMARKS.md, the
// step times measured level with XLA's fusions: the gain is the simpler step, not speed).
//
// RoPE is the "rotate half" layout: out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin,
// x1 = x[:D/2], x2 = x[D/2:], as kernels/rope_kv_write.rotate computes it.  A destination row
// outside the cache is skipped, a negative one counts from the end (the jnp path's .at[] with
// mode="drop": pipeline bubbles write nowhere).  The
// caches are written through the outputs, which XLA aliases to the inputs: in place when the
// layer loop hands over its carried buffer, a copy made by XLA otherwise.  Tokens are spread
// over the workers when a step has many (a 512-token prefill chunk), else one thread does all.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "buffers.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve {
namespace {

constexpr int64_t kTokensPerItem = 32;

// heads x D floats of one token, rotated by (cos, sin) [D/2] from `src` into `dst` (another
// buffer: q_out is not aliased to q, and k goes into the cache).
void rotate(const float* __restrict src, float* __restrict dst, int64_t heads, int64_t D,
            const float* __restrict cos, const float* __restrict sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * D;
    float* o = dst + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[half + i];
      o[i] = x1 * cos[i] - x2 * sin[i];
      o[half + i] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

template <typename A, typename B>
bool same_shape(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error RopeKvWrite(F32_3 q, F32_3 k, F32_3 v, F32_2 cos, F32_2 sin, F32_3 k_cache_in,
                       F32_3 v_cache_in, S32_0 layer, S32_1 slots,
                       ffi::Result<F32_3> q_out, ffi::Result<F32_3> k_cache,
                       ffi::Result<F32_3> v_cache, int64_t rows_per_layer) {
  const auto qd = q.dimensions(), kd = k.dimensions(), cd = k_cache_in.dimensions();
  const int64_t T = qd[0], H = qd[1], D = qd[2], KVH = kd[1];
  if (kd[0] != T || kd[2] != D || !same_shape(v.dimensions(), kd) || D % 2 ||
      cos.dimensions()[0] != T || cos.dimensions()[1] != D / 2 ||
      !same_shape(sin.dimensions(), cos.dimensions()) || slots.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("xlaserve_cpu_rope_kv_write: q [T, H, D], k and v [T, KVH, "
                                       "D], cos and sin [T, D/2], slots [T] disagree");
  if (cd[1] != KVH || cd[2] != D || !same_shape(v_cache_in.dimensions(), cd) || rows_per_layer <= 0 ||
      cd[0] % rows_per_layer)
    return ffi::Error::InvalidArgument("xlaserve_cpu_rope_kv_write: caches must be [L*N*bs, KVH, "
                                       "D] with L*N*bs a multiple of rows_per_layer");
  const int64_t total = cd[0];
  const int64_t base = static_cast<int64_t>(*layer.typed_data()) * rows_per_layer;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* cp = cos.typed_data();
  const float* sp = sin.typed_data();
  const int32_t* sl = slots.typed_data();
  float* qo = q_out->typed_data();
  float* kc = k_cache->typed_data();
  float* vc = v_cache->typed_data();
  const int64_t row = KVH * D;   // one token's K (or V) over its kv heads
  auto tokens = [&](int64_t item) {
    const int64_t t1 = std::min(T, (item + 1) * kTokensPerItem);
    for (int64_t t = item * kTokensPerItem; t < t1; ++t) {
      const float* c = cp + t * (D / 2);
      const float* s = sp + t * (D / 2);
      rotate(qp + t * H * D, qo + t * H * D, H, D, c, s);
      int64_t dest = base + sl[t];
      if (dest < 0) dest += total;   // as jnp's .at[] indexes from the end
      if (dest < 0 || dest >= total) continue;
      rotate(kp + t * row, kc + dest * row, KVH, D, c, s);
      std::memcpy(vc + dest * row, vp + t * row, row * sizeof(float));
    }
  };
  const int64_t items = (T + kTokensPerItem - 1) / kTokensPerItem;
  if (items > 1)
    parallel_for(items, tokens);
  else if (items == 1)
    tokens(0);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xlaserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuRopeKvWrite, xlaserve::RopeKvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<xlaserve::F32_3>()  // q
                                  .Arg<xlaserve::F32_3>()  // k
                                  .Arg<xlaserve::F32_3>()  // v
                                  .Arg<xlaserve::F32_2>()  // cos
                                  .Arg<xlaserve::F32_2>()  // sin
                                  .Arg<xlaserve::F32_3>()  // k_cache (aliased to out 1)
                                  .Arg<xlaserve::F32_3>()  // v_cache (aliased to out 2)
                                  .Arg<xlaserve::S32_0>()  // layer
                                  .Arg<xlaserve::S32_1>()  // slots
                                  .Ret<xlaserve::F32_3>()  // q_out
                                  .Ret<xlaserve::F32_3>()  // k_cache
                                  .Ret<xlaserve::F32_3>()  // v_cache
                                  .Attr<int64_t>("rows_per_layer"));
