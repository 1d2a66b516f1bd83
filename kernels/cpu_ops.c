/* The eager forward's CPU work beside its matmuls (prefills, and steps the fused decode step does not
   take): RMSNorm, rotary embedding and the SwiGLU product, each one pass over its rows in fp32 or bf16,
   spread over the threads; and a prefill chunk's causal attention over the paged cache (at the end).

   In PyTorch each of these is several passes: a bf16 rotary embedding promotes to fp32 against the fp32
   tables, rolls, multiplies twice, adds and casts back, and bf16 SiLU and RMSNorm upcast on their own;
   together with the MLP product they were ~40% of a 512-token bf16 prefill of SmolLM2 (2-vCPU Xeon).
   Here a row is read once, computed in fp32 registers and written once. The arithmetic is PyTorch's,
   operation for operation (rounded to bf16 where PyTorch rounds), so results match its ops to the last
   bit or within a rounding of bf16 (tests/kernels/test_cpu_ops.py); the PyTorch ops are the reference.

   Built at first use by kernels/cpu_ops.py with -O3 -march=native -fopenmp (kernels/native.py). */

#include <stdlib.h>

#include "cpu_simd.h"

/* A row of `n` elements of `type` widened to fp32 into `dst`, and back (rounded to nearest even). */
static void load_row(float *dst, const void *src, int type, int64_t n) {
    if (type == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static void store_row(void *dst, int type, const float *src, int64_t n) {
    if (type == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *d = dst;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) { /* f32_to_bf16, 16 at a time */
            const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
            const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
            r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
            _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(r));
        }
#endif
        for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
    }
}

static size_t element(int type) { return type == F32 ? 4 : 2; }

/* A thread's scratch of `floats`, or NULL with `*failed` set (the call then reports 3, out of memory). */
static float *thread_scratch(size_t floats, int *failed) {
    float *p = malloc(floats * sizeof(float));
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, in fp32, rounded once (as PyTorch's rms_norm).
   `x` and `y` rows `ldx` / `ldy` elements apart; `weight` of the same type. */
int weir_rms_norm(const void *x, int64_t ldx, const void *weight, void *y, int64_t ldy, int64_t rows, int64_t n,
                  float eps, int type, int threads) {
    if ((type != F32 && type != BF16) || n < 1) return 1;
    float *w = malloc((size_t)n * sizeof(float));
    if (!w) return 3;
    load_row(w, weight, type, n);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *row = thread_scratch((size_t)n, &failed);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            load_row(row, (const char *)x + r * ldx * (int64_t)element(type), type, n);
            rms_norm_row(row, w, row, n, eps);
            store_row((char *)y + r * ldy * (int64_t)element(type), type, row, n);
        }
        free(row);
    }
    free(w);
    return failed ? 3 : 0;
}

/* In place, the rotary embedding of `heads` heads of `d` at the start of each row (rows `ldx` elements
   apart), row r at positions[r], with `cos`, `sin` fp32 [max_pos, d] as engine/model.py builds them (2
   for a position past them): `rotate`, the fused step's own, in fp32 and rounded once. */
int weir_rope(void *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const int64_t *positions,
              const float *cos, const float *sin, int64_t max_pos, int type, int threads) {
    if ((type != F32 && type != BF16) || d % 2 || d > 1024) return 1;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_pos) return 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * d, *s = sin + positions[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            void *head = (char *)x + (r * ldx + h * d) * (int64_t)element(type);
            float v[1024];
            load_row(v, head, type, d);
            rotate(v, c, s, d);
            store_row(head, type, v, d);
        }
    }
    return 0;
}

/* out[r] = silu(gate[r]) * up[r] for rows of [gate | up] (`inter` each, rows `ld` elements apart):
   fp32 math; in bf16 the SiLU is rounded before the product and the product after, as PyTorch's two
   ops round. `out` rows are `inter` apart. */
int weir_silu_mul(const void *gate_up, int64_t ld, void *out, int64_t rows, int64_t inter, int type, int threads) {
    if (type != F32 && type != BF16) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *g = thread_scratch((size_t)inter * 2, &failed);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!g) continue;
            float *u = g + inter;
            const char *src = (const char *)gate_up + r * ld * (int64_t)element(type);
            load_row(g, src, type, inter);
            load_row(u, src + inter * (int64_t)element(type), type, inter);
            silu_(g, inter);
            if (type == BF16)
                for (int64_t i = 0; i < inter; i++) g[i] = bf16_to_f32(f32_to_bf16(g[i]));
            for (int64_t i = 0; i < inter; i++) g[i] *= u[i];
            store_row((char *)out + r * inter * (int64_t)element(type), type, g, inter);
        }
        free(g);
    }
    return failed ? 3 : 0;
}

/* Causal attention of a prefill chunk: `n` queries (q [n, heads, d], rows `ldq` elements apart) at
   positions context_len - n .. context_len - 1 against the sequence's paged cache ([blocks, block_size,
   kv_heads, d], which already holds the chunk's keys and values), block `table` (ids below `blocks`,
   else 2); out [n, heads, d].

   PyTorch's CPU path gathers the blocks into a copy and runs SDPA, in fp32 at 40-85 GFLOP/s on
   SmolLM2's shapes (a 512-token chunk: 5 ms a layer alone, 11 ms after a 512-token prefix; 2-vCPU
   Xeon). Here each KV head's keys are laid out once per call transposed ([d][positions], fp32) and its
   values widened, then every tile of QT query vectors of that head's group (consecutive positions,
   so similar lengths) computes its scores as a GEMM micro-kernel (a vector of W keys, QT broadcast
   query elements), an exact softmax per row, and its outputs OUT_ROWS rows at a time in registers
   (each value vector loaded once for all of them). A query row's arithmetic does not depend on the chunking, so chunked prefill and
   prefix-cache hits compute the same numbers as one whole prefill. fp32 math; bf16 widened on load
   and the output rounded once. */
#define QT 12      /* query vectors per tile: the score micro-kernel's accumulators */
#define OUT_ROWS 3 /* output rows computed together (p0, p1, p2 below) ... */
#define OUT_VECS 4 /* ... OUT_VECS vectors of each at a time, in registers */
_Static_assert(QT % OUT_ROWS == 0, "a tile's last row group must stay inside its QT score rows");

int weir_prefill_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache,
                           const int32_t *table, int64_t blocks, int64_t context_len, int64_t n,
                           int64_t block_size, int64_t heads, int64_t kv_heads, int64_t d, float scale, void *out,
                           int type, int threads) {
    if ((type != F32 && type != BF16) || kv_heads < 1 || heads % kv_heads || n < 1 || n > context_len || d > 1024)
        return 1;
    for (int64_t b = 0; b < (context_len + block_size - 1) / block_size; b++)
        if (table[b] < 0 || table[b] >= blocks) return 2;
    const int64_t group = heads / kv_heads, len = context_len, padded = (len + W - 1) / W * W;
    const int64_t ld = padded + 16; /* rows of kt and scores: not a power of two apart (cache sets) */
    const int64_t first = len - n, vecs = n * group, tiles = (vecs + QT - 1) / QT, dv = d - d % W;
    const size_t es = element(type);
    float *kt = malloc((size_t)(d * ld) * sizeof(float)), *vv = malloc((size_t)(len * d) * sizeof(float));
    int failed = !kt || !vv;
    if (failed) {
        free(kt), free(vv);
        return 3;
    }
#pragma omp parallel num_threads(threads)
    {
        float *scores = thread_scratch((size_t)(QT * ld + 2 * QT * d), &failed);
        float *qt = scores ? scores + QT * ld : NULL, *outs = qt ? qt + QT * d : NULL;
        for (int64_t g = 0; g < kv_heads; g++) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < padded; t++) {
                if (t >= len) {
                    for (int64_t c = 0; c < d; c++) kt[c * ld + t] = 0.0f;
                    continue;
                }
                const int64_t at = (((int64_t)table[t / block_size] * block_size + t % block_size) * kv_heads + g) * d;
                load_row(vv + t * d, (const char *)v_cache + at * (int64_t)es, type, d);
                float key[1024];
                load_row(key, (const char *)k_cache + at * (int64_t)es, type, d);
                for (int64_t c = 0; c < d; c++) kt[c * ld + t] = key[c];
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t tile = 0; tile < tiles; tile++) {
                if (!scores) continue;
                const int64_t v0 = tile * QT, nv = vecs - v0 < QT ? vecs - v0 : QT;
                for (int64_t r = 0; r < QT; r++) { /* the tile's queries, scaled, transposed: [d][QT] */
                    if (r < nv) {
                        const int64_t i = (v0 + r) / group, h = g * group + (v0 + r) % group;
                        load_row(outs, (const char *)q + (i * ldq + h * d) * (int64_t)es, type, d);
                        for (int64_t c = 0; c < d; c++) qt[c * QT + r] = outs[c] * scale;
                    } else {
                        for (int64_t c = 0; c < d; c++) qt[c * QT + r] = 0.0f;
                    }
                }
                const int64_t span = first + (v0 + nv - 1) / group + 1; /* keys the last query sees */
                for (int64_t j = 0; j < span; j += W) {
                    vf acc[QT];
                    for (int r = 0; r < QT; r++) acc[r] = VZERO();
                    for (int64_t c = 0; c < d; c++) {
                        const vf k = VLOAD_F32(kt + c * ld + j);
                        _Pragma("GCC unroll 12") for (int r = 0; r < QT; r++) acc[r] = VFMA(VSET1(qt[c * QT + r]), k, acc[r]);
                    }
                    for (int r = 0; r < QT; r++) VSTORE(scores + r * ld + j, acc[r]);
                }
                for (int64_t r = 0; r < nv; r++) { /* exact softmax over what row r sees, zeros after */
                    const int64_t seen = first + (v0 + r) / group + 1;
                    softmax(scores + r * ld, seen, NULL);
                    memset(scores + r * ld + seen, 0, (size_t)(span - seen) * sizeof(float));
                }
                for (int64_t r0 = 0; r0 < nv; r0 += OUT_ROWS) { /* OUT_ROWS rows share each value load */
                    const int rows = nv - r0 < OUT_ROWS ? (int)(nv - r0) : OUT_ROWS;
                    const int64_t seen = first + (v0 + r0 + rows - 1) / group + 1;
                    for (int64_t c0 = 0; c0 < dv; c0 += OUT_VECS * W) {
                        const int nvec = (int)((dv - c0) / W < OUT_VECS ? (dv - c0) / W : OUT_VECS);
                        vf o[OUT_ROWS][OUT_VECS];
                        for (int r = 0; r < OUT_ROWS; r++)
                            for (int j = 0; j < OUT_VECS; j++) o[r][j] = VZERO();
                        const float *p0 = scores + r0 * ld, *p1 = p0 + ld, *p2 = p1 + ld;
                        if (nvec == OUT_VECS) /* the usual case, with no test per vector */
                            for (int64_t t = 0; t < seen; t++) {
                                const vf w0 = VSET1(p0[t]), w1 = VSET1(p1[t]), w2 = VSET1(p2[t]);
                                _Pragma("GCC unroll 4") for (int j = 0; j < OUT_VECS; j++) {
                                    const vf x = VLOAD_F32(vv + t * d + c0 + j * W);
                                    o[0][j] = VFMA(w0, x, o[0][j]), o[1][j] = VFMA(w1, x, o[1][j]), o[2][j] = VFMA(w2, x, o[2][j]);
                                }
                            }
                        else
                            for (int64_t t = 0; t < seen; t++) {
                                const vf w0 = VSET1(p0[t]), w1 = VSET1(p1[t]), w2 = VSET1(p2[t]);
                                for (int j = 0; j < nvec; j++) {
                                    const vf x = VLOAD_F32(vv + t * d + c0 + j * W);
                                    o[0][j] = VFMA(w0, x, o[0][j]), o[1][j] = VFMA(w1, x, o[1][j]), o[2][j] = VFMA(w2, x, o[2][j]);
                                }
                            }
                        for (int r = 0; r < rows; r++)
                            for (int j = 0; j < nvec; j++) VSTORE(outs + (r0 + r) * d + c0 + j * W, o[r][j]);
                    }
                    for (int r = 0; r < rows; r++) /* d not a multiple of W: the last columns one by one */
                        for (int64_t c = dv; c < d; c++) {
                            float sum = 0.0f;
                            for (int64_t t = 0; t < seen; t++) sum += scores[(r0 + r) * ld + t] * vv[t * d + c];
                            outs[(r0 + r) * d + c] = sum;
                        }
                }
                for (int64_t r = 0; r < nv; r++) {
                    const int64_t i = (v0 + r) / group, h = g * group + (v0 + r) % group;
                    store_row((char *)out + (i * heads + h) * d * (int64_t)es, type, outs + r * d, d);
                }
            }
        }
        free(scores);
    }
    free(kt), free(vv);
    return failed ? 3 : 0;
}
