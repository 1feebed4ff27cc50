// The float vector the kernels are written in, for the ISA the library is compiled for
// (-march=native at build time):
//
//   AVX-512   Vec = 16 floats (__m512), 32 vector registers
//   AVX2+FMA  Vec =  8 floats (__m256), 16 vector registers
//   otherwise Vec =  4 floats, plain C++ the compiler vectorises as it can (NEON, SSE)
//
// Only what the kernels use: unaligned load/store (and loads of int8, IEEE half and bfloat16
// widened to floats), broadcast, fused multiply-add, divide, max, a horizontal sum and max (and
// the sums of kLanes vectors at once), a kLanes x kLanes transpose, a register pin
// (keep_in_register), and exp (range reduction + degree-6 Taylor polynomial, relative error
// ~2e-7 over the softmax's range; inputs below -87 give 0).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace xlaserve {

// The two 16-bit float formats a KV cache may hold, as their bits: IEEE binary16 (1 sign, 5
// exponent, 10 mantissa bits) and bfloat16 (float32's top half).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return from_bits(static_cast<uint32_t>(x.bits) << 16); }
// Exact: every binary16 value is a float32.  The exponent is rebiased 15 -> 127; subnormals
// (exponent 0) are mantissa x 2^-24; exponent 31 is inf or nan.
inline float to_float(Half x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float tiny = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -tiny : tiny;
}

#if defined(__AVX512F__)

constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
struct Vec {
  __m512 v;
};
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec splat(float s) { return {_mm512_set1_ps(s)}; }
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b+c
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline Vec round_nearest(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec scale_by_pow2(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n
// 16 int8 at p, widened to floats (weight panels stored as int8).
inline Vec load_widened(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 halves or bfloat16s at p, widened to floats (16-bit KV caches).
inline Vec load_widened(const Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec load_widened(const BFloat16* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}

// A no-op here: with 32 registers g++ keeps a tile's weight vectors in them (tile.h).
inline void keep_in_register(Vec&) {}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 16: unpacks of 32- then 64-bit
// pairs, then two rounds of 128-bit lane shuffles.
inline void transpose_tile(const float* src, int64_t src_stride, float* dst,
                           int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    _mm512_storeu_ps(dst + k * dst_stride, _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88));
    _mm512_storeu_ps(dst + (8 + k) * dst_stride, _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd));
    _mm512_storeu_ps(dst + (4 + k) * dst_stride, _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88));
    _mm512_storeu_ps(dst + (12 + k) * dst_stride,
                     _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
struct Vec {
  __m256 v;
};
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline Vec splat(float s) { return {_mm256_set1_ps(s)}; }
inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline float hsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline float hmax(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline Vec round_nearest(Vec a) {
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 8 int8 at p, widened to floats (weight panels stored as int8).
inline Vec load_widened(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
// 8 halves or bfloat16s at p, widened to floats (16-bit KV caches); halves through F16C where
// the CPU has it (every AVX2 CPU we know does; -march=x86-64-v3 includes it).
inline Vec load_widened(const Half* p) {
#if defined(__F16C__)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = to_float(p[i]);
  return {_mm256_load_ps(f)};
#endif
}
inline Vec load_widened(const BFloat16* p) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))};
}
inline Vec scale_by_pow2(Vec a, Vec n) {  // a * 2^n for integral n in [-127, 127]
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v),
                                                 _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(e))};
}

// Pins `a` in a register at this point: the compiler may no longer re-read its memory as an
// FMA's operand each time it is used (see tile.h's accumulate_rows).
inline void keep_in_register(Vec& a) { __asm__("" : "+x"(a.v)); }

// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 8.
inline void transpose_tile(const float* src, int64_t src_stride, float* dst,
                           int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * dst_stride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
    _mm256_storeu_ps(dst + (4 + k) * dst_stride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
  }
}

// Lane i of the result = hsum(a[i]), for 8 vectors: three rounds of pairwise horizontal adds
// (the third across the 128-bit halves).
#define XLASERVE_HAVE_HSUMS 1
inline Vec hsums(const Vec* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves: a0-3, a4-7
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                        _mm256_permute2f128_ps(u0, u1, 0x31))};
}

#else

constexpr int kLanes = 4;
constexpr int kVectorRegisters = 16;
struct Vec {
  float v[4];
};
inline Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void store(float* p, Vec a) { std::memcpy(p, a.v, sizeof a.v); }
inline Vec splat(float s) { return {{s, s, s, s}}; }
inline Vec zero() { return splat(0.0f); }
#define XLASERVE_LANEWISE(expr) Vec r; for (int i = 0; i < 4; ++i) r.v[i] = (expr); return r
inline Vec fma(Vec a, Vec b, Vec c) { XLASERVE_LANEWISE(a.v[i] * b.v[i] + c.v[i]); }
inline Vec add(Vec a, Vec b) { XLASERVE_LANEWISE(a.v[i] + b.v[i]); }
inline Vec sub(Vec a, Vec b) { XLASERVE_LANEWISE(a.v[i] - b.v[i]); }
inline Vec mul(Vec a, Vec b) { XLASERVE_LANEWISE(a.v[i] * b.v[i]); }
inline Vec div(Vec a, Vec b) { XLASERVE_LANEWISE(a.v[i] / b.v[i]); }
inline Vec max(Vec a, Vec b) { XLASERVE_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline Vec round_nearest(Vec a) { XLASERVE_LANEWISE(std::nearbyint(a.v[i])); }
inline Vec load_widened(const int8_t* p) { XLASERVE_LANEWISE(static_cast<float>(p[i])); }
inline Vec load_widened(const Half* p) { XLASERVE_LANEWISE(to_float(p[i])); }
inline Vec load_widened(const BFloat16* p) { XLASERVE_LANEWISE(to_float(p[i])); }
inline Vec scale_by_pow2(Vec a, Vec n) { XLASERVE_LANEWISE(std::ldexp(a.v[i], int(n.v[i]))); }
#undef XLASERVE_LANEWISE
inline float hsum(Vec a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
inline void transpose_tile(const float* src, int64_t src_stride, float* dst,
                           int64_t dst_stride) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}
inline float hmax(Vec a) { return std::fmax(std::fmax(a.v[0], a.v[1]), std::fmax(a.v[2], a.v[3])); }
inline void keep_in_register(Vec&) {}

#endif

// The same load for float weights, so kernels templated on the weight type read either.
inline Vec load_widened(const float* p) { return load(p); }

#ifndef XLASERVE_HAVE_HSUMS
// Lane i of the result = hsum(a[i]), for kLanes vectors: transposed through memory, then the
// rows added (AVX-512 and the 4-lane path; AVX2 has its own above).
inline Vec hsums(const Vec* a) {
  float t[kLanes * kLanes], u[kLanes * kLanes];
  for (int i = 0; i < kLanes; ++i) store(t + i * kLanes, a[i]);
  transpose_tile(t, kLanes, u, kLanes);
  Vec sum = load(u);
  for (int i = 1; i < kLanes; ++i) sum = add(sum, load(u + i * kLanes));
  return sum;
}
#endif
#undef XLASERVE_HAVE_HSUMS

// exp(x) lane by lane.  x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor polynomial to r^6
// (Horner), times 2^n.  Inputs are clamped to [-87.3, 88.3]; below that the true value is under
// float's normal range and the softmax adds it to a sum dominated by exp(0) = 1.
inline Vec exp(Vec x) {
  const Vec hi = splat(88.3762626647949f), lo = splat(-87.3365447504019f);
  x = max(x, lo);
  x = sub(x, max(sub(x, hi), zero()));  // min(x, hi) without a min primitive
  Vec n = round_nearest(mul(x, splat(1.44269504088896341f)));
  Vec r = fma(n, splat(-0.693359375f), x);           // Cody-Waite: ln2 split in two parts
  r = fma(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.0f / 720);
  p = fma(p, r, splat(1.0f / 120));
  p = fma(p, r, splat(1.0f / 24));
  p = fma(p, r, splat(1.0f / 6));
  p = fma(p, r, splat(0.5f));
  p = fma(p, r, splat(1.0f));
  p = fma(p, r, splat(1.0f));
  return scale_by_pow2(p, n);
}

}  // namespace xlaserve
