/* One-pass AdamW on the compact host layout: the fp32 master as two 16-bit planes (hi: the bf16 pattern the GPU
 * receives, lo: the low 16 bits), moments as fp32, bf16 or block-wise 8-bit codes. Each element is read and
 * written once: join the planes, widen the gradient, update the moments and the master, split the master back.
 *
 * Built on first use by backends/host/fused_host_adamw.py (gcc or cc, -O3 -march=native -ffp-contract=off) and
 * called through ctypes over a range of one parameter tensor; the caller spreads ranges over threads.
 *
 * The arithmetic is the vector path of torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * ADAMW mode) in the same order and precision: the master decays by (1 - lr * wd), the first moment is a lerp
 * computed with one fused multiply-add, the second moment v * beta2 + ((1 - beta2) * g) * g, the denominator
 * sqrt(v) / sqrt(bias correction 2) + eps, and the master p + (-step_size * m) / denom. No contraction beyond the
 * lerp's fma (-ffp-contract=off), so the fp32 result equals torch's bit for bit on the elements torch runs in
 * its vector lanes; the caller runs torch on the tensor's scalar tail.
 *
 * 8-bit moments follow backends/host/moments.py: 256-element blocks with an fp32 absmax each, codes into the signed
 * (first moment) or unsigned (second moment) dynamic map, quantised through a table indexed by the top 20 bits
 * of the normalised fp32 pattern.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

enum { GRAD_FP32 = 0, GRAD_BF16 = 1, GRAD_FP16 = 2 };  /* the gradient's dtype as it left the GPU */
enum { BLOCK = 256, TABLE_SHIFT = 12, TABLE_MASK = (1 << 20) - 1 };

/* The step's constants, each already rounded to fp32 as torch rounds them. The lerp is torch's small-weight
 * branch (|1 - beta1| < 0.5); the loader runs torch's kernel for any other beta1. */
typedef struct {
    float decay;      /* 1 - lr * weight_decay (1 when weight_decay is 0: x * 1 = x) */
    float lerp_w;     /* 1 - beta1 */
    float beta2;
    float c2;         /* 1 - beta2 */
    float bc2_sqrt;   /* sqrt(1 - beta2 ** step) */
    float eps;
    float neg_step;   /* -lr / (1 - beta1 ** step) */
} Hyper;

INLINE float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bf16_to_f(uint16_t b) { return f_of((uint32_t)b << 16); }

/* fp32 -> bf16, round to nearest even (NaN -> a quiet NaN) */
INLINE uint16_t bf16_of(float f) {
    uint32_t u = u_of(f);
    if (f != f) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One element's update; p, m, v in and out. `fused_v`: the second moment as fma((1 - beta2) * g, g, v * beta2),
 * as torch 2.13's kernel computes it, or with a separate multiply and add (a constant at every call site). */
INLINE void adamw_one(float *p, float *m, float *v, float g, const Hyper h, const int fused_v) {
    float x = *p * h.decay;
    float mm = fmaf(h.lerp_w, g - *m, *m);
    float vv = fused_v ? fmaf(h.c2 * g, g, *v * h.beta2) : *v * h.beta2 + h.c2 * g * g;
    float denom = sqrtf(vv) / h.bc2_sqrt + h.eps;
    *p = x + h.neg_step * mm / denom;
    *m = mm;
    *v = vv;
}

INLINE float join(const uint16_t *hu, const uint16_t *lu, int64_t i) {
    return f_of(((uint32_t)hu[i] << 16) | lu[i]);
}

INLINE void split(int16_t *hi, int16_t *lo, int64_t i, float p) {
    uint32_t u = u_of(p);
    hi[i] = (int16_t)(u >> 16);
    lo[i] = (int16_t)(u & 0xFFFFu);
}

INLINE float grad_at(const void *g, int kind, int64_t i) {
    if (kind == GRAD_BF16) return bf16_to_f(((const uint16_t *)g)[i]);
    if (kind == GRAD_FP16) return (float)((const _Float16 *)g)[i];
    return ((const float *)g)[i];
}

/* Each kernel is an inline body with the gradient's dtype and `fused_v` as constants, and an exported function
 * that picks the body outside the loop: each body compiles to straight vector code. */
INLINE void fp32_body(int16_t *hi, int16_t *lo, const void *grad, const int kind, float *m, float *v,
                             int64_t begin, int64_t end, const Hyper h, const int fused_v) {
    const uint16_t *hu = (const uint16_t *)hi, *lu = (const uint16_t *)lo;
    for (int64_t i = begin; i < end; i++) {
        float p = join(hu, lu, i);
        adamw_one(&p, &m[i], &v[i], grad_at(grad, kind, i), h, fused_v);
        split(hi, lo, i, p);
    }
}

INLINE void bf16_body(int16_t *hi, int16_t *lo, const void *grad, const int kind, uint16_t *m, uint16_t *v,
                             int64_t begin, int64_t end, const Hyper h, const int fused_v) {
    const uint16_t *hu = (const uint16_t *)hi, *lu = (const uint16_t *)lo;
    for (int64_t i = begin; i < end; i++) {
        float p = join(hu, lu, i), mm = bf16_to_f(m[i]), vv = bf16_to_f(v[i]);
        adamw_one(&p, &mm, &vv, grad_at(grad, kind, i), h, fused_v);
        m[i] = bf16_of(mm);
        v[i] = bf16_of(vv);
        split(hi, lo, i, p);
    }
}

/* Codes of one block's values x[0..BLOCK); returns the absmax (NaN if any value is NaN). The nearest code of a
 * value in [-1, 1] is `table` (moments.py's, 2^20 codes and 3 bytes of padding) at the top 20 bits of its pattern;
 * a step's values fall in a few exponents, so the rows it reads stay in cache. */
INLINE float quantise_block(const float *x, uint8_t *codes, const uint8_t *table) {
    /* max |x| as the largest pattern with the sign cleared: the order of non-negative floats, a NaN above all */
    uint32_t top = 0;
    for (int j = 0; j < BLOCK; j++) {
        uint32_t a = u_of(x[j]) & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    float absmax = f_of(top);
    float inv = 1.0f / absmax;
    if (!isfinite(inv)) inv = 0.0f;  /* a zero, subnormal or NaN absmax: every code is that of 0 */
    int j = 0;
#if defined(__AVX512F__)
    /* 16 at a time: one gather of 4 bytes at each code's offset, of which the low byte is the code */
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i mask = _mm512_set1_epi32(TABLE_MASK);
    for (; j + 16 <= BLOCK; j += 16) {
        __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv));
        u = _mm512_and_si512(_mm512_srli_epi32(u, TABLE_SHIFT), mask);
        __m512i code = _mm512_i32gather_epi32(u, (const void *)table, 1);
        _mm_storeu_si128((__m128i *)(codes + j), _mm512_cvtepi32_epi8(code));  /* the low byte of each */
    }
#endif
    for (; j < BLOCK; j++) {
        codes[j] = table[(u_of(x[j] * inv) >> TABLE_SHIFT) & TABLE_MASK];
    }
    return absmax;
}

typedef struct {
    uint8_t *mq, *vq;                   /* the codes, padded to whole blocks */
    float *m_absmax, *v_absmax;         /* one per block */
    const float *m_values, *v_values;   /* the signed and unsigned maps' 256 values */
    const uint8_t *m_table, *v_table;   /* nearest code per top-20-bit pattern, padded */
} Quantised;

INLINE void int8_body(int16_t *hi, int16_t *lo, const void *grad, const int kind, const Quantised q,
                             int64_t n, int64_t block_begin, int64_t block_end, const Hyper h, const int fused_v) {
    const uint16_t *hu = (const uint16_t *)hi, *lu = (const uint16_t *)lo;
    float mm[BLOCK], vv[BLOCK], pp[BLOCK];
    for (int64_t b = block_begin; b < block_end; b++) {
        const int64_t s = b * BLOCK;
        const int64_t k = (n - s) < BLOCK ? (n - s) : BLOCK;
        const float ma = q.m_absmax[b], va = q.v_absmax[b];
        for (int j = 0; j < BLOCK; j++) {
            mm[j] = q.m_values[q.mq[s + j]] * ma;
            vv[j] = q.v_values[q.vq[s + j]] * va;
        }
        for (int64_t j = 0; j < k; j++) {
            pp[j] = join(hu, lu, s + j);
            adamw_one(&pp[j], &mm[j], &vv[j], grad_at(grad, kind, s + j), h, fused_v);
            split(hi, lo, s + j, pp[j]);
        }
        for (int64_t j = k; j < BLOCK; j++) mm[j] = vv[j] = 0.0f;  /* the padding past the tensor's end */
        q.m_absmax[b] = quantise_block(mm, q.mq + s, q.m_table);
        q.v_absmax[b] = quantise_block(vv, q.vq + s, q.v_table);
    }
}

#define PICK(CALL_KIND_FUSED)                                       \
    if (fused_v) {                                                  \
        if (kind == GRAD_BF16) CALL_KIND_FUSED(GRAD_BF16, 1);       \
        else if (kind == GRAD_FP16) CALL_KIND_FUSED(GRAD_FP16, 1);  \
        else CALL_KIND_FUSED(GRAD_FP32, 1);                         \
    } else {                                                        \
        if (kind == GRAD_BF16) CALL_KIND_FUSED(GRAD_BF16, 0);       \
        else if (kind == GRAD_FP16) CALL_KIND_FUSED(GRAD_FP16, 0);  \
        else CALL_KIND_FUSED(GRAD_FP32, 0);                         \
    }

void tp_adamw_fp32(int16_t *hi, int16_t *lo, const void *grad, int32_t kind, float *m, float *v, int64_t begin,
                   int64_t end, const Hyper *h, int32_t fused_v) {
#define FP32(K, F) fp32_body(hi, lo, grad, K, m, v, begin, end, *h, F)
    PICK(FP32)
}

void tp_adamw_bf16(int16_t *hi, int16_t *lo, const void *grad, int32_t kind, uint16_t *m, uint16_t *v,
                   int64_t begin, int64_t end, const Hyper *h, int32_t fused_v) {
#define BF16(K, F) bf16_body(hi, lo, grad, K, m, v, begin, end, *h, F)
    PICK(BF16)
}

void tp_adamw_8bit(int16_t *hi, int16_t *lo, const void *grad, int32_t kind, const Quantised *q, int64_t n,
                   int64_t block_begin, int64_t block_end, const Hyper *h, int32_t fused_v) {
#define INT8(K, F) int8_body(hi, lo, grad, K, *q, n, block_begin, block_end, *h, F)
    PICK(INT8)
}

/* A read-modify-write pass over x[begin..end): the host's DRAM bandwidth as the kernels above use it (every byte
 * written was read first, so no write-allocate reads on top; a memcpy into another buffer has those). */
void tp_touch(float *x, int64_t begin, int64_t end, float add) {
    for (int64_t i = begin; i < end; i++) x[i] += add;
}

/* The sum of squares of g[begin..end) in double: eight independent accumulators, one vector of doubles. */
double tp_sum_squares(const void *g, int32_t kind, int64_t begin, int64_t end) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = begin;
#define SUMSQ(K)                                                           \
    for (; i + 8 <= end; i += 8)                                           \
        for (int j = 0; j < 8; j++) {                                      \
            double x = grad_at(g, K, i + j);                               \
            acc[j] += x * x;                                               \
        }
    if (kind == GRAD_BF16) { SUMSQ(GRAD_BF16) }
    else if (kind == GRAD_FP16) { SUMSQ(GRAD_FP16) }
    else { SUMSQ(GRAD_FP32) }
    double s = 0;
    for (; i < end; i++) {
        double x = grad_at(g, kind, i);
        s += x * x;
    }
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}
