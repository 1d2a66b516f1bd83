/* One decode step of up to MAX_BATCH sequences through a Llama-family model, in one call, on the CPU.

   A lone stream's decode step is 30-ish layers of small ops: in eager PyTorch each costs 5-30 us of
   dispatch and threading overhead, which for a 135M model is as much time as streaming the weights.
   Here the whole step (embedding, every layer's norm, fused QKV, RoPE, paged-cache write, attention,
   output projection, SwiGLU MLP, final norm, head) runs in one OpenMP parallel region, so the only
   costs left are the weight reads (or, for many sequences, the multiply-adds) and a few barriers per
   layer.

   Weights are the engine's (engine/model.py, engine/quant.py) repacked into panels (below): fp32 /
   bf16 / int8 with one fp32 scale per output / int4 with a scale and zero point per group of inputs.
   The rest is in the engine's layouts: a paged KV cache [blocks, block_size, kv_heads, head_dim] in fp32 or
   bf16; RoPE tables [max_pos, head_dim] in HF's rotate-half form with the first half of `sin` negated.
   Activations are fp32 (bf16 layers of steps of DP_MIN_BATCH or more sequences take them rounded to
   bf16, on AMX tiles where the CPU and the kernel lend them, else on vdpbf16ps); bf16 weights and K/V
   are widened on load, K/V rounded to nearest-even on store. The PyTorch reference is the engine's own
   forward (tests/kernels/test_cpu_decode.py).

   Built at first use by kernels/cpu_decode.py with -O3 -march=native -fopenmp; it links the same
   libgomp.so.1 that PyTorch loaded, so it shares PyTorch's thread pool. */

#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#endif
#include "cpu_simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAX_BATCH 64 /* sequences per call */
#define DP_MIN_BATCH 4 /* from this many sequences bf16 layers multiply bf16 inputs on vdpbf16ps */
#define AMX_MIN_BATCH 4 /* ... and, where the CPU has AMX, on its tiles */
#define RB 32           /* rows (sequences) per AMX block: two A tiles of 16 */


/* Linear layers read their weights in panels of P = NV * W output columns: panel p holds columns
   [p * P, p * P + P) for every input index, input-major, so a kernel streams one panel front to back,
   broadcasts each input element and multiplies it into NV vectors of columns. A lone stream reads every
   weight once, in order (as fast as a row-by-row dot product, which needs a horizontal sum per row);
   a batch reuses each loaded weight vector for up to MB sequences held in MB x NV accumulators, the
   GEMM micro-kernel of BLAS libraries (on a Zen 4 core: 190-200 GFLOP/s fp32 and 360-395 bf16 at 32
   sequences, against oneDNN's 100 and 220 on the same shapes). Layouts (`n` padded to whole panels
   with zero columns; engine/fused_step.py builds them):
     F32, I8: [panels][k][P];
     BF16:    [panels][k rounded up to even / 2][P][2]: pairs of input indices, as vdpbf16ps reads them;
     I4:      [panels][k padded to whole groups][W] bytes, byte m holding column m in its low nibble
              and column W + m in its high one; `scale` and `zero` [panels][groups][P].
   I8 `scale` and every `bias`: [panels * P]. */
#define NV 2
#define P (NV * W)
_Static_assert(NV == 2, "an int4 byte holds an output of each of the two vectors");
#if W == 16
#define MB 12
#elif W == 8
#define MB 6 /* 16 ymm registers: 12 accumulators, 2 weight vectors, 1 broadcast */
#else
#define MB 4
#endif

typedef struct {
    const void *weight;  /* panels, as above */
    int64_t type;        /* F32, BF16, I8 or I4 */
    const float *scale;  /* I8: [panels * P]; I4: [panels][groups][P]; else NULL */
    const float *bias;   /* [panels * P] or NULL */
    const float *zero;   /* I4: [panels][groups][P] (zero - 8 * scale); else NULL */
    int64_t group;       /* I4: weights per group; else 0 */
} Linear;

/* Bytes of one panel of `l` over `k` inputs, in the layouts above (int4: its nibbles; the scales and
   zero points lie apart), and where panel `p` starts. */
static int64_t panel_bytes(const Linear *l, int64_t k) {
    return l->type == F32    ? k * P * 4
           : l->type == I8   ? k * P
           : l->type == BF16 ? (k + 1) / 2 * 2 * P * 2
                             : (k + l->group - 1) / l->group * l->group * W;
}

static const void *panel_at(const Linear *l, int64_t p, int64_t k) {
    return (const char *)l->weight + p * panel_bytes(l, k);
}

/* Lines to prefetch while a panel runs, spread over its inputs: the next panel, which the hardware
   would fetch only when it is read, so a batch of several row blocks (all but the first computing from
   cache) left memory idle, then waited on it. Even a lone stream gains (Xeon, SmolLM2 step: bf16 12.4
   -> 10.2 ms, int8 8.7 -> 4.1, int4 7.5 -> 4.8; fp32 level): the hardware's prefetchers restart at
   every panel. So every kernel takes one, AMX's too (32 sequences: 28.2-29.5 -> 26.6-26.9 ms). */
typedef struct {
    const char *at;
    int64_t lines;
} Prefetch;

/* A thread's state in the step: its bf16 inputs, its AMX tiles, a chunk of int8 / int4 weights widened
   for them. */
typedef struct {
    uint32_t *work;   /* each sequence's inputs in bf16 pairs (bf16_pairs) */
    int tile_rows;    /* the row count its AMX tiles are configured for; 0: not this step */
    int bf16_model;   /* activations may be rounded to bf16 (the model is bf16): int8 layers may take the tiles */
    uint16_t widened[16 * 2 * P]; /* 32 inputs x P outputs of int8 / int4 weights as bf16 pairs */
} Thread;

/* One step of `steps` through a panel: its share of the prefetches, into L2 (prefetcht1: into L1 they
   would evict the panel being read; fp32 at 8 sequences 28 -> 24.5 ms on the Xeon). */
#define PREFETCH_STEP(pf, due, steps) \
    for ((due) += (pf).lines; (due) >= (steps); (due) -= (steps), (pf).at += 64) __builtin_prefetch((pf).at, 0, 2)

/* out[b] = panel . x[b] for the first `mb` rows of x (`ldx` apart), over `k` inputs. */
#define DEFINE_PANEL(NAME, T, VLOAD)                                                          \
    static void NAME(const T *w, const float *x, int64_t ldx, int64_t k, int mb, float (*out)[P],   \
                     Prefetch pf) {                                                           \
        vf acc[MB][NV];                                                                       \
        for (int b = 0; b < MB; b++)                                                          \
            for (int j = 0; j < NV; j++) acc[b][j] = VZERO();                                 \
        int64_t due = 0;                                                                      \
        for (int64_t i = 0; i < k; i++) {                                                     \
            PREFETCH_STEP(pf, due, k);                                                        \
            vf wv[NV];                                                                        \
            for (int j = 0; j < NV; j++) wv[j] = VLOAD(w + i * P + j * W);                    \
            _Pragma("GCC unroll 16") for (int b = 0; b < MB; b++) if (b < mb) {               \
                vf xb = VSET1(x[b * ldx + i]);                                                \
                for (int j = 0; j < NV; j++) acc[b][j] = VFMA(wv[j], xb, acc[b][j]);          \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < mb; b++)                                                          \
            for (int j = 0; j < NV; j++) VSTORE(out[b] + j * W, acc[b][j]);                   \
    }

DEFINE_PANEL(panel_f32, float, VLOAD_F32)
DEFINE_PANEL(panel_i8, int8_t, VLOAD_I8)

/* bf16 pairs widened to fp32: exact fp32 products of the bf16 weights and fp32 inputs. */
static void panel_bf16(const uint16_t *w, const float *x, int64_t ldx, int64_t k, int mb, float (*out)[P],
                       Prefetch pf) {
    vf acc[MB][NV];
    for (int b = 0; b < MB; b++)
        for (int j = 0; j < NV; j++) acc[b][j] = VZERO();
    int64_t due = 0;
    for (int64_t i = 0; i < k; i += 2) {
        PREFETCH_STEP(pf, due, (k + 1) / 2);
        vf lo[NV], hi[NV];
        for (int j = 0; j < NV; j++) {
            vi v = VLOAD_PAIR(w + i * P + j * 2 * W);
            lo[j] = VPAIR_LO(v), hi[j] = VPAIR_HI(v);
        }
        const int odd = i + 1 < k; /* an odd k's last pair holds one weight and a zero */
        _Pragma("GCC unroll 16") for (int b = 0; b < MB; b++) if (b < mb) {
            vf x0 = VSET1(x[b * ldx + i]), x1 = VSET1(odd ? x[b * ldx + i + 1] : 0.0f);
            for (int j = 0; j < NV; j++) acc[b][j] = VFMA(hi[j], x1, VFMA(lo[j], x0, acc[b][j]));
        }
    }
    for (int b = 0; b < mb; b++)
        for (int j = 0; j < NV; j++) VSTORE(out[b] + j * W, acc[b][j]);
}

#if defined(__AVX512BF16__)
/* bf16 pairs against inputs rounded to bf16 (as the eager bf16 forward has them), on vdpbf16ps: two
   products per lane and instruction. Batches only; `x2` holds each row's inputs in bf16, `ldx2` pairs
   apart, zero-padded to even. */
static void panel_bf16_dp(const uint16_t *w, const uint32_t *x2, int64_t ldx2, int64_t k, int mb,
                          float (*out)[P], Prefetch pf) {
    __m512 acc[MB][NV];
    for (int b = 0; b < MB; b++)
        for (int j = 0; j < NV; j++) acc[b][j] = _mm512_setzero_ps();
    int64_t due = 0;
    for (int64_t r = 0; r < (k + 1) / 2; r++) {
        PREFETCH_STEP(pf, due, (k + 1) / 2);
        __m512bh wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + r * 2 * P + j * 2 * W);
        _Pragma("GCC unroll 16") for (int b = 0; b < MB; b++) if (b < mb) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x2[b * ldx2 + r]);
            for (int j = 0; j < NV; j++) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], wv[j], xb);
        }
    }
    for (int b = 0; b < mb; b++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(out[b] + j * W, acc[b][j]);
}
#endif

/* AMX: the same bf16 pairs on the tile unit, for blocks of up to RB sequences. A panel's weights are
   already in the layout tdpbf16ps wants for B (input pairs in rows, 2 x 16 outputs side by side, 2 * P
   bf16 apart), and the bf16 input rows are its A; so a panel is 2 x 2 tiles of 16 x 16 outputs, each
   input chunk of 32 two loads of A, two of B and four multiplies. Linux hands out the tile state on
   request (arch_prctl), once per process; `amx_on` says whether it did (or was switched off). */
static int amx_on = -1; /* -1: not asked yet */

#if defined(HAVE_AMX)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: the outputs (rows 0-15 x cols 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31); 4-5: the
   inputs of rows 0-15 and 16-31; 6-7: the weights of cols 0-15 and 16-31. Loaded when the block's row
   count changes; `*tile_rows` is the count the thread's tiles hold (0: not configured this step). */
static void configure_tiles(int mb, int *tile_rows) {
    if (*tile_rows == mb) return;
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int lo = mb < 16 ? mb : 16, hi = mb - lo;
    const uint8_t rows[8] = {lo, lo, hi, hi, lo, hi, 16, 16};
    for (int t = 0; t < 8; t++)
        if (rows[t]) c.rows[t] = rows[t], c.colsb[t] = 64;
    _tile_loadconfig(&c);
    *tile_rows = mb;
}

/* 32 input rows of an int8 panel ([in][P]) as 16 rows of bf16 pairs ([in / 2][P][2]), the B layout. */
static const uint16_t *widen_i8(const int8_t *w, uint16_t *dst) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < 16; r++)
        for (int h = 0; h < P / 16; h++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * r * P + 16 * h))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + (2 * r + 1) * P + 16 * h))));
            const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                                 _mm512_and_si512(_mm512_castps_si512(hi), high));
            _mm512_storeu_si512(dst + r * 2 * P + 32 * h, pair);
        }
    return dst;
}

/* 32 input rows of an int4 panel from input `i0` (one group: groups are multiples of 32) dequantized and
   rounded to bf16 pairs: q * scale + zero' per output, as panel_i4 computes it, to nearest-even. */
static const uint16_t *widen_i4(const uint8_t *q, const float *scale, const float *zero, int64_t i0,
                                int64_t group, uint16_t *dst) {
    const int64_t g = i0 / group;
    const __m512 s[2] = {_mm512_loadu_ps(scale + g * P), _mm512_loadu_ps(scale + g * P + 16)};
    const __m512 z[2] = {_mm512_loadu_ps(zero + g * P), _mm512_loadu_ps(zero + g * P + 16)};
    for (int r = 0; r < 16; r++) {
        const __m512i a = VLOAD_U8(q + (i0 + 2 * r) * W), b = VLOAD_U8(q + (i0 + 2 * r + 1) * W);
        const __m512 lo[2] = {VLOW4(a), VHIGH4(a)}, hi[2] = {VLOW4(b), VHIGH4(b)}; /* outputs 0-15, 16-31 */
        for (int h = 0; h < 2; h++) {
            const __m512i l16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(lo[h], s[h], z[h])));
            const __m512i h16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(hi[h], s[h], z[h])));
            _mm512_storeu_si512(dst + r * 2 * P + 32 * h, _mm512_or_si512(l16, _mm512_slli_epi32(h16, 16)));
        }
    }
    return dst;
}

/* Panel `p` of `l` on the tiles: bf16 pairs as they are; int8 widened to bf16 pairs 32 inputs at a time
   into the thread's buffer (exact: every int8 is a bf16; the scales apply after); int4 dequantized to
   bf16 the same way. */
static void panel_amx(const Linear *l, int64_t p, const uint32_t *x2, int64_t ldx2, int64_t k, int mb,
                      float (*out)[P], Thread *t, Prefetch pf) {
    const void *panel = panel_at(l, p, k);
    const int64_t groups = l->type == I4 ? (k + l->group - 1) / l->group : 0;
    configure_tiles(mb, &t->tile_rows);
    const int two = mb > 16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    int64_t due = 0;
    for (int64_t r = 0; r < k / 2; r += 16) {
        PREFETCH_STEP(pf, due, k / 32);
        const uint16_t *b = l->type == BF16 ? (const uint16_t *)panel + r * 2 * P
                            : l->type == I8 ? widen_i8((const int8_t *)panel + 2 * r * P, t->widened)
                                            : widen_i4(panel, l->scale + p * groups * P, l->zero + p * groups * P,
                                                       2 * r, l->group, t->widened);
        _tile_loadd(4, x2 + r, ldx2 * 4);
        _tile_loadd(6, b, 2 * P * 2);
        _tile_loadd(7, b + 2 * 16, 2 * P * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x2 + 16 * ldx2 + r, ldx2 * 4);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out[0], P * 4);
    _tile_stored(1, out[0] + 16, P * 4);
    if (two) {
        _tile_stored(2, out[16], P * 4);
        _tile_stored(3, out[16] + 16, P * 4);
    }
}

static int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
#else
static int amx_request(void) { return 0; }
#endif

/* -1: whether the step uses AMX (asking the kernel for it the first time); 0 / 1: switch it off / on
   (on only where the build and the CPU have it). */
int weir_amx(int want) {
    if (want == 0)
        amx_on = 0;
    else if (want == 1 || amx_on < 0)
        amx_on = amx_request();
    return amx_on;
}

/* Whether this linear, in a step of `batch` sequences, runs on the tiles (whole input chunks of 32): bf16
   layers, and int8 and int4 (groups of 32s) ones where the activations may be bf16. */
static int use_amx(const Linear *l, int64_t batch, int64_t k, const Thread *t) {
    const int type_ok = l->type == BF16 || (t->bf16_model && (l->type == I8 || (l->type == I4 && l->group % 32 == 0)));
    return amx_on > 0 && type_ok && batch >= AMX_MIN_BATCH && k % 32 == 0;
}

/* int4 dequantized in registers, w = q * scale + zero' (zero' = zero - 8 * scale, folded at load). */
static void panel_i4(const uint8_t *w, const float *scale, const float *zero, int64_t group, const float *x,
                     int64_t ldx, int64_t k, int mb, float (*out)[P], Prefetch pf) {
    vf acc[MB][NV];
    for (int b = 0; b < MB; b++)
        for (int j = 0; j < NV; j++) acc[b][j] = VZERO();
    int64_t due = 0;
    for (int64_t g = 0; g * group < k; g++) {
        const vf s0 = VLOAD_F32(scale + g * P), s1 = VLOAD_F32(scale + g * P + W);
        const vf z0 = VLOAD_F32(zero + g * P), z1 = VLOAD_F32(zero + g * P + W);
        const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
        for (int64_t i = g * group; i < end; i++) {
            PREFETCH_STEP(pf, due, k);
            vi q = VLOAD_U8(w + i * W);
            vf wv[NV] = {VFMA(VLOW4(q), s0, z0), VFMA(VHIGH4(q), s1, z1)};
            _Pragma("GCC unroll 16") for (int b = 0; b < MB; b++) if (b < mb) {
                vf xb = VSET1(x[b * ldx + i]);
                for (int j = 0; j < NV; j++) acc[b][j] = VFMA(wv[j], xb, acc[b][j]);
            }
        }
    }
    for (int b = 0; b < mb; b++)
        for (int j = 0; j < NV; j++) VSTORE(out[b] + j * W, acc[b][j]);
}

/* out[b][c] = l(x[b])[p * P + c], scaled and biased, for the first `mb` rows of x (`k` apart; `x2`: the
   same in bf16 pairs, or NULL; `tiles`: the thread's state where the layer runs on AMX, else NULL). */
static void run_panel(const Linear *l, int64_t p, const float *x, const uint32_t *x2, int64_t k, int mb,
                      float (*out)[P], Thread *tiles, Prefetch pf) {
    const void *w = panel_at(l, p, k);
#if !defined(HAVE_AMX)
    (void)tiles;
#else
    if (tiles) {
        panel_amx(l, p, x2, (k + 1) / 2, k, mb, out, tiles, pf);
    } else
#endif
    if (l->type == F32) {
        panel_f32(w, x, k, k, mb, out, pf);
    } else if (l->type == I8) {
        panel_i8(w, x, k, k, mb, out, pf);
    } else if (l->type == I4) {
        const int64_t groups = (k + l->group - 1) / l->group;
        panel_i4(w, l->scale + p * groups * P, l->zero + p * groups * P, l->group, x, k, k, mb, out, pf);
    } else {
#if defined(__AVX512BF16__)
        if (x2)
            panel_bf16_dp(w, x2, (k + 1) / 2, k, mb, out, pf);
        else
#else
        (void)x2;
#endif
            panel_bf16(w, x, k, k, mb, out, pf);
    }
    for (int b = 0; b < mb; b++)
        for (int c = 0; c < P; c++) {
            if (l->scale && l->type == I8) out[b][c] *= l->scale[p * P + c];
            if (l->bias) out[b][c] += l->bias[p * P + c];
        }
}

/* What row block `block` of `blocks` of panel `p` prefetches: its share of panel p + 1 (the next one
   this thread takes, under a static schedule). `n`: the outputs of the panels p belongs to. */
static Prefetch next_panel(const Linear *l, int64_t p, int64_t n, int64_t k, int64_t block, int64_t blocks) {
    const Prefetch none = {NULL, 0};
    if ((p + 1) * P >= n) return none;
    const int64_t lines = panel_bytes(l, k) / 64;
    const Prefetch pf = {(const char *)panel_at(l, p + 1, k) + block * lines / blocks * 64,
                         (block + 1) * lines / blocks - block * lines / blocks};
    return pf;
}

/* The inputs in bf16 pairs for vdpbf16ps or the tiles (`amx`), in this thread's `work` (`batch` rows of
   (k + 1) / 2), or NULL where the layer takes fp32 inputs: other types off the tiles, and lone streams
   (bound by memory, where exact fp32 products cost nothing). */
static const uint32_t *bf16_pairs(const Linear *l, const float *x, int64_t batch, int64_t k, uint32_t *work,
                                  int amx) {
#if defined(__AVX512BF16__)
    if (!amx && (l->type != BF16 || batch < DP_MIN_BATCH)) return NULL;
    const int64_t half = (k + 1) / 2;
    for (int64_t b = 0; b < batch; b++) {
        uint16_t *row = (uint16_t *)(work + b * half);
        const float *xb = x + b * k;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) _mm256_storeu_si256((__m256i *)(row + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xb + i)));
        for (; i < k; i++) row[i] = f32_to_bf16(xb[i]);
        if (k % 2) row[k] = 0;
    }
    return work;
#else
    (void)l, (void)x, (void)batch, (void)k, (void)work, (void)amx;
    return NULL;
#endif
}

/* y[b] = l(x[b]) for every sequence (y[b] += l(x[b]) when `accumulate`: the residual add rides along).
   Work-shares the panels across the team, each panel serving every sequence while it is in cache; call
   from inside the parallel region. */
static void gemv(const Linear *l, const float *x, float *y, int64_t batch, int64_t n, int64_t k, int accumulate,
                 Thread *t) {
    const int amx = use_amx(l, batch, k, t), rows = amx ? RB : MB;
    const uint32_t *x2 = bf16_pairs(l, x, batch, k, t->work, amx);  /* each thread its own copy: no barrier */
    float out[RB][P];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < (n + P - 1) / P; p++) {
        const int64_t cols = n - p * P < P ? n - p * P : P;
        for (int64_t b = 0; b < batch; b += rows) {
            const int mb = batch - b < rows ? (int)(batch - b) : rows;
            const Prefetch pf = next_panel(l, p, n, k, b / rows, (batch + rows - 1) / rows);
            run_panel(l, p, x + b * k, x2 ? x2 + b * ((k + 1) / 2) : NULL, k, mb, out, amx ? t : NULL, pf);
            for (int c = 0; c < mb; c++) {
                float *row = y + (b + c) * n + p * P;
                for (int64_t j = 0; j < cols; j++) row[j] = (accumulate ? row[j] : 0.0f) + out[c][j];
            }
        }
    }
}

/* act = silu(gate(x)) * up(x) from the [gate panels; up panels] weight: a panel of both halves in one
   iteration, so the product needs no second pass and no barrier. */
static void gemv_swiglu(const Linear *l, const float *x, float *act, int64_t batch, int64_t inter, int64_t k,
                        Thread *t) {
    const int amx = use_amx(l, batch, k, t), rows = amx ? RB : MB;
    const uint32_t *x2 = bf16_pairs(l, x, batch, k, t->work, amx);
    const int64_t panels = (inter + P - 1) / P;
    float gate[RB][P], up[RB][P];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t cols = inter - p * P < P ? inter - p * P : P;
        for (int64_t b = 0; b < batch; b += rows) {
            const int mb = batch - b < rows ? (int)(batch - b) : rows;
            const uint32_t *pairs = x2 ? x2 + b * ((k + 1) / 2) : NULL;
            const int64_t blocks = (batch + rows - 1) / rows;
            run_panel(l, p, x + b * k, pairs, k, mb, gate, amx ? t : NULL,
                      next_panel(l, p, inter, k, b / rows, blocks));
            run_panel(l, panels + p, x + b * k, pairs, k, mb, up, amx ? t : NULL,
                      next_panel(l, panels + p, 2 * inter, k, b / rows, blocks));
            for (int c = 0; c < mb; c++) {
                silu_(gate[c], cols);
                for (int64_t j = 0; j < cols; j++) act[(b + c) * inter + p * P + j] = gate[c][j] * up[c][j];
            }
        }
    }
}

int64_t weir_panel_width(void) { return P; }

static void store_kv(void *cache, int64_t type, int64_t offset, const float *v, int64_t d) {
    if (type == F32) {
        memcpy((float *)cache + offset, v, (size_t)d * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(v[i]);
    }
}


/* Lane i of the result: the sum of v[i]'s lanes (W vectors in, one out). A transposing tree of
   shuffles and adds: ~3 instructions per sum where a reduction per vector takes ~8. */
static inline vf sum_lanes(vf *v) {
#if W == 16
    __m512 x[8], y[4], s[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sum of each of 4 vectors */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* then across the four 128-bit lanes */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88), _mm512_shuffle_f32x4(s[0], s[1], 0xdd));
#elif W == 8
    __m256 x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d a = _mm256_castps_pd(x[2 * i]), b = _mm256_castps_pd(x[2 * i + 1]);
        y[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
#else
    return v[0];
#endif
}

/* Asks for part `i` of `parts` of the `bytes` from `p` on: the next cache block, which the hardware
   cannot guess (the table can put it anywhere), a slice per step of work on this one (a burst of
   prefetches stalls on the line-fill buffers). */
static inline void prefetch_part(const char *p, int64_t bytes, int64_t i, int64_t parts) {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t l = i * lines / parts; l < (i + 1) * lines / parts; l++) __builtin_prefetch(p + l * 64);
}

#define CHUNK 8 /* vectors of a head's output kept in registers while the weighted sum walks the rows */

/* Causal attention of a sequence's `nq` query heads (one token each, `d` apart in q and out; head j
   reads KV head j / group) over its cached positions t0 .. t1 - 1 (t0 at a block's start), a cache block
   at a time. Scores come W positions at a time (one partial-sum vector each, summed across lanes
   together), and each head's output stays in registers while it walks a block's value rows, so neither
   pass pays a horizontal sum or a load and store per row. A block's rows are contiguous (every KV head
   of a position, then the next position) and small enough to stay in L1 while its heads take turns.
   `out` is normalised over this span; `stats` (or NULL): per head the maximum score and the sum of
   exponentials, to merge spans. `scores`: nq * (t1 - t0) floats. */
#define DEFINE_ATTENTION(NAME, T, VLOAD, SCALAR)                                                              \
    static void NAME(const float *q, const T *kc, const T *vc, const int32_t *table, int64_t t0, int64_t t1, \
                     int64_t block_size, int64_t kv_heads, int64_t group, int64_t nq, int64_t d, float scale,    \
                     float *scores, float *out, float *stats) {                                               \
        const int64_t stride = kv_heads * d, span = t1 - t0, dv = d - d % W;                                 \
        const int64_t bytes = block_size * stride * (int64_t)sizeof(T); /* a cache block of K or V */        \
        for (int64_t start = t0; start < t1; start += block_size) {                                          \
            const int64_t n = t1 - start < block_size ? t1 - start : block_size;                             \
            const T *block = kc + (int64_t)table[start / block_size] * block_size * stride;                  \
            const char *next = start + block_size < t1                                                       \
                ? (const char *)(kc + (int64_t)table[start / block_size + 1] * block_size * stride) : NULL;  \
            for (int64_t t = 0; t < n; t += W) {                                                             \
                const int m = n - t < W ? (int)(n - t) : W;                                                  \
                for (int64_t h = 0; h < nq; h++) {                                                           \
                    if (next) prefetch_part(next, bytes, t / W * nq + h, (n + W - 1) / W * nq);                  \
                    const T *k = block + t * stride + h / group * d;                                         \
                    const float *qh = q + h * d;                                                             \
                    vf acc[W];                                                                               \
                    for (int i = 0; i < W; i++) acc[i] = VZERO();                                            \
                    for (int64_t c = 0; c < dv; c += W) {                                                    \
                        const vf qv = VLOAD_F32(qh + c);                                                     \
                        _Pragma("GCC unroll 16") for (int i = 0; i < W; i++) if (i < m)                      \
                            acc[i] = VFMA(VLOAD(k + i * stride + c), qv, acc[i]);                            \
                    }                                                                                        \
                    float dots[W];                                                                           \
                    VSTORE(dots, sum_lanes(acc));                                                            \
                    float *row = scores + h * span + start - t0 + t;                                         \
                    for (int i = 0; i < m; i++) {                                                            \
                        for (int64_t c = dv; c < d; c++) dots[i] += SCALAR(k[i * stride + c]) * qh[c];       \
                        row[i] = dots[i] * scale;                                                            \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t h = 0; h < nq; h++) softmax(scores + h * span, span, stats ? stats + 2 * h : NULL);     \
        memset(out, 0, (size_t)(nq * d) * sizeof(float));                                                    \
        for (int64_t start = t0; start < t1; start += block_size) {                                          \
            const int64_t n = t1 - start < block_size ? t1 - start : block_size;                             \
            const T *block = vc + (int64_t)table[start / block_size] * block_size * stride;                  \
            const char *next = start + block_size < t1                                                       \
                ? (const char *)(vc + (int64_t)table[start / block_size + 1] * block_size * stride) : NULL;  \
            for (int64_t h = 0; h < nq; h++) {                                                               \
                if (next) prefetch_part(next, bytes, h, nq);                                                 \
                const float *p = scores + h * span + start - t0;                                             \
                float *o = out + h * d;                                                                      \
                for (int64_t c0 = 0; c0 < dv; c0 += CHUNK * W) {                                             \
                    const int nv = (int)((dv - c0) / W < CHUNK ? (dv - c0) / W : CHUNK);                     \
                    vf acc[CHUNK];                                                                           \
                    _Pragma("GCC unroll 8") for (int j = 0; j < CHUNK; j++)                                  \
                        acc[j] = j < nv ? VLOAD_F32(o + c0 + j * W) : VZERO();                               \
                    for (int64_t t = 0; t < n; t++) {                                                        \
                        const T *v = block + t * stride + h / group * d + c0;                                \
                        const vf w = VSET1(p[t]);                                                            \
                        _Pragma("GCC unroll 8") for (int j = 0; j < CHUNK; j++) if (j < nv)                  \
                            acc[j] = VFMA(w, VLOAD(v + j * W), acc[j]);                                      \
                    }                                                                                        \
                    _Pragma("GCC unroll 8") for (int j = 0; j < CHUNK; j++) if (j < nv)                      \
                        VSTORE(o + c0 + j * W, acc[j]);                                                      \
                }                                                                                            \
                for (int64_t c = dv; c < d; c++)                                                             \
                    for (int64_t t = 0; t < n; t++) o[c] += p[t] * SCALAR(block[t * stride + h / group * d + c]); \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_ATTENTION(attention_f32, float, VLOAD_F32, SCALAR_F32)
DEFINE_ATTENTION(attention_bf16, uint16_t, VLOAD_BF16, SCALAR_BF16)

/* Per thread and sequence, the widest input in bf16 pairs. */
static int64_t per_seq_x2(int64_t hidden, int64_t inter, int64_t q_size) {
    const int64_t wide = hidden > inter ? hidden : inter;
    return (wide > q_size ? wide : q_size) / 2 + 1;
}

/* Shapes: hidden, heads, kv_heads, head_dim, intermediate, vocab, layers, block_size, kv_type,
   embed_type, max_len (scratch per thread). */
enum { C_HIDDEN, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_INTER, C_VOCAB, C_LAYERS, C_BLOCK, C_KV_TYPE, C_EMBED_TYPE,
       C_MAX_LEN, C_COUNT };

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
    int64_t embed_stride[2]; /* elements between its rows, between its columns (packing may transpose it) */
    const float *norm;
    Linear head;
    const float *cos, *sin;  /* [max_pos, head_dim] */
} Globals;

/* Scratch, per sequence: 2 * hidden + q + 2 kv + heads * head_dim + intermediate floats; then threads *
   heads * max_len for the attention scores; then, per thread and sequence, max(hidden, intermediate, q)
   / 2 + 1 for bf16 inputs; then, for fewer than 2 * threads sequences, q + 2 * heads per part of a
   sequence, 4 * threads parts at most. `tables`: int32 [batch, table_stride]. */
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
    float *act = attn + batch * q_size, *scores = act + batch * inter;
    /* parts of sequences for attention when there are few sequences: outputs and softmax statistics */
    const int64_t splits = batch >= 2 * threads ? 1 : (2 * threads + batch - 1) / batch;
    float *parts = scores + threads * heads * max_len + threads * batch * per_seq_x2(hidden, inter, q_size);
    float *part_stats = parts + batch * splits * q_size;

    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < hidden; i++) {
            const int64_t at = tokens[b] * g->embed_stride[0] + i * g->embed_stride[1];
            x[b * hidden + i] = shape[C_EMBED_TYPE] == F32 ? ((const float *)g->embed)[at]
                                                           : bf16_to_f32(((const uint16_t *)g->embed)[at]);
        }
    const int64_t per_seq = per_seq_x2(hidden, inter, q_size);
    if (amx_on < 0) weir_amx(-1);
#pragma omp parallel num_threads(threads)
    {
        float *my_scores = scores + (int64_t)omp_get_thread_num() * heads * max_len;
        Thread t = {(uint32_t *)(scores + threads * heads * max_len) + (int64_t)omp_get_thread_num() * batch * per_seq,
                    0 /* AMX tiles unconfigured: other code in the pool may have used them */, kv_type == BF16, {0}};
        for (int64_t l = 0; l < shape[C_LAYERS]; l++) {
            const Layer *ly = &layers[l];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) rms_norm_row(x + b * hidden, ly->input_norm, h + b * hidden, hidden, eps);
            gemv(&ly->qkv, h, qkv, batch, qkv_size, hidden, 0, &t);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) {
                const int64_t pos = positions[b];
                const int32_t *table = tables + b * table_stride;
                const int64_t slot = (int64_t)table[pos / block] * block + pos % block;
                float *row = qkv + b * qkv_size;
                for (int64_t j = 0; j < heads + kv_heads; j++) rotate(row + j * d, g->cos + pos * d, g->sin + pos * d, d);
                for (int64_t j = 0; j < kv_heads; j++) {
                    store_kv(ly->k_cache, kv_type, (slot * kv_heads + j) * d, row + q_size + j * d, d);
                    store_kv(ly->v_cache, kv_type, (slot * kv_heads + j) * d, row + q_size + kv_size + j * d, d);
                }
            }
            /* a task per sequence; with fewer sequences than twice the team, per part of a sequence (whole
               blocks), the parts' softmaxes merged after (flash-decoding): every thread busy, every cache
               row still read whole and in order */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < batch * splits; task++) {
                const int64_t b = task / splits, part = task % splits, len = positions[b] + 1;
                const int64_t blocks = (len + block - 1) / block;
                const int64_t t0 = part * blocks / splits * block, end = (part + 1) * blocks / splits * block;
                const int64_t t1 = end < len ? end : len;
                float *out = splits == 1 ? attn + b * q_size : parts + task * q_size;
                float *stats = splits == 1 ? NULL : part_stats + task * heads * 2;
                if (t0 >= t1) { /* a sequence shorter than its parts: an empty one */
                    for (int64_t j = 0; j < heads; j++) stats[2 * j] = -INFINITY, stats[2 * j + 1] = 0.0f;
                    continue;
                }
                const float *qb = qkv + b * qkv_size;
                const int32_t *table = tables + b * table_stride;
                if (kv_type == F32)
                    attention_f32(qb, ly->k_cache, ly->v_cache, table, t0, t1, block, kv_heads, group, heads, d, scale,
                                  my_scores, out, stats);
                else
                    attention_bf16(qb, ly->k_cache, ly->v_cache, table, t0, t1, block, kv_heads, group, heads, d,
                                   scale, my_scores, out, stats);
            }
            if (splits > 1) {
#pragma omp for schedule(static)
                for (int64_t bh = 0; bh < batch * heads; bh++) {
                    const int64_t b = bh / heads, j = bh % heads;
                    float top = -INFINITY, total = 0.0f, *o = attn + b * q_size + j * d;
                    for (int64_t part = 0; part < splits; part++) {
                        const float m = part_stats[((b * splits + part) * heads + j) * 2];
                        top = m > top ? m : top;
                    }
                    memset(o, 0, (size_t)d * sizeof(float));
                    for (int64_t part = 0; part < splits; part++) {
                        const float *st = part_stats + ((b * splits + part) * heads + j) * 2;
                        if (st[1] == 0.0f) continue;
                        const float w = st[1] * expf(st[0] - top);
                        const float *src = parts + (b * splits + part) * q_size + j * d;
                        for (int64_t c = 0; c < d; c++) o[c] += w * src[c];
                        total += w;
                    }
                    for (int64_t c = 0; c < d; c++) o[c] /= total;
                }
            }
            gemv(&ly->o, attn, x, batch, hidden, q_size, 1, &t);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) rms_norm_row(x + b * hidden, ly->post_norm, h + b * hidden, hidden, eps);
            gemv_swiglu(&ly->gate_up, h, act, batch, inter, hidden, &t);
            gemv(&ly->down, act, x, batch, hidden, inter, 1, &t);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) rms_norm_row(x + b * hidden, g->norm, h + b * hidden, hidden, eps);
        gemv(&g->head, h, logits, batch, vocab, hidden, 0, &t);
#if defined(HAVE_AMX)
        if (t.tile_rows) _tile_release(); /* a thread holding tile state costs every context switch 8 KB */
#endif
    }
    return 0;
}
