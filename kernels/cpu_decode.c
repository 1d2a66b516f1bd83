/* One decode step of a few sequences through a Llama-family model, in one call, on the CPU.

   A lone stream's decode step is 30-ish layers of small ops: in eager PyTorch each costs 5-30 us of
   dispatch and threading overhead, which for a 135M model is as much time as streaming the weights.
   Here the whole step (embedding, every layer's norm, fused QKV, RoPE, paged-cache write, attention,
   output projection, SwiGLU MLP, final norm, head) runs in one OpenMP parallel region, so the only
   costs left are the weight reads and a few barriers per layer.

   Layouts match the engine's (engine/model.py, engine/quant.py): row-major [out, in] weights, fp32 /
   bf16 / int8 with one fp32 scale per output row / int4 packed two per byte with a scale and zero point
   per group; a paged KV cache [blocks, block_size, kv_heads, head_dim] in fp32 or
   bf16; RoPE tables [max_pos, head_dim] in HF's rotate-half form with the first half of `sin` negated.
   Activations are fp32 throughout; bf16 values are widened on load and K/V rounded to nearest-even on
   store. The PyTorch reference is the engine's own forward (tests/kernels/test_cpu_decode.py).

   Built at first use by kernels/cpu_decode.py with -O3 -march=native -fopenmp; it links the same
   libgomp.so.1 that PyTorch loaded, so it shares PyTorch's thread pool. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, I8 = 2, I4 = 3 };
#define MAX_BATCH 64 /* sequences per call */
#define TILE_MIN_BATCH 4 /* from this many sequences the GEMVs run on 4x4 tiles */

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

/* Vectors of W floats; the loads widen bf16 and int8 to fp32. */
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
typedef int vi;
#define VLOAD_U8(p) ((int)*(p))
#define VLOW4(v) ((float)((v) & 15))
#define VHIGH4(v) ((float)((v) >> 4))
#endif

#define SCALAR_F32(v) (v)
#define SCALAR_BF16(v) bf16_to_f32(v)
#define SCALAR_I8(v) ((float)(v))

/* dot(row, x) with four accumulators over consecutive vectors. One row at a time, front to back: the
   same GEMV over four rows interleaved (four streams K elements apart) read bf16 weights at 10-11
   GB/s on one Zen 4 core, row by row at 23-29 (a plain sum: 22-27). */
#define DEFINE_DOT(NAME, T, VLOAD, SCALAR)                                                   \
    static float NAME(const T *r, const float *x, int64_t k) {                              \
        vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();                           \
        int64_t i = 0;                                                                       \
        for (; i + 4 * W <= k; i += 4 * W) {                                                 \
            a0 = VFMA(VLOAD(r + i), VLOAD_F32(x + i), a0);                                   \
            a1 = VFMA(VLOAD(r + i + W), VLOAD_F32(x + i + W), a1);                           \
            a2 = VFMA(VLOAD(r + i + 2 * W), VLOAD_F32(x + i + 2 * W), a2);                   \
            a3 = VFMA(VLOAD(r + i + 3 * W), VLOAD_F32(x + i + 3 * W), a3);                   \
        }                                                                                    \
        for (; i + W <= k; i += W) a0 = VFMA(VLOAD(r + i), VLOAD_F32(x + i), a0);            \
        float s = VSUM(a0) + VSUM(a1) + VSUM(a2) + VSUM(a3);                                 \
        for (; i < k; i++) s += SCALAR(r[i]) * x[i];                                         \
        return s;                                                                            \
    }

/* out[j][b] = dot(row j, x[b]) for four consecutive rows (`k` apart from `r`) and four sequences: 16
   accumulators, so each weight vector serves four sequences and each input vector four rows. The
   batched kernel: compute-bound, where the single-row `dot` is bound by memory. */
#define DEFINE_TILE(NAME, T, VLOAD, SCALAR)                                                  \
    static void NAME(const T *r, int64_t k, const float *const x[4], float out[4][4]) {      \
        vf a[4][4];                                                                          \
        for (int j = 0; j < 4; j++)                                                          \
            for (int b = 0; b < 4; b++) a[j][b] = VZERO();                                   \
        int64_t i = 0;                                                                       \
        for (; i + W <= k; i += W) {                                                         \
            vf xv[4] = {VLOAD_F32(x[0] + i), VLOAD_F32(x[1] + i), VLOAD_F32(x[2] + i),       \
                        VLOAD_F32(x[3] + i)};                                                \
            for (int j = 0; j < 4; j++) {                                                    \
                vf w = VLOAD(r + j * k + i);                                                 \
                for (int b = 0; b < 4; b++) a[j][b] = VFMA(w, xv[b], a[j][b]);               \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < 4; j++)                                                          \
            for (int b = 0; b < 4; b++) {                                                    \
                float s = VSUM(a[j][b]);                                                     \
                for (int64_t t = i; t < k; t++) s += SCALAR(r[j * k + t]) * x[b][t];         \
                out[j][b] = s;                                                               \
            }                                                                                \
    }

DEFINE_TILE(tile_f32, float, VLOAD_F32, SCALAR_F32)
DEFINE_TILE(tile_bf16, uint16_t, VLOAD_BF16, SCALAR_BF16)
DEFINE_TILE(tile_i8, int8_t, VLOAD_I8, SCALAR_I8)

#if defined(__AVX512BF16__)
/* The bf16 tile on vdpbf16ps: bf16 pairs multiplied and summed into fp32, twice the work per
   instruction of widening the weights, for inputs rounded to bf16 (as the eager bf16 forward has
   them). Batches only: a lone stream is bound by memory, not by these instructions. */
static void tile_bf16_dp(const uint16_t *r, int64_t k, const uint16_t *const x[4], float out[4][4]) {
    __m512 a[4][4];
    for (int j = 0; j < 4; j++)
        for (int b = 0; b < 4; b++) a[j][b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh xv[4];
        for (int b = 0; b < 4; b++) xv[b] = (__m512bh)_mm512_loadu_si512(x[b] + i);
        for (int j = 0; j < 4; j++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512(r + j * k + i);
            for (int b = 0; b < 4; b++) a[j][b] = _mm512_dpbf16_ps(a[j][b], w, xv[b]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int b = 0; b < 4; b++) {
            float s = _mm512_reduce_add_ps(a[j][b]);
            for (int64_t t = i; t < k; t++) s += bf16_to_f32(r[j * k + t]) * bf16_to_f32(x[b][t]);
            out[j][b] = s;
        }
}
#endif

DEFINE_DOT(dot_f32, float, VLOAD_F32, SCALAR_F32)
DEFINE_DOT(dot_bf16, uint16_t, VLOAD_BF16, SCALAR_BF16)
DEFINE_DOT(dot_i8, int8_t, VLOAD_I8, SCALAR_I8)

/* int4, group-wise: byte b of a group holds its weights 2b (low nibble) and 2b+1 (high), and
   w = q * scale + zero' (zero' = zero - 8 * scale, folded at load). `xp` is x permuted to match (per
   2W weights: the W even ones, then the W odd ones; `permute_for_int4`), zero-padded to the groups;
   `xsum` holds each group's sum of x, so the zero points cost one multiply-add per group. */
static float dot_i4(const uint8_t *r, const float *xp, const float *xsum, const float *scale, const float *zero,
                    int64_t groups, int64_t group) {
    vf acc = VZERO();
    float zacc = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rg = r + g * group / 2;
        const float *xg = xp + g * group;
        vf t0 = VZERO(), t1 = VZERO();
        for (int64_t j = 0; j < group; j += 2 * W) {
            vi q = VLOAD_U8(rg + j / 2);
            t0 = VFMA(VLOW4(q), VLOAD_F32(xg + j), t0);
            t1 = VFMA(VHIGH4(q), VLOAD_F32(xg + j + W), t1);
        }
        acc = VFMA(t0 + t1, VSET1(scale[g]), acc);
        zacc += zero[g] * xsum[g];
    }
    return VSUM(acc) + zacc;
}

static void permute_for_int4(const float *x, int64_t k, int64_t groups, int64_t group, float *xp, float *xsum) {
    for (int64_t g = 0; g < groups; g++) {
        float sum = 0.0f;
        for (int64_t j = g * group; j < (g + 1) * group; j += 2 * W)
            for (int64_t m = 0; m < W; m++) {
                float even = j + 2 * m < k ? x[j + 2 * m] : 0.0f, odd = j + 2 * m + 1 < k ? x[j + 2 * m + 1] : 0.0f;
                xp[j + m] = even, xp[j + W + m] = odd;
                sum += even + odd;
            }
        xsum[g] = sum;
    }
}

typedef struct {
    const void *weight;  /* [out, in] row-major; I4: uint8 [out, groups * group / 2] */
    int64_t type;        /* F32, BF16, I8 or I4 */
    const float *scale;  /* [out] or NULL; I4: [out, groups] */
    const float *bias;   /* [out] or NULL */
    const float *zero;   /* I4: [out, groups] (zero - 8 * scale); else NULL */
    int64_t group;       /* I4: weights per group; else 0 */
} Linear;

/* What a GEMV's input looks like to `l`: x itself, or for I4 its permuted copy and group sums (in this
   thread's `work`). */
typedef struct {
    const float *x, *xsum;
    const uint16_t *xb; /* x in bf16, for bf16 tiles (batches, where vdpbf16ps exists); else NULL */
} Input;

static Input prepare(const Linear *l, const float *x, int64_t k, float *work) {
    Input in = {x, NULL, NULL};
    if (l->type == I4) {
        int64_t groups = (k + l->group - 1) / l->group;
        permute_for_int4(x, k, groups, l->group, work, work + groups * l->group);
        in.x = work, in.xsum = work + groups * l->group;
    }
    return in;
}

/* Row `row` of `l` dotted with the input, scaled and biased. */
static float dot(const Linear *l, int64_t row, Input in, int64_t k) {
    float s;
    if (l->type == I4) {
        int64_t groups = (k + l->group - 1) / l->group;
        const uint8_t *r = (const uint8_t *)l->weight + row * groups * l->group / 2;
        s = dot_i4(r, in.x, in.xsum, l->scale + row * groups, l->zero + row * groups, groups, l->group);
    } else {
        size_t at = (size_t)row * (size_t)k;
        s = l->type == F32    ? dot_f32((const float *)l->weight + at, in.x, k)
            : l->type == BF16 ? dot_bf16((const uint16_t *)l->weight + at, in.x, k)
                              : dot_i8((const int8_t *)l->weight + at, in.x, k);
        if (l->scale) s *= l->scale[row];
    }
    if (l->bias) s += l->bias[row];
    return s;
}

/* y = l(x) (y += l(x) when `accumulate`: the residual add rides along). Work-shares the rows across
   the team; call from inside the parallel region. */
/* Row `row` of `l` for every sequence: out[b] for b < batch. */
static void row_all(const Linear *l, int64_t row, const Input *in, int64_t batch, int64_t k, float *out) {
    for (int64_t b = 0; b < batch; b++) out[b] = dot(l, row, in[b], k);
}

/* Rows r..r+3 of `l` for every sequence: out[j][b]. Four sequences at a time through the 4x4 tile
   (not int4), the rest row by row. */
static void rows4_all(const Linear *l, int64_t r, const Input *in, int64_t batch, int64_t k,
                      float out[4][MAX_BATCH]) {
    int64_t b = 0;
    if (l->type != I4) {
        size_t at = (size_t)r * (size_t)k;
        for (; b + 4 <= batch; b += 4) {
            const float *x[4] = {in[b].x, in[b + 1].x, in[b + 2].x, in[b + 3].x};
            float t[4][4];
            if (l->type == F32)
                tile_f32((const float *)l->weight + at, k, x, t);
#if defined(__AVX512BF16__)
            else if (l->type == BF16 && in[b].xb) {
                const uint16_t *xb[4] = {in[b].xb, in[b + 1].xb, in[b + 2].xb, in[b + 3].xb};
                tile_bf16_dp((const uint16_t *)l->weight + at, k, xb, t);
            }
#endif
            else if (l->type == BF16)
                tile_bf16((const uint16_t *)l->weight + at, k, x, t);
            else
                tile_i8((const int8_t *)l->weight + at, k, x, t);
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 4; c++) {
                    float v = t[j][c];
                    if (l->scale) v *= l->scale[r + j];
                    if (l->bias) v += l->bias[r + j];
                    out[j][b + c] = v;
                }
        }
    }
    for (int j = 0; j < 4; j++)
        for (int64_t c = b; c < batch; c++) out[j][c] = dot(l, r + j, in[c], k);
}

/* The inputs of `batch` sequences (rows of x, `k` apart) as `l` reads them. */
static void prepare_all(const Linear *l, const float *x, int64_t batch, int64_t k, float *work, int64_t per_seq,
                        Input *in) {
    for (int64_t b = 0; b < batch; b++) {
        in[b] = prepare(l, x + b * k, k, work + b * per_seq);
#if defined(__AVX512BF16__)
        if (l->type == BF16 && batch >= TILE_MIN_BATCH) {
            uint16_t *xb = (uint16_t *)(work + b * per_seq);
            for (int64_t i = 0; i < k; i++) xb[i] = f32_to_bf16(x[b * k + i]);
            in[b].xb = xb;
        }
#endif
    }
}

/* y[b] = l(x[b]) for every sequence (y[b] += l(x[b]) when `accumulate`: the residual add rides along).
   Work-shares the rows across the team; call from inside the parallel region. */
static void gemv(const Linear *l, const float *x, float *y, int64_t batch, int64_t n, int64_t k, int accumulate,
                 float *work, int64_t per_seq) {
    Input in[MAX_BATCH];
    prepare_all(l, x, batch, k, work, per_seq, in);  /* each thread its own copy: no barrier */
    if (batch < TILE_MIN_BATCH) {
        float out[MAX_BATCH];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            row_all(l, r, in, batch, k, out);
            for (int64_t b = 0; b < batch; b++) y[b * n + r] = (accumulate ? y[b * n + r] : 0.0f) + out[b];
        }
        return;
    }
    float out[4][MAX_BATCH];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r += 4) {
        if (r + 4 <= n) {
            rows4_all(l, r, in, batch, k, out);
        } else {
            for (int64_t j = 0; r + j < n; j++) row_all(l, r + j, in, batch, k, out[j]);
        }
        for (int64_t j = 0; j < 4 && r + j < n; j++)
            for (int64_t b = 0; b < batch; b++)
                y[b * n + r + j] = (accumulate ? y[b * n + r + j] : 0.0f) + out[j][b];
    }
}

/* act = silu(gate(x)) * up(x) from the fused [gate; up] weight: row i of both halves in one
   iteration, so the product needs no second pass and no barrier. */
static void gemv_swiglu(const Linear *l, const float *x, float *act, int64_t batch, int64_t inter, int64_t k,
                        float *work, int64_t per_seq) {
    Input in[MAX_BATCH];
    prepare_all(l, x, batch, k, work, per_seq, in);
    if (batch < TILE_MIN_BATCH || inter % 4) {
        float gate[MAX_BATCH], up[MAX_BATCH];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < inter; i++) {
            row_all(l, i, in, batch, k, gate);
            row_all(l, inter + i, in, batch, k, up);
            for (int64_t b = 0; b < batch; b++) act[b * inter + i] = gate[b] / (1.0f + expf(-gate[b])) * up[b];
        }
        return;
    }
    float gate[4][MAX_BATCH], up[4][MAX_BATCH];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < inter; i += 4) {
        rows4_all(l, i, in, batch, k, gate);
        rows4_all(l, inter + i, in, batch, k, up);
        for (int64_t j = 0; j < 4; j++)
            for (int64_t b = 0; b < batch; b++)
                act[b * inter + i + j] = gate[j][b] / (1.0f + expf(-gate[j][b])) * up[j][b];
    }
}

static void rms_norm(const float *x, const float *weight, float *y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
}

static void rotate(float *x, const float *cos, const float *sin, int64_t d, float *tmp) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) tmp[i] = x[i] * cos[i] + x[(i + half) % d] * sin[i];
    memcpy(x, tmp, (size_t)d * sizeof(float));
}

static void store_kv(void *cache, int64_t type, int64_t offset, const float *v, int64_t d) {
    if (type == F32) {
        memcpy((float *)cache + offset, v, (size_t)d * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(v[i]);
    }
}

static float dot_kv(const float *q, const void *cache, int64_t type, int64_t offset, int64_t d) {
    vf acc = VZERO();
    float s = 0.0f;
    int64_t i = 0;
    if (type == F32) {
        const float *k = (const float *)cache + offset;
        for (; i + W <= d; i += W) acc = VFMA(VLOAD_F32(k + i), VLOAD_F32(q + i), acc);
        for (; i < d; i++) s += k[i] * q[i];
    } else {
        const uint16_t *k = (const uint16_t *)cache + offset;
        for (; i + W <= d; i += W) acc = VFMA(VLOAD_BF16(k + i), VLOAD_F32(q + i), acc);
        for (; i < d; i++) s += bf16_to_f32(k[i]) * q[i];
    }
    return VSUM(acc) + s;
}

static void axpy_kv(float *out, float a, const void *cache, int64_t type, int64_t offset, int64_t d) {
    int64_t i = 0;
    vf av = VSET1(a);
    if (type == F32) {
        const float *v = (const float *)cache + offset;
        for (; i + W <= d; i += W) VSTORE(out + i, VFMA(av, VLOAD_F32(v + i), VLOAD_F32(out + i)));
        for (; i < d; i++) out[i] += a * v[i];
    } else {
        const uint16_t *v = (const uint16_t *)cache + offset;
        for (; i + W <= d; i += W) VSTORE(out + i, VFMA(av, VLOAD_BF16(v + i), VLOAD_F32(out + i)));
        for (; i < d; i++) out[i] += a * bf16_to_f32(v[i]);
    }
}

/* Causal attention of one query token over its `len` cached positions, one query head per iteration.
   `scores`: `len` floats of this thread's scratch. */
static void attention_head(const float *q, const void *kc, const void *vc, int64_t kv_type, const int32_t *table,
                           int64_t len, int64_t block_size, int64_t kv_heads, int64_t kv_head, int64_t d,
                           float scale, float *scores, float *out) {
    float top = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        scores[t] = dot_kv(q, kc, kv_type, (slot * kv_heads + kv_head) * d, d) * scale;
        if (scores[t] > top) top = scores[t];
    }
    float total = 0.0f;
    for (int64_t t = 0; t < len; t++) total += scores[t] = expf(scores[t] - top);
    memset(out, 0, (size_t)d * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        axpy_kv(out, scores[t] / total, vc, kv_type, (slot * kv_heads + kv_head) * d, d);
    }
}

/* Shapes: hidden, heads, kv_heads, head_dim, intermediate, vocab, layers, block_size, kv_type,
   embed_type, max_len (scratch per thread), max_group (the largest int4 group, or 0). */
enum { C_HIDDEN, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_INTER, C_VOCAB, C_LAYERS, C_BLOCK, C_KV_TYPE, C_EMBED_TYPE,
       C_MAX_LEN, C_MAX_GROUP, C_COUNT };

/* One layer's table entry; the Python side fills these from the model's modules. */
typedef struct {
    const float *input_norm;
    Linear qkv, o;
    const float *post_norm;
    Linear gate_up, down;
    void *k_cache, *v_cache;
} Layer;

typedef struct {
    const void *embed;  /* [vocab, hidden] of type C_EMBED_TYPE */
    const float *norm;
    Linear head;
    const float *cos, *sin;  /* [max_pos, head_dim] */
} Globals;

/* Scratch, per sequence: 2 * hidden + q + 2 kv + heads * head_dim + intermediate + head_dim floats;
   then threads * max_len for the attention scores; then, per thread and sequence, 2 * (max(hidden,
   intermediate, q) + max_group) for int4 inputs. `tables`: int32 [batch, table_stride]. */
int weir_decode_step(const int64_t *shape, const Globals *g, const Layer *layers, int64_t batch,
                     const int64_t *tokens, const int64_t *positions, const int32_t *tables, int64_t table_stride,
                     float eps, int threads, float *scratch, float *logits) {
    const int64_t hidden = shape[C_HIDDEN], heads = shape[C_HEADS], kv_heads = shape[C_KV_HEADS];
    const int64_t d = shape[C_HEAD_DIM], inter = shape[C_INTER], kv_type = shape[C_KV_TYPE];
    const int64_t block = shape[C_BLOCK], max_len = shape[C_MAX_LEN], vocab = shape[C_VOCAB];
    const int64_t q_size = heads * d, kv_size = kv_heads * d, group = heads / kv_heads;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (batch < 1 || batch > MAX_BATCH || heads % kv_heads) return 1;
    for (int64_t b = 0; b < batch; b++)
        if (positions[b] + 1 > max_len) return 2;
    const float scale = 1.0f / sqrtf((float)d);
    float *x = scratch, *h = x + batch * hidden, *qkv = h + batch * hidden, *attn = qkv + batch * qkv_size;
    float *act = attn + batch * q_size, *tmp = act + batch * inter, *scores = tmp + d;

    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < hidden; i++) {
            int64_t at = tokens[b] * hidden + i;
            x[b * hidden + i] = shape[C_EMBED_TYPE] == F32 ? ((const float *)g->embed)[at]
                                                           : bf16_to_f32(((const uint16_t *)g->embed)[at]);
        }
    /* per thread and sequence, for int4 inputs: the widest input padded to a whole group, and its group
       sums */
    const int64_t widest = (hidden > inter ? hidden : inter) > q_size ? (hidden > inter ? hidden : inter) : q_size;
    const int64_t per_seq = 2 * (widest + shape[C_MAX_GROUP]);
#pragma omp parallel num_threads(threads)
    {
        float *my_scores = scores + (int64_t)omp_get_thread_num() * max_len;
        float *work = scores + threads * max_len + (int64_t)omp_get_thread_num() * batch * per_seq;
        for (int64_t l = 0; l < shape[C_LAYERS]; l++) {
            const Layer *ly = &layers[l];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, ly->input_norm, h + b * hidden, hidden, eps);
            gemv(&ly->qkv, h, qkv, batch, qkv_size, hidden, 0, work, per_seq);
#pragma omp single
            for (int64_t b = 0; b < batch; b++) {
                const int64_t pos = positions[b];
                const int32_t *table = tables + b * table_stride;
                const int64_t slot = (int64_t)table[pos / block] * block + pos % block;
                float *row = qkv + b * qkv_size;
                for (int64_t j = 0; j < heads + kv_heads; j++) rotate(row + j * d, g->cos + pos * d, g->sin + pos * d, d, tmp);
                for (int64_t j = 0; j < kv_heads; j++) {
                    store_kv(ly->k_cache, kv_type, (slot * kv_heads + j) * d, row + q_size + j * d, d);
                    store_kv(ly->v_cache, kv_type, (slot * kv_heads + j) * d, row + q_size + kv_size + j * d, d);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t bj = 0; bj < batch * heads; bj++) {
                const int64_t b = bj / heads, j = bj % heads;
                attention_head(qkv + b * qkv_size + j * d, ly->k_cache, ly->v_cache, kv_type, tables + b * table_stride,
                               positions[b] + 1, block, kv_heads, j / group, d, scale, my_scores,
                               attn + b * q_size + j * d);
            }
            gemv(&ly->o, attn, x, batch, hidden, q_size, 1, work, per_seq);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, ly->post_norm, h + b * hidden, hidden, eps);
            gemv_swiglu(&ly->gate_up, h, act, batch, inter, hidden, work, per_seq);
            gemv(&ly->down, act, x, batch, hidden, inter, 1, work, per_seq);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) rms_norm(x + b * hidden, g->norm, h + b * hidden, hidden, eps);
        gemv(&g->head, h, logits, batch, vocab, hidden, 0, work, per_seq);
    }
    return 0;
}
