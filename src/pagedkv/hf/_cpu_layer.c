/* pagedkv.hf._cpu_layer: the element-wise parts of a Llama layer on a CPU, fused and split over threads.

Every function takes raw addresses (a tensor's `data_ptr()`) and sizes and does no checking: the only caller is
`pagedkv.hf.layer_ops`, which checks dtypes, shapes and contiguity before it passes them. `bf16` selects
bfloat16 tensors (their bit patterns as uint16) over float32 ones. Arithmetic is float32; a bfloat16 result is
rounded to nearest even wherever torch rounds the same operation on bfloat16 tensors, so each function gives
what its torch sequence gives up to the order of a reduction (rms_norm's mean) and the last bit of an
exponential (silu).

rms_norm(x, delta, weight, out, rows, hidden, eps, bf16, threads)
    with delta != 0: x += delta (in place, rounded to x's dtype); then
    out = weight * dtype(x * rsqrt(mean(x^2) + eps)): LlamaRMSNorm's operations in its order.

rope_split(qkv, cos, sin, q, k, v, rows, heads, kv_heads, dim, bf16, threads)
    qkv [rows, (heads + 2 kv_heads) * dim], cos and sin [rows, dim]; writes q [rows, heads, dim] and
    k [rows, kv_heads, dim] rotated (x * cos + rotate_half(x) * sin) and v [rows, kv_heads, dim] copied.

silu_mul(gate_up, out, rows, inter, bf16, threads)
    gate_up [rows, 2 * inter] (gate then up); out [rows, inter] = silu(gate) * up.

Rows are split over `threads` OpenMP threads (torch's own team where torch's libgomp is the one loaded, as in
`pagedkv.ops._cpu_decode`); the GIL is released while they run. Row loops are plain C that the compiler
vectorises; on x86-64 each is built for AVX-512, AVX2 and baseline and picked at load time.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u; /* a NaN stays a NaN (a select, not a branch: loops vectorise) */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* exp(x) in float32 to about 2 ulp, branch-free so that loops over it vectorise. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (no libm call, so the loop vectorises) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* Sums of squares over 16 lanes (lane j takes the elements i = j mod 16), added pairwise at the end. */
#define LANES 16
static inline float lanes_total(float *acc) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float sum_squares_f32(const float *x, Py_ssize_t n) {
    float acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (; i < n; i++) acc[i % LANES] += x[i] * x[i];
    return lanes_total(acc);
}

static inline float sum_squares_bf16(const uint16_t *x, Py_ssize_t n) {
    float acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = bf16_to_f32(x[i + j]);
            acc[j] += v * v;
        }
    for (; i < n; i++) {
        const float v = bf16_to_f32(x[i]);
        acc[i % LANES] += v * v;
    }
    return lanes_total(acc);
}

/* --- rms_norm ------------------------------------------------------------------------------------------ */

CLONES static void norm_rows_f32(float *x, const float *delta, const float *w, float *out, Py_ssize_t lo,
                                 Py_ssize_t hi, Py_ssize_t n, float eps) {
    for (Py_ssize_t r = lo; r < hi; r++) {
        float *xr = x + r * n, *o = out + r * n;
        if (delta != NULL) {
            const float *d = delta + r * n;
            for (Py_ssize_t i = 0; i < n; i++) xr[i] += d[i];
        }
        const float ss = sum_squares_f32(xr, n);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (Py_ssize_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

CLONES static void norm_rows_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                                  Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t n, float eps) {
    for (Py_ssize_t r = lo; r < hi; r++) {
        uint16_t *xr = x + r * n, *o = out + r * n;
        if (delta != NULL) {
            const uint16_t *d = delta + r * n;
            for (Py_ssize_t i = 0; i < n; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(d[i]));
        }
        const float ss = sum_squares_bf16(xr, n);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (Py_ssize_t i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv)));
    }
}

/* --- rope_split ---------------------------------------------------------------------------------------- */

CLONES static void rope_rows_f32(const float *qkv, const float *cos, const float *sin, float *q, float *k,
                                 float *v, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t heads, Py_ssize_t kv_heads,
                                 Py_ssize_t dim) {
    const Py_ssize_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    for (Py_ssize_t r = lo; r < hi; r++) {
        const float *src = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        for (Py_ssize_t h = 0; h < heads + kv_heads; h++) {
            const float *x = src + h * dim;
            float *o = h < heads ? q + (r * heads + h) * dim : k + (r * kv_heads + h - heads) * dim;
            for (Py_ssize_t i = 0; i < half; i++) o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
            for (Py_ssize_t i = half; i < dim; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
        }
        memcpy(v + r * kv_heads * dim, src + (heads + kv_heads) * dim, sizeof(float) * (size_t)(kv_heads * dim));
    }
}

CLONES static void rope_rows_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *q,
                                  uint16_t *k, uint16_t *v, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t heads,
                                  Py_ssize_t kv_heads, Py_ssize_t dim) {
    const Py_ssize_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    for (Py_ssize_t r = lo; r < hi; r++) {
        const uint16_t *src = qkv + r * width, *c = cos + r * dim, *s = sin + r * dim;
        for (Py_ssize_t h = 0; h < heads + kv_heads; h++) {
            const uint16_t *x = src + h * dim;
            uint16_t *o = h < heads ? q + (r * heads + h) * dim : k + (r * kv_heads + h - heads) * dim;
            /* torch on bfloat16: (x * cos) and (rotate_half(x) * sin) each rounded, then their sum */
            for (Py_ssize_t i = 0; i < dim; i++) {
                const float rot = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
                const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
                const float b = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[i])));
                o[i] = f32_to_bf16(a + b);
            }
        }
        memcpy(v + r * kv_heads * dim, src + (heads + kv_heads) * dim, sizeof(uint16_t) * (size_t)(kv_heads * dim));
    }
}

/* --- silu_mul ------------------------------------------------------------------------------------------ */

CLONES static void silu_rows_f32(const float *gu, float *out, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t n) {
    for (Py_ssize_t r = lo; r < hi; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (Py_ssize_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

CLONES static void silu_rows_bf16(const uint16_t *gu, uint16_t *out, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t n) {
    for (Py_ssize_t r = lo; r < hi; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        for (Py_ssize_t i = 0; i < n; i++) {
            const float x = bf16_to_f32(g[i]);
            const float act = bf16_to_f32(f32_to_bf16(x / (1.0f + exp_approx(-x))));
            o[i] = f32_to_bf16(act * bf16_to_f32(u[i]));
        }
    }
}

/* --- the Python functions ------------------------------------------------------------------------------ */

static void *addr(PyObject *obj) { return PyLong_AsVoidPtr(obj); }

/* The team for `rows` rows: at most `threads`, at most one per row, 1 without OpenMP. */
static int team_size(long threads, Py_ssize_t rows) {
#ifdef _OPENMP
    if (threads < 1) threads = 1;
    return (int)(threads < rows ? threads : (rows > 0 ? rows : 1));
#else
    (void)threads;
    (void)rows;
    return 1;
#endif
}

#define SPLIT(rows, team, CALL)                                                                               \
    do {                                                                                                       \
        if ((team) > 1) {                                                                                      \
            _Pragma("omp parallel num_threads(team)") {                                                        \
                const Py_ssize_t t_ = omp_thread(), n_ = omp_threads();                                        \
                const Py_ssize_t lo = (rows) * t_ / n_, hi = (rows) * (t_ + 1) / n_;                           \
                CALL;                                                                                          \
            }                                                                                                  \
        } else {                                                                                               \
            const Py_ssize_t lo = 0, hi = (rows);                                                              \
            CALL;                                                                                              \
        }                                                                                                      \
    } while (0)

#ifdef _OPENMP
#include <omp.h>
static inline Py_ssize_t omp_thread(void) { return omp_get_thread_num(); }
static inline Py_ssize_t omp_threads(void) { return omp_get_num_threads(); }
#else
static inline Py_ssize_t omp_thread(void) { return 0; }
static inline Py_ssize_t omp_threads(void) { return 1; }
#endif

static int nargs_ok(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments, got %zd", name, want, nargs);
    return 0;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok("rms_norm", nargs, 9)) return NULL;
    void *x = addr(args[0]), *delta = args[1] == Py_None ? NULL : addr(args[1]), *w = addr(args[2]);
    void *out = addr(args[3]);
    const Py_ssize_t rows = PyLong_AsSsize_t(args[4]), n = PyLong_AsSsize_t(args[5]);
    const float eps = (float)PyFloat_AsDouble(args[6]);
    const int bf16 = PyObject_IsTrue(args[7]);
    const int team = team_size(PyLong_AsLong(args[8]), rows);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) SPLIT(rows, team, norm_rows_bf16(x, delta, w, out, lo, hi, n, eps));
    else SPLIT(rows, team, norm_rows_f32(x, delta, w, out, lo, hi, n, eps));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_rope_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok("rope_split", nargs, 12)) return NULL;
    void *qkv = addr(args[0]), *c = addr(args[1]), *s = addr(args[2]);
    void *q = addr(args[3]), *k = addr(args[4]), *v = addr(args[5]);
    const Py_ssize_t rows = PyLong_AsSsize_t(args[6]), heads = PyLong_AsSsize_t(args[7]);
    const Py_ssize_t kv_heads = PyLong_AsSsize_t(args[8]), dim = PyLong_AsSsize_t(args[9]);
    const int bf16 = PyObject_IsTrue(args[10]);
    const int team = team_size(PyLong_AsLong(args[11]), rows);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) SPLIT(rows, team, rope_rows_bf16(qkv, c, s, q, k, v, lo, hi, heads, kv_heads, dim));
    else SPLIT(rows, team, rope_rows_f32(qkv, c, s, q, k, v, lo, hi, heads, kv_heads, dim));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok("silu_mul", nargs, 6)) return NULL;
    void *gu = addr(args[0]), *out = addr(args[1]);
    const Py_ssize_t rows = PyLong_AsSsize_t(args[2]), n = PyLong_AsSsize_t(args[3]);
    const int bf16 = PyObject_IsTrue(args[4]);
    const int team = team_size(PyLong_AsLong(args[5]), rows);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS if (bf16) SPLIT(rows, team, silu_rows_bf16(gu, out, lo, hi, n));
    else SPLIT(rows, team, silu_rows_f32(gu, out, lo, hi, n));
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_openmp(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, delta, weight, out, rows, hidden, eps, bf16, threads): see the module docstring"},
    {"rope_split", (PyCFunction)(void (*)(void))py_rope_split, METH_FASTCALL,
     "rope_split(qkv, cos, sin, q, k, v, rows, heads, kv_heads, dim, bf16, threads): see the module docstring"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, out, rows, inter, bf16, threads): see the module docstring"},
    {"openmp", py_openmp, METH_NOARGS, "whether this build splits rows over OpenMP threads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_layer", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_layer(void) { return PyModule_Create(&module); }
