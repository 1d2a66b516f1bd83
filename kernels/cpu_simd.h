/* What the CPU kernels share (cpu_decode.c, cpu_ops.c): the element types, bf16 conversions as
   PyTorch rounds them, vectors of W floats over AVX-512, AVX2 + FMA or plain C (the loads widen bf16,
   int8 and int4 to fp32), a vector exp, the rotary embedding of a head and a softmax. */
#ifndef WEIR_CPU_SIMD_H
#define WEIR_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, I8 = 2, I4 = 3 };

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as PyTorch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Vectors of W floats; the loads widen bf16, int8 and int4 to fp32. */
#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(a) _mm512_set1_ps(a)
#define VLOAD_F32(p) _mm512_loadu_ps(p)
#define VLOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSUM(v) _mm512_reduce_add_ps(v)
typedef __m512i vi;
#define VLOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VLOW4(v) _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)))
#define VHIGH4(v) _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))
#define VLOAD_PAIR(p) _mm512_loadu_si512(p) /* W pairs of bf16 */
#define VPAIR_LO(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define VPAIR_HI(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)))
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(a) _mm256_set1_ps(a)
#define VLOAD_F32(p) _mm256_loadu_ps(p)
#define VLOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
typedef __m256i vi;
#define VLOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VLOW4(v) _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)))
#define VHIGH4(v) _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))
#define VLOAD_PAIR(p) _mm256_loadu_si256((const __m256i *)(p))
#define VPAIR_LO(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define VPAIR_HI(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)))
#else
#define W 1
typedef float vf;
#define VZERO() 0.0f
#define VSET1(a) (a)
#define VLOAD_F32(p) (*(p))
#define VLOAD_BF16(p) bf16_to_f32(*(p))
#define VLOAD_I8(p) ((float)*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VSTORE(p, v) (*(p) = (v))
#define VSUM(v) (v)
typedef uint32_t vi;
#define VLOAD_U8(p) ((uint32_t)*(p))
#define VLOW4(v) ((float)((v) & 15))
#define VHIGH4(v) ((float)((v) >> 4))
#define VLOAD_PAIR(p) ((uint32_t)(p)[0] | (uint32_t)(p)[1] << 16)
#define VPAIR_LO(v) bf16_to_f32((uint16_t)(v))
#define VPAIR_HI(v) bf16_to_f32((uint16_t)((v) >> 16))
#endif

#define SCALAR_F32(v) (v)
#define SCALAR_BF16(v) bf16_to_f32(v)

/* exp(x): 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2 (ln 2 in two parts), e^r by its
   Taylor series to r^6 (relative error ~1e-7, as libm's expf); AVX-512's scalef applies 2^n (large x
   give +inf, x below -87 e^-87). Elsewhere libm's expf, one value at a time. */
#if defined(__AVX512F__)
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 e = _mm512_set1_ps(1.0f / 720);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}
#endif

/* In place, a head of `d` rotated by the rotary tables' row (`sin`'s first half negated): x * cos +
   roll(x, d / 2) * sin, two products and a sum in fp32 (no FMA contraction under -std=c11), as PyTorch
   computes the same expression. */
static inline void rotate(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* In place, x = silu(x) = x / (1 + e^-x) over `n` floats, in fp32 (the vector exp where there is one). */
static inline void silu_(float *x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
#endif
    for (; i < n; i++) x[i] = x[i] / (1.0f + expf(-x[i]));
}

/* y = x / sqrt(mean(x^2) + eps) * weight over `n` floats, in fp32 (y may be x). Both the fused decode
   step and the eager forward's native op call this, so a row is normalised to the same bits either way. */
static inline void rms_norm_row(const float *x, const float *weight, float *y, int64_t n, float eps) {
    int64_t i = 0;
    vf acc[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
    for (; i + 4 * W <= n; i += 4 * W)
        for (int j = 0; j < 4; j++) acc[j] = VFMA(VLOAD_F32(x + i + j * W), VLOAD_F32(x + i + j * W), acc[j]);
    float ss = VSUM(acc[0]) + VSUM(acc[1]) + VSUM(acc[2]) + VSUM(acc[3]);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
}

/* s = softmax(s) over `len` scores; `stats`, where not NULL, gets the maximum and the sum of the
   exponentials, which is what merging softmaxes over parts of a sequence needs. */
static inline void softmax(float *s, int64_t len, float *stats) {
    float top = -INFINITY, total = 0.0f;
    int64_t t = 0;
#if defined(__AVX512F__)
    /* four running maxima: one chain of dependent max instructions ran at a quarter of the rate (a
       scalar loop, which the compiler does not vectorise, was 28% of prefill attention's time) */
    __m512 m[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                   _mm512_set1_ps(-INFINITY)};
    for (; t + 64 <= len; t += 64)
        for (int j = 0; j < 4; j++) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(s + t + 16 * j));
    for (; t + 16 <= len; t += 16) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(s + t));
    top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
#endif
    for (; t < len; t++) top = s[t] > top ? s[t] : top;
    t = 0;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top)));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < len; t++) total += s[t] = expf(s[t] - top);
    const float inv = 1.0f / total;
    for (t = 0; t < len; t++) s[t] *= inv;
    if (stats) stats[0] = top, stats[1] = total;
}

#endif /* WEIR_CPU_SIMD_H */
