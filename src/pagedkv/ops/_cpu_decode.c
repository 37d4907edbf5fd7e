/* pagedkv.ops._cpu_decode: paged decode attention in float32 on a CPU, one thread, reading the pages (float32,
bfloat16 or quantized) in place.

decode(query, kv, block_table, seq_lens, out, scale, window)

  query       float32 [B, H, D]            one query per sequence (its newest token), C-contiguous
  kv          float32 [2, NB, BS, Hkv, D]   one layer's pages, K then V, C-contiguous
  block_table int32   [B, W]                block ids of each sequence, in order (padding never read)
  seq_lens    int32   [B]                   tokens with KV, the query's own included (1 <= len <= W * BS)
  out         float32 [B, H, D]            written: softmax(q . k * scale) . v over the visible keys
  scale       float                         the softmax scale
  window      int                           sliding window (> 0: keys at positions >= len - window), 0: none

Query head h reads KV head h / (H / Hkv) (GQA). For each sequence the kernel first lists its visible key
rows (one pointer per position, found block by block, so no division per key), then for each KV head scores
every visible key against all the query heads that share it, keeps every score (two passes: max, then exp and
the weighted sum of V rows), so the answer is the exact softmax, not an online rescaled one. A dot product runs
in float32 over 8 partial sums (lane j takes the elements d = j mod 8) added as ((0+1)+(2+3))+((4+5)+(6+7)),
the same order wherever the key sits, so a sequence's output depends only on its own tokens, not on the batch
or on which blocks hold them. An x86-64 CPU with AVX2, FMA and F16C runs a vectorised copy (eight keys scored at
once, the value sum kept in registers) for head sizes that are a multiple of 8, chosen once at import
(`set_isa` switches, for tests); the portable copy serves the rest. Arguments are checked before anything is
written; the GIL is released while the kernel runs. Python side: `pagedkv.ops.cpu_decode`.

decode_bf16(query, kv, block_table, seq_lens, out, scale, window)

  kv          int16   [2, NB, BS, Hkv, D]   one layer's bfloat16 pages (their bit patterns), K then V

The same attention over bfloat16 pages (query and out stay float32): a bfloat16 is the top half of a float32,
so each key and value element is widened in registers as it is read (bits << 16, exact) and everything else is
decode's float32 arithmetic in decode's order: the answer is bit-identical to decode's over the pages upcast
to float32, with half the page bytes to read.

decode_codes(query, codes, scales, lut, block_table, seq_lens, out, scale, window, kind)

  codes       uint8   [2, NB, BS, Hkv, D]   one layer's quantized pages (int8 or fp8 bit patterns), K then V
  scales      float32 [2, NB, S, Hkv]       S = BS: the scale of each token's KV head; S = 1: of each block's
                                            KV head (the block scheme); a value is code * its scale
  lut         float32 [256]                 the value of each code before scaling (int8: the integer; fp8: the float)

The same attention over the pages' values, computed as the float32 kernel computes it over pages holding
fl(code * scale): each key and value element is dequantized in registers as it is read (no dequantized copy of
any block), so both give bit-identical outputs. `kind` (0 any code through `lut`, 1 int8, 2 fp8 e4m3, 3 fp8
e5m2) lets the vector copy convert codes in registers (int8 directly, fp8 with F16C) instead of looking them up;
it dequantizes 8 key rows, or 32 value rows, at a time into a small buffer shared by the query heads of a KV
head (a few KiB, in L1), never a block.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *query;
    const void *kv; /* float32, or bfloat16 bit patterns when bf16 */
    const int32_t *table;
    const int32_t *lens;
    float *out;
    Py_ssize_t batch, heads, kv_heads, dim, num_blocks, block_size, width;
    float scale;
    long window;
    int bf16;
} DecodeArgs;

#define INLINE inline __attribute__((always_inline))

/* The float32 value of element i of a page row at p: a float32, or a bfloat16 widened (its bits are the top
half of the float32's, so the widening is exact). `bf16` is a constant wherever this is inlined. */
static INLINE float elem(const char *p, Py_ssize_t i, const int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The address of each visible key row of sequence b (KV head 0; head h is element `h * dim` of it, its V row
element `half + h * dim`), in position order, into rows[0..n); returns n. One division per block, none per key. */
static Py_ssize_t visible_rows(const DecodeArgs *a, Py_ssize_t b, const char **rows) {
    const Py_ssize_t es = a->bf16 ? 2 : 4;
    const Py_ssize_t bs = a->block_size, row = a->kv_heads * a->dim * es, block = bs * row, len = a->lens[b];
    const Py_ssize_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int32_t *tbl = a->table + b * a->width;
    Py_ssize_t n = 0;
    for (Py_ssize_t l = first; l < len;) {
        const Py_ssize_t j = l / bs;
        const char *base = (const char *)a->kv + (Py_ssize_t)tbl[j] * block;
        for (Py_ssize_t t = l - j * bs; t < bs && l < len; t++, l++) rows[n++] = base + t * row;
    }
    return n;
}

/* scores[0..n) -> exp(score - max), in place; returns their sum. */
static float softmax_numerators(float *sc, Py_ssize_t n) {
    float m = -INFINITY, sum = 0.0f;
    for (Py_ssize_t l = 0; l < n; l++) m = sc[l] > m ? sc[l] : m;
    for (Py_ssize_t l = 0; l < n; l++) {
        sc[l] = expf(sc[l] - m);
        sum += sc[l];
    }
    return sum;
}

/* The portable copy: any head size; pages of float32 or (bf16) bfloat16. */
static INLINE void decode_generic_pages(const DecodeArgs *a, float *scores, const char **rows, const int bf16) {
    const Py_ssize_t g = a->heads / a->kv_heads, D = a->dim;
    const Py_ssize_t half = a->num_blocks * a->block_size * a->kv_heads * D;
    for (Py_ssize_t b = 0; b < a->batch; b++) {
        const Py_ssize_t n = visible_rows(a, b, rows);
        for (Py_ssize_t h = 0; h < a->kv_heads; h++) {
            const float *q = a->query + (b * a->heads + h * g) * D;
            float *o = a->out + (b * a->heads + h * g) * D;
            for (Py_ssize_t l = 0; l < n; l++) {
                const char *k = rows[l];
                for (Py_ssize_t i = 0; i < g; i++) {
                    const float *qi = q + i * D;
                    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    Py_ssize_t d = 0;
                    for (; d + 8 <= D; d += 8)
                        for (int j = 0; j < 8; j++) acc[j] += qi[d + j] * elem(k, h * D + d + j, bf16);
                    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                    for (; d < D; d++) s += qi[d] * elem(k, h * D + d, bf16);
                    scores[i * n + l] = s * a->scale;
                }
            }
            for (Py_ssize_t i = 0; i < g; i++) {
                float *sc = scores + i * n;
                const float inv = 1.0f / softmax_numerators(sc, n);
                float *oi = o + i * D;
                memset(oi, 0, (size_t)D * sizeof(float));
                for (Py_ssize_t l = 0; l < n; l++) {
                    const float p = sc[l];
                    for (Py_ssize_t d = 0; d < D; d++) oi[d] += p * elem(rows[l], half + h * D + d, bf16);
                }
                for (Py_ssize_t d = 0; d < D; d++) oi[d] *= inv;
            }
        }
    }
}

static void decode_generic(const DecodeArgs *a, float *scores, const char **rows) {
    if (a->bf16)
        decode_generic_pages(a, scores, rows, 1);
    else
        decode_generic_pages(a, scores, rows, 0);
}


/* ---- quantized pages: one-byte codes and a float32 scale per token (or block) and KV head ---- */

typedef struct {
    const float *query;
    const uint8_t *codes;
    const float *scales;
    const float *lut;
    const int32_t *table;
    const int32_t *lens;
    float *out;
    Py_ssize_t batch, heads, kv_heads, dim, num_blocks, block_size, width;
    float scale;
    long window;
    int kind; /* CODES_LUT (any code through `lut`), CODES_INT8, CODES_E4M3, CODES_E5M2 */
    Py_ssize_t scale_rows; /* scale rows per block: block_size (one per token) or 1 (one per block) */
} CodesArgs;

enum { CODES_LUT = 0, CODES_INT8 = 1, CODES_E4M3 = 2, CODES_E5M2 = 3 };
#define V_TILE 32 /* value rows the vector copy dequantizes at once, shared by the query heads of a KV head */

/* The slot (block * BS + offset) of each visible key of sequence b, in position order; returns n. */
static Py_ssize_t visible_slots(const CodesArgs *a, Py_ssize_t b, Py_ssize_t *slots) {
    const Py_ssize_t bs = a->block_size, len = a->lens[b];
    const Py_ssize_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int32_t *tbl = a->table + b * a->width;
    Py_ssize_t n = 0;
    for (Py_ssize_t l = first; l < len;) {
        const Py_ssize_t j = l / bs, base = (Py_ssize_t)tbl[j] * bs;
        for (Py_ssize_t t = l - j * bs; t < bs && l < len; t++, l++) slots[n++] = base + t;
    }
    return n;
}

/* The scale of K (v = 0) or V (v = 1) at a slot's KV head h: scales are [2, NB, S, Hkv], S = BS (one per token)
or 1 (one per block: the block's row, slot / BS). */
static inline float row_scale(const CodesArgs *a, int v, Py_ssize_t slot, Py_ssize_t h) {
    const Py_ssize_t per = a->scale_rows, row = per == a->block_size ? slot : slot / a->block_size;
    return a->scales[(v * a->num_blocks * per + row) * a->kv_heads + h];
}

/* The row of K (v = 0) or V (v = 1) at a slot's KV head h, dequantized: out[d] = lut[code] * scale. */
static inline void dequant_row(const CodesArgs *a, int v, Py_ssize_t slot, Py_ssize_t h, float *out) {
    const Py_ssize_t D = a->dim, rows = a->num_blocks * a->block_size * a->kv_heads;
    const uint8_t *c = a->codes + (v * rows + slot * a->kv_heads + h) * D;
    const float s = row_scale(a, v, slot, h);
    for (Py_ssize_t d = 0; d < D; d++) out[d] = a->lut[c[d]] * s;
}

/* The portable copy: decode_generic's arithmetic over rows dequantized into a small buffer. */
static void codes_generic(const CodesArgs *a, float *scores, Py_ssize_t *slots, float *row) {
    const Py_ssize_t g = a->heads / a->kv_heads, D = a->dim, H = a->kv_heads;
    for (Py_ssize_t b = 0; b < a->batch; b++) {
        const Py_ssize_t n = visible_slots(a, b, slots);
        for (Py_ssize_t h = 0; h < H; h++) {
            const float *q = a->query + (b * a->heads + h * g) * D;
            float *o = a->out + (b * a->heads + h * g) * D;
            for (Py_ssize_t l = 0; l < n; l++) {
                dequant_row(a, 0, slots[l], h, row);
                for (Py_ssize_t i = 0; i < g; i++) {
                    const float *qi = q + i * D;
                    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    Py_ssize_t d = 0;
                    for (; d + 8 <= D; d += 8)
                        for (int j = 0; j < 8; j++) acc[j] += qi[d + j] * row[d + j];
                    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                    for (; d < D; d++) s += qi[d] * row[d];
                    scores[i * n + l] = s * a->scale;
                }
            }
            for (Py_ssize_t i = 0; i < g; i++) {
                float *sc = scores + i * n;
                const float inv = 1.0f / softmax_numerators(sc, n);
                float *oi = o + i * D;
                memset(oi, 0, (size_t)D * sizeof(float));
                for (Py_ssize_t l = 0; l < n; l++) {
                    dequant_row(a, 1, slots[l], h, row);
                    const float p = sc[l];
                    for (Py_ssize_t d = 0; d < D; d++) oi[d] += p * row[d];
                }
                for (Py_ssize_t d = 0; d < D; d++) oi[d] *= inv;
            }
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_COPY 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* lane sums of x in the order ((0+1)+(2+3))+((4+5)+(6+7)), broadcast */
AVX2 static inline float hsum8(__m256 x) {
    const __m256 t = _mm256_hadd_ps(x, x);
    const __m256 u = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

/* Elements i .. i + 7 of a page row at p as floats: float32 loaded, bfloat16 widened (zero-extended to 32
bits, shifted into the top half: exact). */
AVX2 static INLINE __m256 elems8(const char *p, Py_ssize_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* q . k of eight keys at once (elements off .. off + D of each row k[j]), each summed in hsum8's order */
AVX2 static INLINE __m256 dot8(const float *q, const char *const *k, Py_ssize_t off, Py_ssize_t D, const int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (Py_ssize_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, elems8(k[0], off + d, bf16), a0);
        a1 = _mm256_fmadd_ps(x, elems8(k[1], off + d, bf16), a1);
        a2 = _mm256_fmadd_ps(x, elems8(k[2], off + d, bf16), a2);
        a3 = _mm256_fmadd_ps(x, elems8(k[3], off + d, bf16), a3);
        a4 = _mm256_fmadd_ps(x, elems8(k[4], off + d, bf16), a4);
        a5 = _mm256_fmadd_ps(x, elems8(k[5], off + d, bf16), a5);
        a6 = _mm256_fmadd_ps(x, elems8(k[6], off + d, bf16), a6);
        a7 = _mm256_fmadd_ps(x, elems8(k[7], off + d, bf16), a7);
    }
    /* after two hadds lane j of the low half holds key j's ((0+1)+(2+3)), of the high half its ((4+5)+(6+7)) */
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* e^x of eight floats: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, 2^n put in
the exponent bits), within 2 ulp of libm's over the range softmax uses (x <= 0); below -88.37 it is 0, a NaN
stays NaN (`max(lo, x)` and `min(hi, x)` return x when x is NaN). */
AVX2 static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* softmax_numerators with eight lanes: the max, e^(x - max) in place, and their sum (lane sums added in
hsum8's order, then the tail in position order). */
AVX2 static float softmax_numerators8(float *sc, Py_ssize_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    Py_ssize_t l = 0;
    for (; l + 8 <= n; l += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sc + l), mv); /* a NaN never wins */
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; l < n; l++) m = sc[l] > m ? sc[l] : m;
    const __m256 top = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (l = 0; l + 8 <= n; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + l), top));
        _mm256_storeu_ps(sc + l, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; l < n; l++) {
        sc[l] = expf(sc[l] - m);
        sum += sc[l];
    }
    return sum;
}

/* o[0..8*nv) = inv * sum_l p[l] * (elements off .. off + 8*nv of rows[l]), nv <= 8, kept in registers */
AVX2 static INLINE void weighted_sum(float *o, const float *p, const char *const *rows, Py_ssize_t n,
                                     Py_ssize_t off, int nv, float inv, const int bf16) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    if (nv == 8) {
        for (Py_ssize_t l = 0; l < n; l++) {
            const __m256 w = _mm256_broadcast_ss(p + l);
            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(w, elems8(rows[l], off + 8 * c, bf16), acc[c]);
        }
    } else {
        for (Py_ssize_t l = 0; l < n; l++) {
            const __m256 w = _mm256_broadcast_ss(p + l);
            for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(w, elems8(rows[l], off + 8 * c, bf16), acc[c]);
        }
    }
    const __m256 s = _mm256_set1_ps(inv);
    for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], s));
}

/* The AVX2 + FMA copy: head sizes that are a multiple of 8 (decode_avx2 sends the others to the portable
copy); pages of float32 or (bf16) bfloat16. */
AVX2 static INLINE void decode_avx2_pages(const DecodeArgs *a, float *scores, const char **rows, const int bf16) {
    const Py_ssize_t g = a->heads / a->kv_heads, D = a->dim;
    const Py_ssize_t half = a->num_blocks * a->block_size * a->kv_heads * D;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (Py_ssize_t b = 0; b < a->batch; b++) {
        const Py_ssize_t n = visible_rows(a, b, rows);
        for (Py_ssize_t h = 0; h < a->kv_heads; h++) {
            const float *q = a->query + (b * a->heads + h * g) * D;
            float *o = a->out + (b * a->heads + h * g) * D;
            for (Py_ssize_t i = 0; i < g; i++) {
                const float *qi = q + i * D;
                float *sc = scores + i * n;
                Py_ssize_t l = 0;
                for (; l + 8 <= n; l += 8)
                    _mm256_storeu_ps(sc + l, _mm256_mul_ps(dot8(qi, rows + l, h * D, D, bf16), scale));
                for (; l < n; l++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (Py_ssize_t d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), elems8(rows[l], h * D + d, bf16), acc);
                    sc[l] = hsum8(acc) * a->scale;
                }
            }
            for (Py_ssize_t i = 0; i < g; i++) {
                float *sc = scores + i * n;
                const float inv = 1.0f / softmax_numerators8(sc, n);
                for (Py_ssize_t d0 = 0; d0 < D; d0 += 64) {
                    const int nv = (int)((D - d0 < 64 ? D - d0 : 64) / 8);
                    weighted_sum(o + i * D + d0, sc, rows, n, half + h * D + d0, nv, inv, bf16);
                }
            }
        }
    }
}

AVX2 static void decode_avx2(const DecodeArgs *a, float *scores, const char **rows) {
    if (a->dim % 8 != 0)
        decode_generic(a, scores, rows);
    else if (a->bf16)
        decode_avx2_pages(a, scores, rows, 1);
    else
        decode_avx2_pages(a, scores, rows, 0);
}

/* Eight codes at c as floats, exactly their values: int8 converted directly; fp8 through F16C, e5m2 being the
high byte of a half and e4m3's exponent and mantissa bits a half's shifted by one (value / 256, so times 256,
exact). */
AVX2 static inline __m256 code_values8(int kind, const uint8_t *c) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)c);
    if (kind == CODES_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    const __m128i x = _mm_cvtepu8_epi16(raw);
    if (kind == CODES_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
    const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(bits), _mm256_set1_ps(256.0f));
}

/* The row of K (v = 0) or V (v = 1) at a slot's KV head h dequantized into out[0..D): fl(value * scale). */
AVX2 static inline void dequant_row8(const CodesArgs *a, int v, Py_ssize_t slot, Py_ssize_t h, float *out) {
    const Py_ssize_t D = a->dim, rows = a->num_blocks * a->block_size * a->kv_heads;
    const uint8_t *c = a->codes + (v * rows + slot * a->kv_heads + h) * D;
    const __m256 s = _mm256_set1_ps(row_scale(a, v, slot, h));
    for (Py_ssize_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(code_values8(a->kind, c + d), s));
}

/* The AVX2 + FMA + F16C copy over codes: head sizes that are a multiple of 8 (the others go to the portable
copy). decode_avx2's arithmetic on rows dequantized a few at a time into `buf` (8 key rows, or V_TILE value
rows, once for all the query heads that share them); the value sums go through `out` between tiles, exact
float32 stores, so the sums are the float kernel's. */
AVX2 static void codes_avx2(const CodesArgs *a, float *scores, Py_ssize_t *slots, float *buf) {
    const Py_ssize_t g = a->heads / a->kv_heads, D = a->dim, H = a->kv_heads;
    if (D % 8 != 0 || a->kind == CODES_LUT) {
        codes_generic(a, scores, slots, buf);
        return;
    }
    const __m256 scale = _mm256_set1_ps(a->scale);
    const char *k[8];
    for (int j = 0; j < 8; j++) k[j] = (const char *)(buf + j * D);
    for (Py_ssize_t b = 0; b < a->batch; b++) {
        const Py_ssize_t n = visible_slots(a, b, slots);
        for (Py_ssize_t h = 0; h < H; h++) {
            const float *q = a->query + (b * a->heads + h * g) * D;
            float *o = a->out + (b * a->heads + h * g) * D;
            Py_ssize_t l = 0;
            for (; l + 8 <= n; l += 8) {
                for (int j = 0; j < 8; j++) dequant_row8(a, 0, slots[l + j], h, buf + j * D);
                for (Py_ssize_t i = 0; i < g; i++)
                    _mm256_storeu_ps(scores + i * n + l, _mm256_mul_ps(dot8(q + i * D, k, 0, D, 0), scale));
            }
            for (; l < n; l++) {
                dequant_row8(a, 0, slots[l], h, buf);
                for (Py_ssize_t i = 0; i < g; i++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (Py_ssize_t d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), _mm256_loadu_ps(buf + d), acc);
                    scores[i * n + l] = hsum8(acc) * a->scale;
                }
            }
            float *inv = scores + g * n; /* g more floats at the end of `scores` */
            for (Py_ssize_t i = 0; i < g; i++) inv[i] = 1.0f / softmax_numerators8(scores + i * n, n);
            memset(o, 0, (size_t)(g * D) * sizeof(float));
            for (Py_ssize_t l0 = 0; l0 < n; l0 += V_TILE) {
                const Py_ssize_t m = n - l0 < V_TILE ? n - l0 : V_TILE;
                for (Py_ssize_t j = 0; j < m; j++) dequant_row8(a, 1, slots[l0 + j], h, buf + j * D);
                for (Py_ssize_t i = 0; i < g; i++) {
                    const float *sc = scores + i * n + l0;
                    for (Py_ssize_t d0 = 0; d0 < D; d0 += 64) {
                        const int nv = (int)((D - d0 < 64 ? D - d0 : 64) / 8);
                        float *oi = o + i * D + d0;
                        __m256 acc[8];
                        for (int c = 0; c < nv; c++) acc[c] = _mm256_loadu_ps(oi + 8 * c);
                        for (Py_ssize_t j = 0; j < m; j++) {
                            const __m256 w = _mm256_broadcast_ss(sc + j);
                            const float *v = buf + j * D + d0;
                            for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
                        }
                        for (int c = 0; c < nv; c++) _mm256_storeu_ps(oi + 8 * c, acc[c]);
                    }
                }
            }
            for (Py_ssize_t i = 0; i < g; i++) {
                const __m256 s = _mm256_set1_ps(inv[i]);
                for (Py_ssize_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + i * D + d, _mm256_mul_ps(_mm256_loadu_ps(o + i * D + d), s));
            }
        }
    }
}
#endif

static void (*decode_impl)(const DecodeArgs *, float *, const char **) = decode_generic;
static void (*codes_impl)(const CodesArgs *, float *, Py_ssize_t *, float *) = codes_generic;

/* A C-contiguous buffer of `ndim` dimensions with format `fmt`: "f" float32, "i" int32, "h" int16 (bfloat16
bit patterns). */
static int get_array(PyObject *obj, Py_buffer *view, const char *name, const char *fmt, int ndim, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    const char *type = fmt[0] == 'f' ? "float32" : fmt[0] == 'i' ? "int32" : "int16 (bfloat16 bits)";
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "decode: %s must be a C-contiguous%s %s array", name,
                     writable ? " writable" : "", type);
        return -1;
    }
    if (view->ndim != ndim || view->itemsize != (fmt[0] == 'h' ? 2 : 4) || view->format == NULL ||
        view->format[0] != fmt[0] || view->format[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "decode: %s must be a %d-d %s array", name, ndim, type);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Shapes agree, every length is in [1, W * BS] and every block a sequence reads is in [0, NB). */
static int check_args(const DecodeArgs *a, const Py_buffer *q, const Py_buffer *kv, const Py_buffer *t,
                      const Py_buffer *s, const Py_buffer *o) {
    if (kv->shape[0] != 2 || q->shape[0] != t->shape[0] || s->shape[0] != q->shape[0] ||
        q->shape[2] != kv->shape[4] || o->shape[0] != q->shape[0] || o->shape[1] != q->shape[1] ||
        o->shape[2] != q->shape[2] || a->kv_heads < 1 || a->heads % a->kv_heads != 0 || a->dim < 1 ||
        a->block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "decode: shapes disagree (query [B,H,D], kv [2,NB,BS,Hkv,D] with H a "
                                          "multiple of Hkv, block_table [B,W], seq_lens [B], out [B,H,D])");
        return -1;
    }
    for (Py_ssize_t b = 0; b < a->batch; b++) {
        const Py_ssize_t len = a->lens[b];
        if (len < 1 || len > a->width * a->block_size) {
            PyErr_Format(PyExc_ValueError, "decode: seq_lens[%zd] = %zd is outside [1, %zd]", b, len,
                         a->width * a->block_size);
            return -1;
        }
        for (Py_ssize_t j = 0; j < (len + a->block_size - 1) / a->block_size; j++) {
            const int32_t id = a->table[b * a->width + j];
            if (id < 0 || id >= a->num_blocks) {
                PyErr_Format(PyExc_ValueError, "decode: block_table[%zd, %zd] = %d is outside [0, %zd)", b, j,
                             (int)id, a->num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

/* decode_impl over sequences [lo, hi) of a, with their own scratch: every sequence is computed alone, so any
cut of the batch gives the same answer. */
static void decode_rows(const DecodeArgs *a, Py_ssize_t lo, Py_ssize_t hi, float *scores, const char **rows) {
    DecodeArgs part = *a;
    part.query = a->query + lo * a->heads * a->dim;
    part.out = a->out + lo * a->heads * a->dim;
    part.table = a->table + lo * a->width;
    part.lens = a->lens + lo;
    part.batch = hi - lo;
    decode_impl(&part, scores, rows);
}

/* decode (bf16 = 0: float32 pages) and decode_bf16 (bf16 = 1: bfloat16 pages as int16); an optional 8th
argument runs the batch on that many OpenMP threads (contiguous parts, one per thread): in a build with
OpenMP, on the team torch's own threads form where torch's libgomp is the one loaded. */
static PyObject *decode_pages(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int bf16) {
    if (kwnames != NULL || (nargs != 7 && nargs != 8)) {
        PyErr_Format(PyExc_TypeError, "%s(query, kv, block_table, seq_lens, out, scale, window[, threads]): 7 or 8 "
                                      "positional arguments", bf16 ? "decode_bf16" : "decode");
        return NULL;
    }
    const double scale = PyFloat_AsDouble(args[5]);
    const long window = PyLong_AsLong(args[6]);
    const long threads = nargs == 8 ? PyLong_AsLong(args[7]) : 1;
    if (PyErr_Occurred()) return NULL;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "decode: threads must be >= 1, got %ld", threads);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer q, kv, t, s, o;
    if (get_array(args[0], &q, "query", "f", 3, 0) < 0) return NULL;
    if (get_array(args[1], &kv, "kv", bf16 ? "h" : "f", 5, 0) < 0) goto fail_q;
    if (get_array(args[2], &t, "block_table", "i", 2, 0) < 0) goto fail_kv;
    if (get_array(args[3], &s, "seq_lens", "i", 1, 0) < 0) goto fail_t;
    if (get_array(args[4], &o, "out", "f", 3, 1) < 0) goto fail_s;
    DecodeArgs a = {q.buf, kv.buf, t.buf, s.buf, o.buf, q.shape[0], q.shape[1], kv.shape[3], q.shape[2],
                    kv.shape[1], kv.shape[2], t.shape[1], (float)scale, window, bf16};
    if (check_args(&a, &q, &kv, &t, &s, &o) == 0) {
        const Py_ssize_t g = a.kv_heads > 0 ? a.heads / a.kv_heads : 0;
        const size_t keys = (size_t)(a.width * a.block_size + 1), per = (size_t)(g > 0 ? g : 1) * keys;
#ifdef _OPENMP
        const int team = (int)(threads < a.batch ? threads : (a.batch > 0 ? a.batch : 1));
#else
        const int team = 1;
#endif
        float *scores = malloc(sizeof(float) * per * (size_t)team);
        const char **rows = malloc(sizeof(char *) * keys * (size_t)team);
        if (scores == NULL || rows == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
            if (team > 1) {
#pragma omp parallel num_threads(team)
                {
                    const Py_ssize_t t = omp_get_thread_num(), n = omp_get_num_threads();
                    decode_rows(&a, a.batch * t / n, a.batch * (t + 1) / n, scores + per * (size_t)t,
                                rows + keys * (size_t)t);
                }
            } else
#endif
                decode_impl(&a, scores, rows);
            Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
        }
        free(scores);
        free(rows);
    }
    PyBuffer_Release(&o);
fail_s:
    PyBuffer_Release(&s);
fail_t:
    PyBuffer_Release(&t);
fail_kv:
    PyBuffer_Release(&kv);
fail_q:
    PyBuffer_Release(&q);
    return result;
}

static PyObject *native_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return decode_pages(args, nargs, kwnames, 0);
}

static PyObject *native_decode_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    return decode_pages(args, nargs, kwnames, 1);
}


/* A C-contiguous uint8 buffer of `ndim` dimensions (the code pages). */
static int get_codes(PyObject *obj, Py_buffer *view, int ndim) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "decode_codes: codes must be a C-contiguous uint8 array");
        return -1;
    }
    if (view->ndim != ndim || view->itemsize != 1 || view->format == NULL || view->format[0] != 'B') {
        PyErr_Format(PyExc_TypeError, "decode_codes: codes must be a %d-d uint8 array", ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* codes_impl over sequences [lo, hi) of a, with their own scratch (see decode_rows). */
static void codes_rows(const CodesArgs *a, Py_ssize_t lo, Py_ssize_t hi, float *scores, Py_ssize_t *slots,
                       float *row) {
    CodesArgs part = *a;
    part.query = a->query + lo * a->heads * a->dim;
    part.out = a->out + lo * a->heads * a->dim;
    part.table = a->table + lo * a->width;
    part.lens = a->lens + lo;
    part.batch = hi - lo;
    codes_impl(&part, scores, slots, row);
}

/* decode_codes; an optional 11th argument runs the batch on that many OpenMP threads, as decode's 8th. */
static PyObject *native_decode_codes(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    if (kwnames != NULL || (nargs != 10 && nargs != 11)) {
        PyErr_SetString(PyExc_TypeError, "decode_codes(query, codes, scales, lut, block_table, seq_lens, out, scale, "
                                         "window, kind[, threads]): 10 or 11 positional arguments");
        return NULL;
    }
    const double scale = PyFloat_AsDouble(args[7]);
    const long window = PyLong_AsLong(args[8]);
    const long kind = PyLong_AsLong(args[9]);
    const long threads = nargs == 11 ? PyLong_AsLong(args[10]) : 1;
    if (PyErr_Occurred()) return NULL;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "decode_codes: threads must be >= 1, got %ld", threads);
        return NULL;
    }
    if (kind < CODES_LUT || kind > CODES_E5M2) {
        PyErr_SetString(PyExc_ValueError, "decode_codes: kind must be 0 (lut), 1 (int8), 2 (e4m3) or 3 (e5m2)");
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer q, c, sc, lut, t, s, o;
    if (get_array(args[0], &q, "query", "f", 3, 0) < 0) return NULL;
    if (get_codes(args[1], &c, 5) < 0) goto fail_q;
    if (get_array(args[2], &sc, "scales", "f", 4, 0) < 0) goto fail_c;
    if (get_array(args[3], &lut, "lut", "f", 1, 0) < 0) goto fail_sc;
    if (get_array(args[4], &t, "block_table", "i", 2, 0) < 0) goto fail_lut;
    if (get_array(args[5], &s, "seq_lens", "i", 1, 0) < 0) goto fail_t;
    if (get_array(args[6], &o, "out", "f", 3, 1) < 0) goto fail_s;
    /* the shape checks of the float kernel, on a DecodeArgs view of the same shapes */
    DecodeArgs d = {q.buf, NULL, t.buf, s.buf, o.buf, q.shape[0], q.shape[1], c.shape[3], q.shape[2],
                    c.shape[1], c.shape[2], t.shape[1], (float)scale, window, 0};
    if (lut.shape[0] != 256 || sc.shape[0] != 2 || sc.shape[1] != c.shape[1] ||
        (sc.shape[2] != c.shape[2] && sc.shape[2] != 1) || sc.shape[3] != c.shape[3]) {
        PyErr_SetString(PyExc_ValueError,
                        "decode_codes: scales must be [2, NB, BS or 1, Hkv] like the codes, lut [256]");
    } else if (check_args(&d, &q, &c, &t, &s, &o) == 0) {
        CodesArgs a = {q.buf, c.buf, sc.buf, lut.buf, t.buf, s.buf, o.buf, d.batch, d.heads, d.kv_heads, d.dim,
                       d.num_blocks, d.block_size, d.width, (float)scale, window, (int)kind, sc.shape[2]};
        const Py_ssize_t g = a.kv_heads > 0 ? a.heads / a.kv_heads : 0;
        const size_t keys = (size_t)(a.width * a.block_size + 1), per = (size_t)(g > 0 ? g : 1) * (keys + 1);
        const size_t tile = (size_t)(a.dim * V_TILE);
#ifdef _OPENMP
        const int team = (int)(threads < a.batch ? threads : (a.batch > 0 ? a.batch : 1));
#else
        const int team = 1;
#endif
        float *scores = malloc(sizeof(float) * per * (size_t)team);
        Py_ssize_t *slots = malloc(sizeof(Py_ssize_t) * keys * (size_t)team);
        float *row = malloc(sizeof(float) * tile * (size_t)team);
        if (scores == NULL || slots == NULL || row == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
            if (team > 1) {
#pragma omp parallel num_threads(team)
                {
                    const Py_ssize_t t = omp_get_thread_num(), n = omp_get_num_threads();
                    codes_rows(&a, a.batch * t / n, a.batch * (t + 1) / n, scores + per * (size_t)t,
                               slots + keys * (size_t)t, row + tile * (size_t)t);
                }
            } else
#endif
                codes_impl(&a, scores, slots, row);
            Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
        }
        free(scores);
        free(slots);
        free(row);
    }
    PyBuffer_Release(&o);
fail_s:
    PyBuffer_Release(&s);
fail_t:
    PyBuffer_Release(&t);
fail_lut:
    PyBuffer_Release(&lut);
fail_sc:
    PyBuffer_Release(&sc);
fail_c:
    PyBuffer_Release(&c);
fail_q:
    PyBuffer_Release(&q);
    return result;
}

static PyObject *native_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef HAVE_AVX2_COPY
    if (decode_impl == decode_avx2) return PyUnicode_FromString("avx2+fma");
#endif
    return PyUnicode_FromString("generic");
}

static PyObject *native_openmp(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *native_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    if (strcmp(name, "generic") == 0) {
        decode_impl = decode_generic;
        codes_impl = codes_generic;
        Py_RETURN_NONE;
    }
#ifdef HAVE_AVX2_COPY
    if (strcmp(name, "avx2+fma") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        decode_impl = decode_avx2;
        codes_impl = codes_avx2;
        Py_RETURN_NONE;
    }
#endif
    PyErr_Format(PyExc_ValueError, "set_isa: %s is not a copy this build and CPU can run", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))native_decode, METH_FASTCALL | METH_KEYWORDS,
     "decode(query, kv, block_table, seq_lens, out, scale, window): paged float32 decode attention into out."},
    {"decode_bf16", (PyCFunction)(void (*)(void))native_decode_bf16, METH_FASTCALL | METH_KEYWORDS,
     "decode_bf16(query, kv, block_table, seq_lens, out, scale, window): decode over bfloat16 pages (int16 "
     "bits)."},
    {"decode_codes", (PyCFunction)(void (*)(void))native_decode_codes, METH_FASTCALL | METH_KEYWORDS,
     "decode_codes(query, codes, scales, lut, block_table, seq_lens, out, scale, window, kind): paged decode "
     "attention over quantized pages into out."},
    {"isa", native_isa, METH_NOARGS, "Which compiled copy of the kernel runs: 'avx2+fma' or 'generic'."},
    {"openmp", native_openmp, METH_NOARGS, "Whether the kernels can split a batch over OpenMP threads."},
    {"set_isa", native_set_isa, METH_O, "set_isa(name): run the 'generic' or the 'avx2+fma' copy from now on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_decode", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_decode(void) {
#ifdef HAVE_AVX2_COPY
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        decode_impl = decode_avx2;
        codes_impl = codes_avx2;
    }
#endif
    return PyModule_Create(&module);
}
