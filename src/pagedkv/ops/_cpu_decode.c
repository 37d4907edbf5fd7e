/* pagedkv.ops._cpu_decode: paged decode attention for float32 on a CPU, one thread, reading the pages in place.

decode(query, kv, block_table, seq_lens, out, scale, window)

  query       float32 [B, H, D]            one query per sequence (its newest token), C-contiguous
  kv          float32 [2, NB, BS, Hkv, D]   one layer's pages, K then V, C-contiguous
  block_table int32   [B, W]                block ids of each sequence, in order (padding never read)
  seq_lens    int32   [B]                   tokens with KV, the query's own included (1 <= len <= W * BS)
  out         float32 [B, H, D]            written: softmax(q . k * scale) . v over the visible keys
  scale       float                         the softmax scale
  window      int                           sliding window (> 0: keys at positions >= len - window), 0: none

Query head h reads KV head h / (H / Hkv) (GQA). For each sequence and KV head the kernel reads each visible
key row once for all the query heads that share it, keeps every score (two passes: max, then exp and the
weighted sum of V rows), so the answer is the exact softmax, not an online rescaled one. Sums run in float32
with 8 partial sums per dot product. An x86-64 CPU with AVX2 and FMA runs a copy of the same code compiled
for them (chosen once, at import). Arguments are checked before anything is written; the GIL is released
while the kernel runs. Python side: `pagedkv.ops.cpu_decode`.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *query;
    const float *kv;
    const int32_t *table;
    const int32_t *lens;
    float *out;
    Py_ssize_t batch, heads, kv_heads, dim, num_blocks, block_size, width;
    float scale;
    long window;
} DecodeArgs;

#define DECODE_BODY                                                                                          \
    const Py_ssize_t g = a->heads / a->kv_heads, D = a->dim, bs = a->block_size;                           \
    const Py_ssize_t row = a->kv_heads * D, block = bs * row, half = a->num_blocks * block;                  \
    for (Py_ssize_t b = 0; b < a->batch; b++) {                                                              \
        const Py_ssize_t len = a->lens[b];                                                                   \
        const Py_ssize_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;                   \
        const int32_t *tbl = a->table + b * a->width;                                                        \
        for (Py_ssize_t h = 0; h < a->kv_heads; h++) {                                                       \
            const float *q = a->query + (b * a->heads + h * g) * D;                                          \
            float *o = a->out + (b * a->heads + h * g) * D;                                                  \
            for (Py_ssize_t l = first; l < len; l++) {                                                       \
                const float *k = a->kv + (Py_ssize_t)tbl[l / bs] * block + (l % bs) * row + h * D;           \
                for (Py_ssize_t i = 0; i < g; i++) {                                                         \
                    const float *qi = q + i * D;                                                             \
                    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                 \
                    Py_ssize_t d = 0;                                                                        \
                    for (; d + 8 <= D; d += 8)                                                               \
                        for (int j = 0; j < 8; j++) acc[j] += qi[d + j] * k[d + j];                          \
                    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])); \
                    for (; d < D; d++) s += qi[d] * k[d];                                                    \
                    scores[i * a->width * bs + l] = s * a->scale;                                            \
                }                                                                                            \
            }                                                                                                \
            for (Py_ssize_t i = 0; i < g; i++) {                                                             \
                float *sc = scores + i * a->width * bs;                                                      \
                float m = -INFINITY, sum = 0.0f;                                                             \
                for (Py_ssize_t l = first; l < len; l++) m = sc[l] > m ? sc[l] : m;                          \
                for (Py_ssize_t l = first; l < len; l++) {                                                   \
                    sc[l] = expf(sc[l] - m);                                                                 \
                    sum += sc[l];                                                                            \
                }                                                                                            \
                float *oi = o + i * D;                                                                       \
                memset(oi, 0, (size_t)D * sizeof(float));                                                    \
                for (Py_ssize_t l = first; l < len; l++) {                                                   \
                    const float *v = a->kv + half + (Py_ssize_t)tbl[l / bs] * block + (l % bs) * row + h * D; \
                    const float p = sc[l];                                                                   \
                    for (Py_ssize_t d = 0; d < D; d++) oi[d] += p * v[d];                                    \
                }                                                                                            \
                const float inv = 1.0f / sum;                                                                \
                for (Py_ssize_t d = 0; d < D; d++) oi[d] *= inv;                                             \
            }                                                                                                \
        }                                                                                                    \
    }

static void decode_generic(const DecodeArgs *a, float *scores) { DECODE_BODY }

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_COPY 1
__attribute__((target("avx2,fma"))) static void decode_avx2(const DecodeArgs *a, float *scores) { DECODE_BODY }
#endif

static void (*decode_impl)(const DecodeArgs *, float *) = decode_generic;

/* A C-contiguous buffer of `ndim` dimensions with items of `itemsize` bytes and format `fmt`. */
static int get_array(PyObject *obj, Py_buffer *view, const char *name, const char *fmt, int ndim, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "decode: %s must be a C-contiguous%s %s array", name,
                     writable ? " writable" : "", fmt[0] == 'f' ? "float32" : "int32");
        return -1;
    }
    if (view->ndim != ndim || view->itemsize != 4 || view->format == NULL || view->format[0] != fmt[0] ||
        view->format[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "decode: %s must be a %d-d %s array", name, ndim,
                     fmt[0] == 'f' ? "float32" : "int32");
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

static PyObject *native_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    if (kwnames != NULL || nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "decode(query, kv, block_table, seq_lens, out, scale, window): 7 "
                                         "positional arguments");
        return NULL;
    }
    const double scale = PyFloat_AsDouble(args[5]);
    const long window = PyLong_AsLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    PyObject *result = NULL;
    Py_buffer q, kv, t, s, o;
    if (get_array(args[0], &q, "query", "f", 3, 0) < 0) return NULL;
    if (get_array(args[1], &kv, "kv", "f", 5, 0) < 0) goto fail_q;
    if (get_array(args[2], &t, "block_table", "i", 2, 0) < 0) goto fail_kv;
    if (get_array(args[3], &s, "seq_lens", "i", 1, 0) < 0) goto fail_t;
    if (get_array(args[4], &o, "out", "f", 3, 1) < 0) goto fail_s;
    DecodeArgs a = {q.buf, kv.buf, t.buf, s.buf, o.buf, q.shape[0], q.shape[1], kv.shape[3], q.shape[2],
                    kv.shape[1], kv.shape[2], t.shape[1], (float)scale, window};
    if (check_args(&a, &q, &kv, &t, &s, &o) == 0) {
        const Py_ssize_t g = a.kv_heads > 0 ? a.heads / a.kv_heads : 0;
        float *scores = malloc(sizeof(float) * (size_t)(g > 0 ? g : 1) * (size_t)(a.width * a.block_size + 1));
        if (scores == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS decode_impl(&a, scores);
            Py_END_ALLOW_THREADS free(scores);
            result = Py_NewRef(Py_None);
        }
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

static PyObject *native_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef HAVE_AVX2_COPY
    if (decode_impl == decode_avx2) return PyUnicode_FromString("avx2+fma");
#endif
    return PyUnicode_FromString("generic");
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))native_decode, METH_FASTCALL | METH_KEYWORDS,
     "decode(query, kv, block_table, seq_lens, out, scale, window): paged float32 decode attention into out."},
    {"isa", native_isa, METH_NOARGS, "Which compiled copy of the kernel runs: 'avx2+fma' or 'generic'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_decode", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_decode(void) {
#ifdef HAVE_AVX2_COPY
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) decode_impl = decode_avx2;
#endif
    return PyModule_Create(&module);
}
