/*
 * pagedkv.core._native: the C backend of src/pagedkv/core/hotpath.py.
 *
 * The contract (what each function computes, its arguments, its errors and the state it leaves when it
 * fails) is written once, in hotpath.py: its module docstring and `PythonBackend`, the plain Python
 * specification this file is tested against (tests/core/test_native*.py run both on the same random
 * states and compare results, errors and every mutated structure). The comments below say only how the C
 * does it. The module also has its own SHA-256 (portable C, plus the x86 SHA instructions when the CPU
 * has them), exposed as `sha256` and `has_sha_ni` for the tests.
 *
 * C-specific strictness (hotpath.py lists it too): `index` must be a dict and `key_of`, `known` and each
 * row of `key_lists` lists of exactly those types (the C API would bypass a subclass's methods); integer
 * arrays C-contiguous int64 (or lists/tuples of ints); `match`'s `data` must hold every block it hashes.
 * Reference counts are exact on every path; the GIL is held throughout.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define PAGEDKV_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

enum { KIND_SHA256 = 0, KIND_FAST = 1 };

/* ------------------------------------------------------------------------------------------------------ */
/* SHA-256 (FIPS 180-4)                                                                                    */
/* ------------------------------------------------------------------------------------------------------ */

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t SHA_H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* Runs the compression function over `nblocks` consecutive 64-byte blocks. */
typedef void (*sha_compress_fn)(uint32_t state[8], const uint8_t *blocks, size_t nblocks);

static inline uint32_t load_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline uint32_t rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

/* Portable compression: expand the 64-word schedule, then 64 rounds on eight working variables. */
static void sha_compress_portable(uint32_t state[8], const uint8_t *p, size_t nblocks)
{
    for (; nblocks > 0; nblocks--, p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = load_be32(p + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = rotr32(w[t - 15], 7) ^ rotr32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr32(w[t - 2], 17) ^ rotr32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t s1 = rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25);
            uint32_t t1 = h + s1 + ((e & f) ^ (~e & g)) + SHA_K[t] + w[t];
            uint32_t s0 = rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22);
            uint32_t t2 = s0 + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#ifdef PAGEDKV_SHA_NI
/*
 * Compression with the x86 SHA extensions. SHA256RNDS2 does two rounds on the state held as two vectors,
 * {A,B,E,F} and {C,D,G,H} (first letter in the highest lane), taking W[t] + K[t] for its two rounds from
 * the low lanes of its third operand. Each group of four rounds therefore calls it twice, moving the
 * upper two message words down in between; SHA256MSG1/MSG2 (with an ALIGNR for the W[t-7] term) extend
 * the message schedule four words at a time, so that m0..m3 always hold the sixteen most recent words.
 */
#define SHA_NI_FOUR_ROUNDS(msg, group)                                                                     \
    do {                                                                                                   \
        __m128i wk_ = _mm_add_epi32((msg), _mm_loadu_si128((const __m128i *)&SHA_K[4 * (group)]));         \
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk_);                                                     \
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk_, 0x0E));                            \
    } while (0)

__attribute__((target("sha,sse4.1,ssse3"))) static void
sha_compress_shani(uint32_t state[8], const uint8_t *p, size_t nblocks)
{
    /* byte order within each 32-bit lane: the message words are big-endian */
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);

    /* {A,B,C,D}, {E,F,G,H} (A in the lowest lane) -> {A,B,E,F}, {C,D,G,H} (A in the highest) */
    __m128i badc = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[0]), 0xB1);
    __m128i hgfe = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[4]), 0x1B);
    __m128i abef = _mm_alignr_epi8(badc, hgfe, 8);
    __m128i cdgh = _mm_blend_epi16(hgfe, badc, 0xF0);

    for (; nblocks > 0; nblocks--, p += 64) {
        const __m128i abef_in = abef, cdgh_in = cdgh;
        __m128i m0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 0)), bswap);
        __m128i m1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16)), bswap);
        __m128i m2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 32)), bswap);
        __m128i m3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 48)), bswap);
        SHA_NI_FOUR_ROUNDS(m0, 0);
        SHA_NI_FOUR_ROUNDS(m1, 1);
        SHA_NI_FOUR_ROUNDS(m2, 2);
        SHA_NI_FOUR_ROUNDS(m3, 3);
        for (int group = 4; group < 16; group++) {
            /* W[t..t+3] = W[t-16] + s0(W[t-15]) + W[t-7] + s1(W[t-2]) */
            __m128i next = _mm_add_epi32(_mm_sha256msg1_epu32(m0, m1), _mm_alignr_epi8(m3, m2, 4));
            next = _mm_sha256msg2_epu32(next, m3);
            m0 = m1;
            m1 = m2;
            m2 = m3;
            m3 = next;
            SHA_NI_FOUR_ROUNDS(next, group);
        }
        abef = _mm_add_epi32(abef, abef_in);
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }

    /* back to {A,B,C,D}, {E,F,G,H} */
    __m128i abef_low = _mm_shuffle_epi32(abef, 0x1B);
    __m128i ghcd = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(abef_low, ghcd, 0xF0));
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(ghcd, abef_low, 8));
}

#undef SHA_NI_FOUR_ROUNDS

/* CPUID: SHA (leaf 7 subleaf 0, EBX bit 29), SSSE3 and SSE4.1 (leaf 1, ECX bits 9 and 19). */
static int cpu_has_sha_ni(void)
{
    unsigned int eax, ebx, ecx, edx;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid(1, eax, ebx, ecx, edx);
    if (!(ecx & (1u << 9)) || !(ecx & (1u << 19)))
        return 0;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    return (ebx & (1u << 29)) != 0;
}
#endif

/* The compression function the keys use: chosen once, at import. */
static sha_compress_fn sha_compress_best = sha_compress_portable;

/* Streaming state: the chaining value, a partial block and the message length. */
typedef struct {
    uint32_t state[8];
    uint64_t length;
    size_t fill;
    uint8_t block[64];
    sha_compress_fn compress;
} Sha256;

static void sha_init(Sha256 *s, sha_compress_fn compress)
{
    memcpy(s->state, SHA_H0, sizeof s->state);
    s->length = 0;
    s->fill = 0;
    s->compress = compress;
}

/* Top up the partial block first; whole blocks of the input are then compressed straight from it. */
static void sha_update(Sha256 *s, const uint8_t *p, size_t n)
{
    s->length += n;
    if (s->fill > 0) {
        size_t take = 64 - s->fill < n ? 64 - s->fill : n;
        if (take > 0)
            memcpy(s->block + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
        if (s->fill < 64)
            return;
        s->compress(s->state, s->block, 1);
        s->fill = 0;
    }
    if (n >= 64) {
        s->compress(s->state, p, n / 64);
        p += n - n % 64;
        n %= 64;
    }
    if (n > 0)
        memcpy(s->block, p, n);
    s->fill = n;
}

/* Padding: 0x80, zeros, then the bit length big-endian in the last 8 bytes of the last block. */
static void sha_final(Sha256 *s, uint8_t out[32])
{
    uint64_t bits = s->length * 8;
    s->block[s->fill++] = 0x80;
    if (s->fill > 56) {
        memset(s->block + s->fill, 0, 64 - s->fill);
        s->compress(s->state, s->block, 1);
        s->fill = 0;
    }
    memset(s->block + s->fill, 0, 56 - s->fill);
    store_be32(s->block + 56, (uint32_t)(bits >> 32));
    store_be32(s->block + 60, (uint32_t)bits);
    s->compress(s->state, s->block, 1);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, s->state[i]);
}

/* ------------------------------------------------------------------------------------------------------ */
/* Keys                                                                                                    */
/* ------------------------------------------------------------------------------------------------------ */

/* SHA256 kind: sha256(parent + chunk).digest(), streamed (no concatenated copy), into a new bytes. */
static PyObject *sha_key(PyObject *parent, const uint8_t *chunk, Py_ssize_t width)
{
    if (!PyBytes_Check(parent)) {
        PyErr_Format(PyExc_TypeError, "sha256 keys chain from bytes, not %.100s", Py_TYPE(parent)->tp_name);
        return NULL;
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, 32);
    if (key == NULL)
        return NULL;
    Sha256 s;
    sha_init(&s, sha_compress_best);
    sha_update(&s, (const uint8_t *)PyBytes_AS_STRING(parent), (size_t)PyBytes_GET_SIZE(parent));
    sha_update(&s, chunk, (size_t)width);
    sha_final(&s, (uint8_t *)PyBytes_AS_STRING(key));
    return key;
}

/* FAST kind: hash((parent, chunk, b"")), the very tuple the reference hashes, as a Python int. */
static PyObject *fast_key(PyObject *parent, const uint8_t *chunk, Py_ssize_t width)
{
    PyObject *tuple = PyTuple_New(3);
    if (tuple == NULL)
        return NULL;
    Py_INCREF(parent);
    PyTuple_SET_ITEM(tuple, 0, parent);
    PyObject *item = PyBytes_FromStringAndSize((const char *)chunk, width);
    if (item == NULL) {
        Py_DECREF(tuple);
        return NULL;
    }
    PyTuple_SET_ITEM(tuple, 1, item);
    item = PyBytes_FromStringAndSize(NULL, 0);
    if (item == NULL) {
        Py_DECREF(tuple);
        return NULL;
    }
    PyTuple_SET_ITEM(tuple, 2, item);
    Py_hash_t hash = PyObject_Hash(tuple);
    Py_DECREF(tuple);
    if (hash == -1)
        return NULL;
    return PyLong_FromSsize_t(hash);
}

/* hotpath._chain: the key of the block with bytes `chunk` whose parent key is `parent` (new reference). */
static PyObject *chain(int kind, PyObject *parent, const uint8_t *chunk, Py_ssize_t width)
{
    return kind == KIND_SHA256 ? sha_key(parent, chunk, width) : fast_key(parent, chunk, width);
}

/* group_keys.group_key: the index key of content key `key` in KV cache group `group` (bytes: the key with
   the group appended as one byte; int: key * 256 + group); `key` itself when group < 0 (new reference). */
static PyObject *qualify(PyObject *key, int group)
{
    if (group < 0) {
        Py_INCREF(key);
        return key;
    }
    if (PyBytes_Check(key)) {
        Py_ssize_t n = PyBytes_GET_SIZE(key);
        PyObject *out = PyBytes_FromStringAndSize(NULL, n + 1);
        if (out == NULL)
            return NULL;
        memcpy(PyBytes_AS_STRING(out), PyBytes_AS_STRING(key), (size_t)n);
        PyBytes_AS_STRING(out)[n] = (char)group;
        return out;
    }
    PyObject *radix = PyLong_FromLong(256), *g = PyLong_FromLong(group), *out = NULL;
    if (radix != NULL && g != NULL) {
        PyObject *scaled = PyNumber_Multiply(key, radix);
        if (scaled != NULL) {
            out = PyNumber_Add(scaled, g);
            Py_DECREF(scaled);
        }
    }
    Py_XDECREF(radix);
    Py_XDECREF(g);
    return out;
}

/* A `group` argument: None (or absent) is -1 (plain keys), else an int in [0, 256). */
static int get_group(const char *fname, PyObject *obj, int *group)
{
    *group = -1;
    if (obj == NULL || obj == Py_None)
        return 0;
    long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value > 255) {
        PyErr_Format(PyExc_ValueError, "%s: group must be None or in [0, 256), not %ld", fname, value);
        return -1;
    }
    *group = (int)value;
    return 0;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Arguments                                                                                               */
/* ------------------------------------------------------------------------------------------------------ */

/*
 * Vectorcall arguments (METH_FASTCALL | METH_KEYWORDS) into `out[0..n)` (borrowed), by position (the
 * first `npos` names) or keyword; the first `nrequired` are required, the others stay NULL when absent.
 */
static int parse_args(const char *fname, const char *const *names, Py_ssize_t n, Py_ssize_t npos,
                      Py_ssize_t nrequired, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      PyObject **out)
{
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments but %zd were given", fname, npos,
                     nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, name);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < nrequired; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}

static int get_kind(const char *fname, PyObject *obj, int *kind)
{
    long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value != KIND_SHA256 && value != KIND_FAST) {
        PyErr_Format(PyExc_ValueError, "%s: kind must be SHA256 (0) or FAST (1), not %ld", fname, value);
        return -1;
    }
    *kind = (int)value;
    return 0;
}

static int get_ssize(PyObject *obj, Py_ssize_t *value)
{
    *value = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

static int check_exact(const char *fname, const char *what, PyObject *obj, PyTypeObject *type)
{
    if (Py_IS_TYPE(obj, type))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must be a %s, not %.100s", fname, what, type->tp_name,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

/* Argument `what` as raw bytes (any C-contiguous buffer); release with PyBuffer_Release. */
static int get_data(const char *fname, const char *what, PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) == 0)
        return 0;
    view->obj = NULL;
    PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous bytes-like object, not %.100s", fname, what,
                 Py_TYPE(obj)->tp_name);
    return -1;
}

/* Whether bytes [block * width, (block + 1) * width) lie within `size` bytes (without overflowing). */
static int holds_block(Py_ssize_t block, Py_ssize_t width, Py_ssize_t size)
{
    return width == 0 || (width <= size && block <= (size - width) / width);
}

/* Extend `known` (root first) to stop + 1 keys, chaining over the `width`-byte blocks of `bytes` (block j
   at bytes + j * width, within `nbytes`). Returns 0, or -1 with an exception set (keys so far kept). */
static int extend_known(const char *fname, int kind, PyObject *known, const uint8_t *bytes, Py_ssize_t nbytes,
                        Py_ssize_t width, Py_ssize_t stop)
{
    Py_ssize_t have = PyList_GET_SIZE(known);
    if (have == 0) {
        PyErr_Format(PyExc_ValueError, "%s: known must start with the root key", fname);
        return -1;
    }
    for (Py_ssize_t j = have - 1; j < stop; j++) {
        if (!holds_block(j, width, nbytes)) {
            PyErr_Format(PyExc_ValueError, "%s: data (%zd bytes) ends before block %zd", fname, nbytes, j);
            return -1;
        }
        PyObject *parent = PyList_GET_ITEM(known, PyList_GET_SIZE(known) - 1);
        Py_INCREF(parent);
        PyObject *key = chain(kind, parent, bytes + j * width, width);
        Py_DECREF(parent);
        if (key == NULL)
            return -1;
        int appended = PyList_Append(known, key);
        Py_DECREF(key);
        if (appended < 0)
            return -1;
    }
    return 0;
}

/*
 * A 1-D sequence of int64: a C-contiguous buffer of format 'q' or 'l' with 8-byte items (a numpy int64
 * array), read in place; or a list/tuple of ints, copied. Release with i64s_release.
 */
typedef struct {
    const int64_t *values;
    Py_ssize_t len;
    Py_buffer view; /* view.obj != NULL while a buffer is held */
    int64_t *copy;  /* the list/tuple case */
} I64s;

/* Whether a buffer format is a native-order signed integer of `itemsize` bytes (8: 'q' or 'l'; 4: 'i';
   the caller also checks the item size, which settles what 'l' is on this platform). */
static int int_format_ok(const char *format, Py_ssize_t itemsize)
{
    if (format == NULL)
        return 0;
#if PY_BIG_ENDIAN
    if (*format == '@' || *format == '=' || *format == '>' || *format == '!')
#else
    if (*format == '@' || *format == '=' || *format == '<')
#endif
        format++;
    if (format[0] == '\0' || format[1] != '\0')
        return 0;
    return itemsize == 8 ? (format[0] == 'q' || format[0] == 'l') : (format[0] == 'i' || format[0] == 'l');
}

static void i64s_release(I64s *a)
{
    if (a->view.obj != NULL)
        PyBuffer_Release(&a->view);
    PyMem_Free(a->copy);
    a->copy = NULL;
}

static int i64s_get(const char *fname, const char *what, PyObject *obj, I64s *a)
{
    memset(a, 0, sizeof *a);
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        a->copy = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
        if (a->copy == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            /* re-read the item each time: __index__ of a previous item may have changed the list */
            if (i >= PySequence_Fast_GET_SIZE(obj)) {
                PyErr_Format(PyExc_RuntimeError, "%s: %s changed size while being read", fname, what);
                goto fail;
            }
            PyObject *item = PySequence_Fast_GET_ITEM(obj, i);
            Py_INCREF(item);
            long long value = PyLong_AsLongLong(item);
            Py_DECREF(item);
            if (value == -1 && PyErr_Occurred())
                goto fail;
            a->copy[i] = (int64_t)value;
        }
        a->values = a->copy;
        a->len = n;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        a->view.obj = NULL;
        goto wrong_type;
    }
    if (a->view.ndim != 1 || a->view.itemsize != 8 || !int_format_ok(a->view.format, 8))
        goto wrong_type;
    a->values = (const int64_t *)a->view.buf;
    a->len = a->view.shape[0];
    return 0;

wrong_type:
    PyErr_Format(PyExc_TypeError,
                 "%s: %s must be a C-contiguous 1-D int64 array or a list of ints, not %.100s", fname, what,
                 Py_TYPE(obj)->tp_name);
fail:
    i64s_release(a);
    return -1;
}

/* ------------------------------------------------------------------------------------------------------ */
/* The loops                                                                                               */
/* ------------------------------------------------------------------------------------------------------ */

/*
 * match(kind, index, known, data, width, max_blocks, group=None) -> list[int]  (PythonBackend.match)
 *
 * For i in range(max_blocks): block i's key is known[i + 1] if present, else chained from known[-1] and
 * the block's bytes data[i*width : (i+1)*width] and appended to `known`; stop at the first key not in
 * the index, else collect its block id (every entry is live: the prefix index keeps none stale). With a
 * group, the index is asked for the group-qualified key (`qualify`).
 */
static PyObject *native_match(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    static const char *const names[] = {"kind", "index", "known", "data", "width", "max_blocks", "group"};
    PyObject *a[7];
    int kind, group;
    Py_ssize_t width, max_blocks;
    if (parse_args("match", names, 7, 7, 6, args, nargs, kwnames, a) < 0 ||
        get_kind("match", a[0], &kind) < 0 || check_exact("match", "index", a[1], &PyDict_Type) < 0 ||
        check_exact("match", "known", a[2], &PyList_Type) < 0 || get_ssize(a[4], &width) < 0 ||
        get_ssize(a[5], &max_blocks) < 0 || get_group("match", a[6], &group) < 0)
        return NULL;
    if (width < 0)
        return PyErr_Format(PyExc_ValueError, "match: width must be >= 0, not %zd", width);
    PyObject *index = a[1], *known = a[2];
    Py_buffer data;
    if (get_data("match", "data", a[3], &data) < 0)
        return NULL;
    const uint8_t *bytes = (const uint8_t *)data.buf;

    PyObject *hits = PyList_New(0);
    if (hits == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < max_blocks; i++) {
        PyObject *key;
        Py_ssize_t have = PyList_GET_SIZE(known);
        if (i + 1 < have) {
            key = PyList_GET_ITEM(known, i + 1);
            Py_INCREF(key);
        } else {
            if (have == 0) {
                PyErr_SetString(PyExc_ValueError, "match: known must start with the root key");
                goto fail;
            }
            if (!holds_block(i, width, data.len)) {
                PyErr_Format(PyExc_ValueError, "match: data (%zd bytes) ends before block %zd", data.len, i);
                goto fail;
            }
            PyObject *parent = PyList_GET_ITEM(known, have - 1);
            Py_INCREF(parent);
            key = chain(kind, parent, bytes + i * width, width);
            Py_DECREF(parent);
            if (key == NULL)
                goto fail;
            if (PyList_Append(known, key) < 0) {
                Py_DECREF(key);
                goto fail;
            }
        }
        if (group >= 0) { /* the group's copy of the block */
            PyObject *plain = key;
            key = qualify(plain, group);
            Py_DECREF(plain);
            if (key == NULL)
                goto fail;
        }
        PyObject *block = PyDict_GetItemWithError(index, key); /* borrowed */
        Py_XINCREF(block);
        Py_DECREF(key);
        if (block == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        int appended = PyList_Append(hits, block);
        Py_DECREF(block);
        if (appended < 0)
            goto fail;
    }
    PyBuffer_Release(&data);
    return hits;

fail:
    Py_XDECREF(hits);
    PyBuffer_Release(&data);
    return NULL;
}

/*
 * One row of `publish_rows` (and of `publish_computed`): extend the row's keys `known` to `stop` by
 * chaining over its blocks' bytes, then index blocks [start, stop). Block j's id is `ids[j - start]`
 * (already checked to lie in [0, len(key_of))); its bytes are at
 * `bytes + id * width` within `nbytes`. Stored ids are appended to `stored`; `keyed` may be NULL. With
 * group >= 0 the index and key_of take the group-qualified key (`qualify`).
 * Returns 0, or -1 with an exception set (the blocks before stay published, as in the reference).
 */
static int publish_row(int kind, PyObject *index, PyObject *key_of, uint8_t *keyed, PyObject *known,
                       Py_ssize_t start, Py_ssize_t stop, const int64_t *ids, const uint8_t *bytes,
                       Py_ssize_t nbytes, Py_ssize_t width, PyObject *stored, int group)
{
    Py_ssize_t have = PyList_GET_SIZE(known) - 1;
    if (have < start) {
        PyErr_SetString(PyExc_ValueError,
                        "publish_rows: a row's keys end before its first block to publish");
        return -1;
    }

    /* the row's missing keys, chained from its last known one over its blocks' bytes */
    PyObject *parent = PyList_GET_ITEM(known, have);
    Py_INCREF(parent);
    for (Py_ssize_t j = have; j < stop; j++) {
        Py_ssize_t block = (Py_ssize_t)ids[j - start]; /* 0 <= block < nkeys: checked above */
        if (!holds_block(block, width, nbytes)) {
            PyErr_Format(PyExc_ValueError, "publish_rows: blocks (%zd bytes) ends before block id %zd",
                         nbytes, block);
            Py_DECREF(parent);
            return -1;
        }
        PyObject *key = chain(kind, parent, bytes + block * width, width);
        Py_DECREF(parent);
        if (key == NULL)
            return -1;
        parent = key;
        if (PyList_Append(known, key) < 0) {
            Py_DECREF(parent);
            return -1;
        }
    }
    Py_DECREF(parent);

    /* index the blocks not keyed yet whose key no other block holds */
    for (Py_ssize_t j = start; j < stop; j++) {
        if (j + 1 >= PyList_GET_SIZE(known)) {
            PyErr_SetString(PyExc_IndexError, "publish_rows: a row's keys changed while publishing it");
            return -1;
        }
        Py_ssize_t at = (Py_ssize_t)ids[j - start];
        if (at >= PyList_GET_SIZE(key_of)) { /* a key's __eq__ shrank key_of */
            PyErr_Format(PyExc_IndexError,
                         "publish_rows: block id %zd out of range of key_of (%zd blocks)", at,
                         PyList_GET_SIZE(key_of));
            return -1;
        }
        if (PyList_GET_ITEM(key_of, at) != Py_None)
            continue;
        PyObject *key = qualify(PyList_GET_ITEM(known, j + 1), group);
        if (key == NULL)
            return -1;
        PyObject *block = PyLong_FromSsize_t(at);
        if (block == NULL) {
            Py_DECREF(key);
            return -1;
        }
        Py_ssize_t size = PyDict_GET_SIZE(index);
        PyObject *other = PyDict_SetDefault(index, key, block); /* borrowed */
        if (other == NULL) {
            Py_DECREF(key);
            Py_DECREF(block);
            return -1;
        }
        /* `block` itself comes back when the key was absent (and is now inserted), but also when the
           entry already held that very int object (small ints are shared): the size tells them apart */
        if (other != block || PyDict_GET_SIZE(index) != size + 1) { /* another block holds the key: */
            Py_DECREF(key);                                          /* this one stays private */
            Py_DECREF(block);
            continue;
        }
        if (PyList_SetItem(key_of, at, key) < 0) { /* steals `key`, even when it fails */
            Py_DECREF(block);
            return -1;
        }
        if (keyed != NULL)
            keyed[at] = 1;
        int appended = PyList_Append(stored, block);
        Py_DECREF(block);
        if (appended < 0)
            return -1;
    }
    return 0;
}

/*
 * publish_rows(kind, prefix, key_lists, starts, stops, blocks, width, ids) -> list[int]
 * (PythonBackend.publish_rows; `prefix` is the tuple (index, key_of, keyed), hotpath's `IndexArrays`,
 * keyed None or a 1-byte-per-block buffer)
 *
 * Validation first (types; one start/stop per row with 0 <= start <= stop; at least as many ids as
 * blocks; every id to publish in [0, len(key_of)), else IndexError; `keyed`, if not None, a writable
 * C-contiguous 1-D buffer of 1-byte items at least len(key_of) long), then row by row, `pos` counting
 * the blocks of the rows before: extend the row's keys `known` from len(known) - 1 to `stop` by chaining
 * over the row's block bytes (block j's id b = ids[pos + j - start], its bytes
 * blocks[b*width : (b+1)*width] of the whole block store), then for each block j in [start, stop) with
 * key = known[j + 1]: if key_of[b] is None and the key is not in the index, index[key] = b,
 * key_of[b] = key, keyed[b] = 1, and b joins the returned list.
 *
 * The index is probed once per block, by PyDict_SetDefault(index, key, b): an absent key is inserted
 * right there (where the reference's `index[key] = b` inserts it, at the end of the dict); a present one
 * is left alone (another block holds the key; this one stays private). Only the number of times
 * Python-level __hash__/__eq__ of exotic keys run differs from the reference (one probe instead of two).
 */
static PyObject *native_publish_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"kind", "prefix", "key_lists", "starts", "stops", "blocks", "width", "ids"};
    const char *const fname = "publish_rows";
    PyObject *given[8], *a[10];
    int kind;
    Py_ssize_t width;
    if (parse_args(fname, names, 8, 8, 8, args, nargs, kwnames, given) < 0)
        return NULL;
    /* the owner's struct: prefix = (index, key_of, keyed), spread into the order the code below reads */
    if (!PyTuple_Check(given[1]) || PyTuple_GET_SIZE(given[1]) != 3)
        return PyErr_Format(PyExc_TypeError, "%s: prefix must be a tuple (index, key_of, keyed)", fname);
    a[0] = given[0];
    a[1] = PyTuple_GET_ITEM(given[1], 0), a[2] = PyTuple_GET_ITEM(given[1], 1), a[9] = PyTuple_GET_ITEM(given[1], 2);
    for (int i = 2; i < 8; i++)
        a[i + 1] = given[i];
    if (get_kind(fname, a[0], &kind) < 0 || check_exact(fname, "index", a[1], &PyDict_Type) < 0 ||
        check_exact(fname, "key_of", a[2], &PyList_Type) < 0 || get_ssize(a[7], &width) < 0)
        return NULL;
    if (width < 0)
        return PyErr_Format(PyExc_ValueError, "publish_rows: width must be >= 0, not %zd", width);
    PyObject *index = a[1], *key_of = a[2];

    /* a tuple of the rows, so that the loop keeps them even if Python code run by a key's hash or
       comparison changes `key_lists` */
    PyObject *rows = PySequence_Tuple(a[3]);
    if (rows == NULL)
        return NULL;
    PyObject *stored = NULL;
    I64s starts = {0}, stops = {0}, ids = {0};
    Py_buffer blocks = {0}, flags = {0};
    uint8_t *keyed = NULL;
    if (i64s_get(fname, "starts", a[4], &starts) < 0 || i64s_get(fname, "stops", a[5], &stops) < 0 ||
        i64s_get(fname, "ids", a[8], &ids) < 0 || get_data(fname, "blocks", a[6], &blocks) < 0)
        goto fail;

    Py_ssize_t nrows = PyTuple_GET_SIZE(rows);
    if (starts.len != nrows || stops.len != nrows) {
        PyErr_Format(PyExc_ValueError, "publish_rows: %zd rows of keys but %zd starts and %zd stops", nrows,
                     starts.len, stops.len);
        goto fail;
    }
    Py_ssize_t total = 0; /* blocks to publish, all rows */
    for (Py_ssize_t r = 0; r < nrows; r++) {
        int64_t start = starts.values[r], stop = stops.values[r];
        if (check_exact(fname, "each row of key_lists", PyTuple_GET_ITEM(rows, r), &PyList_Type) < 0)
            goto fail;
        if (start < 0 || stop < start || stop >= PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "publish_rows: row %zd has blocks [%lld, %lld)", r,
                         (long long)start, (long long)stop);
            goto fail;
        }
        if (stop - start > ids.len - total) {
            PyErr_Format(PyExc_ValueError,
                         "publish_rows: ids holds %zd block ids, fewer than the rows' blocks", ids.len);
            goto fail;
        }
        total += (Py_ssize_t)(stop - start);
    }
    Py_ssize_t nkeys = PyList_GET_SIZE(key_of);
    for (Py_ssize_t p = 0; p < total; p++) {
        if (ids.values[p] < 0 || ids.values[p] >= (int64_t)nkeys) {
            PyErr_Format(PyExc_IndexError, "publish_rows: block id %lld out of range of key_of (%zd blocks)",
                         (long long)ids.values[p], nkeys);
            goto fail;
        }
    }
    if (a[9] != NULL && a[9] != Py_None) {
        if (PyObject_GetBuffer(a[9], &flags, PyBUF_RECORDS_RO) < 0) {
            flags.obj = NULL;
            goto fail;
        }
        if (flags.readonly || flags.ndim != 1 || flags.itemsize != 1 || !PyBuffer_IsContiguous(&flags, 'C')) {
            PyErr_Format(PyExc_TypeError,
                         "publish_rows: keyed must be a writable C-contiguous 1-D array of 1-byte items, "
                         "not %.100s",
                         Py_TYPE(a[9])->tp_name);
            goto fail;
        }
        if (flags.len < nkeys) {
            PyErr_Format(PyExc_ValueError, "publish_rows: keyed (%zd items) is shorter than key_of (%zd)",
                         flags.len, nkeys);
            goto fail;
        }
        keyed = (uint8_t *)flags.buf;
    }

    stored = PyList_New(0);
    if (stored == NULL)
        goto fail;
    Py_ssize_t pos = 0;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        Py_ssize_t start = (Py_ssize_t)starts.values[r], stop = (Py_ssize_t)stops.values[r];
        if (publish_row(kind, index, key_of, keyed, PyTuple_GET_ITEM(rows, r), start, stop,
                        ids.values + pos, (const uint8_t *)blocks.buf, blocks.len, width, stored, -1) < 0)
            goto fail;
        pos += stop - start;
    }
    Py_DECREF(rows);
    i64s_release(&starts);
    i64s_release(&stops);
    i64s_release(&ids);
    PyBuffer_Release(&blocks);
    if (flags.obj != NULL)
        PyBuffer_Release(&flags);
    return stored;

fail:
    Py_DECREF(rows);
    Py_XDECREF(stored);
    i64s_release(&starts);
    i64s_release(&stops);
    i64s_release(&ids);
    if (blocks.obj != NULL)
        PyBuffer_Release(&blocks);
    if (flags.obj != NULL)
        PyBuffer_Release(&flags);
    return NULL;
}

/*
 * forget_keys(prefix, ids, dropped=None) -> None  (PythonBackend.forget_keys; `prefix` is (index, key_of,
 * keyed), keyed unused)
 *
 * Eviction drops keys eagerly, so the index never holds a stale entry: for each block b of `ids` holding
 * a key, delete index[key] if it maps to b, then key_of[b] = None, and, with a bitmap `dropped` (a
 * writable C-contiguous 1-D buffer of 1-byte items whose length is a power of two), set bit s % 8 of
 * dropped[s / 8], s = evicted_slot(key) & (8 * len - 1) (hotpath.evicted_slot: a bytes key's first 8 bytes
 * little-endian xor its last 8 big-endian, else hash(key)): the prefix index's memory of evicted keys, kept here for
 * its cost (a dict of the keys cost 18% of the allocator loop at 16,384 blocks; bits, not bytes, keep the
 * bitmap in cache: 128 KiB at 16,384 blocks). Every id is checked (0 <= b < len(key_of)) before anything changes.
 */
static PyObject *native_forget_keys(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"prefix", "ids", "dropped"};
    const char *const fname = "forget_keys";
    PyObject *given[3], *a[3];
    if (parse_args(fname, names, 3, 3, 2, args, nargs, kwnames, given) < 0)
        return NULL;
    Py_buffer bits = {0};
    if (given[2] != NULL && given[2] != Py_None) {
        if (PyObject_GetBuffer(given[2], &bits, PyBUF_RECORDS_RO) < 0) {
            bits.obj = NULL;
            PyErr_Clear(); /* refused below, with the message that says what it must be */
        }
        if (bits.obj == NULL || bits.readonly || bits.ndim != 1 || bits.itemsize != 1 ||
            !PyBuffer_IsContiguous(&bits, 'C') || bits.len == 0 || (bits.len & (bits.len - 1)) != 0) {
            if (bits.obj != NULL)
                PyBuffer_Release(&bits);
            return PyErr_Format(PyExc_TypeError,
                                "%s: dropped must be a writable C-contiguous 1-D array of 1-byte items, its "
                                "length a power of two",
                                fname);
        }
    }
    uint8_t *dropped = bits.obj != NULL ? (uint8_t *)bits.buf : NULL;
    Py_uhash_t mask = (Py_uhash_t)bits.len * 8 - 1; /* one bit per slot */
    /* the owner's struct: prefix = (index, key_of, keyed); keyed is the owner's to clear (one numpy call) */
    if (!PyTuple_Check(given[0]) || PyTuple_GET_SIZE(given[0]) != 3)
        return PyErr_Format(PyExc_TypeError, "%s: prefix must be a tuple (index, key_of, keyed)", fname);
    a[0] = PyTuple_GET_ITEM(given[0], 0), a[1] = PyTuple_GET_ITEM(given[0], 1), a[2] = given[1];
    if (check_exact(fname, "index", a[0], &PyDict_Type) < 0 ||
        check_exact(fname, "key_of", a[1], &PyList_Type) < 0)
        return NULL;
    PyObject *index = a[0], *key_of = a[1];
    I64s ids;
    if (i64s_get(fname, "ids", a[2], &ids) < 0) {
        if (bits.obj != NULL)
            PyBuffer_Release(&bits);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(key_of);
    for (Py_ssize_t i = 0; i < ids.len; i++) {
        if (ids.values[i] < 0 || ids.values[i] >= (int64_t)n) {
            PyErr_Format(PyExc_IndexError, "forget_keys: block id %lld out of range of key_of (%zd blocks)",
                         (long long)ids.values[i], n);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < ids.len; i++) {
        Py_ssize_t b = (Py_ssize_t)ids.values[i];
        if (b >= PyList_GET_SIZE(key_of)) { /* a key's __eq__ shrank the list: stop cleanly */
            PyErr_SetString(PyExc_RuntimeError, "forget_keys: key_of changed size");
            goto fail;
        }
        PyObject *key = PyList_GET_ITEM(key_of, b);
        if (key == Py_None)
            continue;
        Py_INCREF(key);
        PyObject *value = PyDict_GetItemWithError(index, key);
        if (value == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            goto fail;
        }
        if (value != NULL && PyLong_CheckExact(value)) {
            int overflow;
            long long held = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (!overflow && held == (long long)b && PyDict_DelItem(index, key) < 0) {
                Py_DECREF(key);
                goto fail;
            }
        }
        if (dropped != NULL) {
            Py_uhash_t slot;
            if (PyBytes_CheckExact(key)) { /* hotpath.evicted_slot: head little-endian ^ tail big-endian */
                const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(key);
                Py_ssize_t n = PyBytes_GET_SIZE(key), head = n < 8 ? n : 8, from = n > 8 ? n - 8 : 0;
                uint64_t lo = 0, hi = 0;
#if PY_LITTLE_ENDIAN && defined(__GNUC__)
                if (n >= 8) { /* digests: two unaligned loads */
                    memcpy(&lo, p, 8);
                    memcpy(&hi, p + n - 8, 8);
                    hi = __builtin_bswap64(hi);
                } else
#endif
                {
                    for (Py_ssize_t j = head - 1; j >= 0; j--)
                        lo = (lo << 8) | p[j];
                    for (Py_ssize_t j = from; j < n; j++)
                        hi = (hi << 8) | p[j];
                }
                slot = (Py_uhash_t)(lo ^ hi) & mask;
            } else {
                Py_hash_t h = PyObject_Hash(key);
                if (h == -1 && PyErr_Occurred()) {
                    Py_DECREF(key);
                    goto fail;
                }
                slot = (Py_uhash_t)h & mask;
            }
            dropped[slot >> 3] |= (uint8_t)(1u << (slot & 7));
        }
        Py_DECREF(key);
        Py_INCREF(Py_None);
        PyList_SetItem(key_of, b, Py_None); /* steals the None, releases the key */
    }
    i64s_release(&ids);
    if (bits.obj != NULL)
        PyBuffer_Release(&bits);
    Py_RETURN_NONE;

fail:
    i64s_release(&ids);
    if (bits.obj != NULL)
        PyBuffer_Release(&bits);
    return NULL;
}

/*
 * check_rows(on_device, mark, rows) -> int  (PythonBackend.check_rows)
 *
 * Validates a batch of sequence handles in one pass: 1 if a row is out of [0, len(on_device)) or not on
 * the device, else 2 if a row appears twice, else 0. `on_device` is a 1-byte-per-row buffer (numpy bool),
 * `mark` a writable int64 scratch array at least as long (any contents): each row's batch position is
 * written into it and read back, so a repeated row reads a later position.
 */
static PyObject *native_check_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    static const char *const names[] = {"on_device", "mark", "rows"};
    const char *const fname = "check_rows";
    PyObject *a[3];
    if (parse_args(fname, names, 3, 3, 3, args, nargs, kwnames, a) < 0)
        return NULL;
    Py_buffer on = {0}, mark = {0};
    I64s rows = {0};
    long status = 0;
    if (PyObject_GetBuffer(a[0], &on, PyBUF_C_CONTIGUOUS) < 0) {
        on.obj = NULL;
        goto fail;
    }
    if (PyObject_GetBuffer(a[1], &mark, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        mark.obj = NULL;
        goto fail;
    }
    if (on.itemsize != 1 || mark.itemsize != 8 || !int_format_ok(mark.format, 8) || mark.len / 8 < on.len) {
        PyErr_SetString(PyExc_TypeError,
                        "check_rows: on_device must be a 1-byte array and mark an int64 array at least as long");
        goto fail;
    }
    if (i64s_get(fname, "rows", a[2], &rows) < 0)
        goto fail;
    const uint8_t *live = (const uint8_t *)on.buf;
    int64_t *stamp = (int64_t *)mark.buf;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        if (r < 0 || r >= (int64_t)on.len || !live[r]) {
            status = 1;
            break;
        }
    }
    if (status == 0) { /* each row's position, read back: a repeated row reads a later one */
        for (Py_ssize_t i = 0; i < rows.len; i++)
            stamp[rows.values[i]] = (int64_t)i;
        for (Py_ssize_t i = 0; i < rows.len && status == 0; i++)
            if (stamp[rows.values[i]] != (int64_t)i)
                status = 2;
    }
    PyBuffer_Release(&on);
    PyBuffer_Release(&mark);
    i64s_release(&rows);
    return PyLong_FromLong(status);

fail:
    if (on.obj != NULL)
        PyBuffer_Release(&on);
    if (mark.obj != NULL)
        PyBuffer_Release(&mark);
    i64s_release(&rows);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Growing a batch of block tables (the decode step's append)                                              */
/* ------------------------------------------------------------------------------------------------------ */

/*
 * A C-contiguous numpy array as a buffer of `itemsize`-byte integers ('q'/'l' for 8, 'i' for 4), with
 * `ndim` dimensions; writable if asked. Release with PyBuffer_Release when view->obj != NULL.
 */
static int int_array(const char *fname, const char *what, PyObject *obj, int ndim, Py_ssize_t itemsize,
                     int writable, Py_buffer *view)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        view->obj = NULL;
        PyErr_Clear();
        goto wrong;
    }
    if (view->ndim == ndim && view->itemsize == itemsize && int_format_ok(view->format, itemsize))
        return 0;
    PyBuffer_Release(view);
    view->obj = NULL;
wrong:
    PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous %d-D int%d%s numpy array", fname, what, ndim,
                 (int)(itemsize * 8), writable ? " (writable)" : "");
    return -1;
}

static void release_all(Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

/* Blocks a row needs to hold `tokens` tokens when it holds `blocks`: max(ceil(tokens / bs) - blocks, 0). */
static inline int64_t blocks_needed(int64_t tokens, int64_t blocks, int64_t bs)
{
    int64_t need = (tokens + bs - 1) / bs - blocks;
    return need > 0 ? need : 0;
}

/*
 * growth(rows, num_tokens, num_blocks, k, block_size) -> (total_new, max_cols)  (PythonBackend.growth)
 *
 * For k more tokens in each row: the blocks all rows need together, and the widest table row afterwards
 * (max of num_blocks[r] + need[r]; 0 for no rows). Reads only.
 */
static PyObject *native_growth(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"rows", "num_tokens", "num_blocks", "k", "block_size"};
    const char *const fname = "growth";
    PyObject *a[5];
    Py_ssize_t k, bs;
    if (parse_args(fname, names, 5, 5, 5, args, nargs, kwnames, a) < 0 || get_ssize(a[3], &k) < 0 ||
        get_ssize(a[4], &bs) < 0)
        return NULL;
    if (k < 0 || bs <= 0)
        return PyErr_Format(PyExc_ValueError, "growth: needs k >= 0 and block_size > 0");
    I64s rows;
    Py_buffer v[2] = {{0}, {0}};
    if (i64s_get(fname, "rows", a[0], &rows) < 0)
        return NULL;
    if (int_array(fname, "num_tokens", a[1], 1, 8, 0, &v[0]) < 0 ||
        int_array(fname, "num_blocks", a[2], 1, 8, 0, &v[1]) < 0)
        goto fail;
    const int64_t *tokens = v[0].buf, *blocks = v[1].buf;
    Py_ssize_t n = v[0].shape[0] < v[1].shape[0] ? v[0].shape[0] : v[1].shape[0];
    int64_t total = 0, widest = 0;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        if (r < 0 || r >= (int64_t)n) {
            PyErr_Format(PyExc_IndexError, "growth: row %lld out of range", (long long)r);
            goto fail;
        }
        int64_t need = blocks_needed(tokens[r] + k, blocks[r], bs);
        total += need;
        if (blocks[r] + need > widest)
            widest = blocks[r] + need;
    }
    release_all(v, 2);
    i64s_release(&rows);
    return Py_BuildValue("(LL)", (long long)total, (long long)widest);

fail:
    release_all(v, 2);
    i64s_release(&rows);
    return NULL;
}

/*
 * grow(rows, num_tokens, num_blocks, table, k, block_size, ids, tokens, block_tokens) -> None
 * (PythonBackend.grow)
 *
 * Row i of the batch (r = rows[i]) takes the next need[r] ids (in batch order) as new table columns
 * num_blocks[r].., then its k new tokens tokens[i, :] are written into the token mirror at their slots
 * (block table[r, pos // bs], offset pos % bs, for pos in [num_tokens[r], num_tokens[r] + k)), and
 * num_tokens[r] += k. `tokens` and `block_tokens` are both None (no token ids) or both arrays.
 * Everything is checked before anything changes: rows in range, the table wide enough, exactly as many
 * ids as blocks needed, every id and every block the tokens land in within the token mirror.
 */
static PyObject *native_grow(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"rows", "num_tokens", "num_blocks", "table", "k", "block_size",
                                        "ids",  "tokens",     "block_tokens"};
    const char *const fname = "grow";
    PyObject *a[9];
    Py_ssize_t k, bs;
    if (parse_args(fname, names, 9, 9, 9, args, nargs, kwnames, a) < 0 || get_ssize(a[4], &k) < 0 ||
        get_ssize(a[5], &bs) < 0)
        return NULL;
    if (k < 0 || bs <= 0)
        return PyErr_Format(PyExc_ValueError, "grow: needs k >= 0 and block_size > 0");
    int with_tokens = a[7] != Py_None;
    if (with_tokens != (a[8] != Py_None))
        return PyErr_Format(PyExc_ValueError, "grow: pass tokens and block_tokens together, or neither");
    I64s rows, ids = {0};
    Py_buffer v[5] = {{0}, {0}, {0}, {0}, {0}};
    if (i64s_get(fname, "rows", a[0], &rows) < 0)
        return NULL;
    if (i64s_get(fname, "ids", a[6], &ids) < 0 || int_array(fname, "num_tokens", a[1], 1, 8, 1, &v[0]) < 0 ||
        int_array(fname, "num_blocks", a[2], 1, 8, 1, &v[1]) < 0 ||
        int_array(fname, "table", a[3], 2, 4, 1, &v[2]) < 0 ||
        (with_tokens && (int_array(fname, "tokens", a[7], 2, 4, 0, &v[3]) < 0 ||
                         int_array(fname, "block_tokens", a[8], 2, 4, 1, &v[4]) < 0)))
        goto fail;
    int64_t *num_tokens = v[0].buf, *num_blocks = v[1].buf;
    int32_t *table = v[2].buf;
    Py_ssize_t n = v[0].shape[0] < v[1].shape[0] ? v[0].shape[0] : v[1].shape[0];
    if (v[2].shape[0] < n)
        n = v[2].shape[0];
    Py_ssize_t cols = v[2].shape[1];
    const int32_t *tokens = with_tokens ? v[3].buf : NULL;
    int32_t *mirror = with_tokens ? v[4].buf : NULL;
    Py_ssize_t mirror_blocks = with_tokens ? v[4].shape[0] : 0;
    if (with_tokens && (v[3].shape[0] != rows.len || v[3].shape[1] != k || v[4].shape[1] != bs)) {
        PyErr_Format(PyExc_ValueError, "grow: tokens must be [%zd, %zd] and block_tokens [N, %zd]", rows.len,
                     k, bs);
        goto fail;
    }

    /* check everything first */
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        if (r < 0 || r >= (int64_t)n) {
            PyErr_Format(PyExc_IndexError, "grow: row %lld out of range", (long long)r);
            goto fail;
        }
        int64_t need = blocks_needed(num_tokens[r] + k, num_blocks[r], bs);
        if (num_blocks[r] + need > (int64_t)cols) {
            PyErr_Format(PyExc_ValueError, "grow: row %lld needs %lld table columns, the table has %zd",
                         (long long)r, (long long)(num_blocks[r] + need), cols);
            goto fail;
        }
        if (with_tokens) { /* the existing blocks the new tokens land in */
            for (int64_t pos = num_tokens[r]; pos < num_tokens[r] + k && pos / bs < num_blocks[r]; pos++) {
                int32_t b = table[r * cols + pos / bs];
                if (b < 0 || b >= mirror_blocks) {
                    PyErr_Format(PyExc_IndexError, "grow: block %d out of range of block_tokens", (int)b);
                    goto fail;
                }
            }
        }
        total += need;
    }
    if (total != (int64_t)ids.len) {
        PyErr_Format(PyExc_ValueError, "grow: %zd ids for %lld new blocks", ids.len, (long long)total);
        goto fail;
    }
    for (Py_ssize_t p = 0; p < ids.len; p++) {
        if (ids.values[p] < 0 || ids.values[p] > INT32_MAX || (with_tokens && ids.values[p] >= mirror_blocks)) {
            PyErr_Format(PyExc_IndexError, "grow: new block id %lld out of range", (long long)ids.values[p]);
            goto fail;
        }
    }

    /* then change it */
    Py_ssize_t p = 0;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        int32_t *row = table + r * cols;
        int64_t old = num_tokens[r];
        int64_t need = blocks_needed(old + k, num_blocks[r], bs);
        if (num_blocks[r] + need > (int64_t)cols || need > (int64_t)(ids.len - p)) {
            /* only a row listed twice gets here (the checks above saw each row once): stop before
               writing out of bounds; the rows before stay grown */
            PyErr_SetString(PyExc_ValueError, "grow: a row is listed twice");
            goto fail;
        }
        for (int64_t j = 0; j < need; j++)
            row[num_blocks[r] + j] = (int32_t)ids.values[p++];
        num_blocks[r] += need;
        if (with_tokens) {
            for (Py_ssize_t j = 0; j < k; j++) {
                int64_t pos = old + j;
                mirror[(Py_ssize_t)row[pos / bs] * bs + pos % bs] = tokens[i * k + j];
            }
        }
        num_tokens[r] = old + k;
    }
    release_all(v, 5);
    i64s_release(&rows);
    i64s_release(&ids);
    Py_RETURN_NONE;

fail:
    release_all(v, 5);
    i64s_release(&rows);
    i64s_release(&ids);
    return NULL;
}

/*
 * publish_computed(kind, prefix, seq_keys, epochs, epoch, rows, computed, tables, blocks) -> list[int]
 * (PythonBackend.publish_computed; `prefix` is the tuple (index, key_of, keyed) and `tables` the tuple
 * (num_tokens, num_computed, hashable, num_published, table), hotpath's `IndexArrays` and `TableArrays`)
 *
 * `mark_computed` for a batch in one call. Row i (r = rows[i]) has c = computed[i] tokens computed (or
 * num_tokens[r] when computed is None): num_computed[r] = c, and its full blocks not published yet,
 * [num_published[r], f) with f = min(c, hashable[r]) // block_size, are published with `publish_row`
 * (num_published[r] = f), keyed by the list seq_keys[r] -- unless seq_keys[r] is None or its keys were
 * computed under another epoch (epochs[r] != epoch; `epochs` is int64 by row): then they stay private. Block j's id is table[r, j];
 * `blocks` is the int32 [num_blocks, block_size] token store (block_size = its second dimension).
 * Rows, table columns and block ids are all checked before anything changes.
 */
static PyObject *native_publish_computed(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                         PyObject *kwnames)
{
    static const char *const names[] = {"kind",     "prefix", "seq_keys", "epochs", "epoch",
                                        "rows", "computed", "tables", "blocks"};
    const char *const fname = "publish_computed";
    PyObject *given[9], *a[14];
    int kind;
    Py_ssize_t epoch;
    if (parse_args(fname, names, 9, 9, 9, args, nargs, kwnames, given) < 0)
        return NULL;
    PyObject *epochs = given[3];
    for (int i = 4; i < 9; i++) /* the rest in the order below reads them */
        given[i - 1] = given[i];
    /* the owners' structs: prefix = (index, key_of, keyed), tables = (num_tokens, num_computed, hashable,
       num_published, table); spread into the argument order the code below reads */
    if (!PyTuple_Check(given[1]) || PyTuple_GET_SIZE(given[1]) != 3)
        return PyErr_Format(PyExc_TypeError, "%s: prefix must be a tuple (index, key_of, keyed)", fname);
    if (!PyTuple_Check(given[6]) || PyTuple_GET_SIZE(given[6]) != 5)
        return PyErr_Format(PyExc_TypeError,
                            "%s: tables must be a tuple (num_tokens, num_computed, hashable, num_published, table)",
                            fname);
    a[0] = given[0];
    for (int i = 0; i < 3; i++)
        a[1 + i] = PyTuple_GET_ITEM(given[1], i);
    a[4] = given[2], a[5] = given[3], a[6] = given[4], a[7] = given[5];
    for (int i = 0; i < 5; i++)
        a[8 + i] = PyTuple_GET_ITEM(given[6], i);
    a[13] = given[7];
    if (get_kind(fname, a[0], &kind) < 0 ||
        check_exact(fname, "index", a[1], &PyDict_Type) < 0 ||
        check_exact(fname, "key_of", a[2], &PyList_Type) < 0 ||
        check_exact(fname, "seq_keys", a[4], &PyList_Type) < 0 || get_ssize(a[5], &epoch) < 0)
        return NULL;
    PyObject *index = a[1], *key_of = a[2], *seq_keys = a[4];
    int with_computed = a[7] != Py_None;
    I64s rows, computed = {0};
    /* num_tokens, num_computed, hashable, num_published, table, blocks, keyed, epochs */
    Py_buffer v[8] = {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
    PyObject *stored = NULL;
    int64_t small[64], *ids = small;
    if (i64s_get(fname, "rows", a[6], &rows) < 0)
        return NULL;
    if ((with_computed && i64s_get(fname, "computed", a[7], &computed) < 0) ||
        int_array(fname, "num_tokens", a[8], 1, 8, 0, &v[0]) < 0 ||
        int_array(fname, "num_computed", a[9], 1, 8, 1, &v[1]) < 0 ||
        int_array(fname, "hashable", a[10], 1, 8, 0, &v[2]) < 0 ||
        int_array(fname, "num_published", a[11], 1, 8, 1, &v[3]) < 0 ||
        int_array(fname, "table", a[12], 2, 4, 0, &v[4]) < 0 || int_array(fname, "blocks", a[13], 2, 4, 0, &v[5]) < 0 ||
        int_array(fname, "epochs", epochs, 1, 8, 0, &v[7]) < 0)
        goto fail;
    if (PyObject_GetBuffer(a[3], &v[6], PyBUF_RECORDS_RO) < 0) {
        v[6].obj = NULL;
        PyErr_Clear();
    }
    if (v[6].obj == NULL || v[6].readonly || v[6].ndim != 1 || v[6].itemsize != 1 ||
        !PyBuffer_IsContiguous(&v[6], 'C')) {
        PyErr_Format(PyExc_TypeError, "%s: keyed must be a writable C-contiguous 1-D array of 1-byte items, not %.100s",
                     fname, Py_TYPE(a[3])->tp_name);
        goto fail;
    }
    const int64_t *num_tokens = v[0].buf, *hashable = v[2].buf, *epoch_of = v[7].buf;
    int64_t *num_computed = v[1].buf, *num_published = v[3].buf;
    const int32_t *table = v[4].buf;
    Py_ssize_t cols = v[4].shape[1], bs = v[5].shape[1], nkeys = PyList_GET_SIZE(key_of);
    Py_ssize_t n = v[0].shape[0];
    for (int i = 1; i < 4; i++)
        if (v[i].shape[0] < n)
            n = v[i].shape[0];
    if (v[4].shape[0] < n)
        n = v[4].shape[0];
    if (PyList_GET_SIZE(seq_keys) < n)
        n = PyList_GET_SIZE(seq_keys);
    if (v[7].shape[0] < n)
        n = v[7].shape[0];
    if (bs <= 0 || v[6].itemsize != 1 || v[6].len < nkeys || (with_computed && computed.len != rows.len)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: empty blocks, keyed not 1-byte items or shorter than key_of, or computed not one per row",
                     fname);
        goto fail;
    }

    /* check everything first */
    Py_ssize_t widest = 0;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        if (r < 0 || r >= (int64_t)n) {
            PyErr_Format(PyExc_IndexError, "%s: row %lld out of range", fname, (long long)r);
            goto fail;
        }
        int64_t c = with_computed ? computed.values[i] : num_tokens[r];
        int64_t full = (c < hashable[r] ? c : hashable[r]) / bs;
        if (c < 0 || full > (int64_t)cols) {
            PyErr_Format(PyExc_ValueError, "%s: row %lld has %lld computed tokens", fname, (long long)r,
                         (long long)c);
            goto fail;
        }
        for (int64_t j = num_published[r] < 0 ? 0 : num_published[r]; j < full; j++) {
            int32_t b = table[r * cols + j];
            if (b < 0 || b >= nkeys || b >= v[5].shape[0]) {
                PyErr_Format(PyExc_IndexError, "%s: block id %d out of range", fname, (int)b);
                goto fail;
            }
        }
        if (full - num_published[r] > widest)
            widest = (Py_ssize_t)(full - num_published[r]);
    }
    if (widest > 64 && (ids = PyMem_Malloc((size_t)widest * sizeof(int64_t))) == NULL) {
        ids = small;
        PyErr_NoMemory();
        goto fail;
    }

    stored = PyList_New(0);
    if (stored == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        int64_t c = with_computed ? computed.values[i] : num_tokens[r];
        num_computed[r] = c;
        int64_t full = (c < hashable[r] ? c : hashable[r]) / bs, start = num_published[r];
        if (full <= start)
            continue;
        num_published[r] = full;
        if (r >= PyList_GET_SIZE(seq_keys)) { /* only Python code run by an odd key object could shrink it */
            PyErr_Format(PyExc_RuntimeError, "%s: seq_keys changed size", fname);
            goto fail;
        }
        PyObject *known = PyList_GET_ITEM(seq_keys, r);
        if (known == Py_None || epoch_of[r] != (int64_t)epoch) /* no keys, or keys of an earlier epoch: */
            continue;                                            /* never matchable, so not published */
        if (!PyList_CheckExact(known)) {
            PyErr_Format(PyExc_TypeError, "%s: seq_keys[%lld] must be a list or None", fname, (long long)r);
            goto fail;
        }
        Py_INCREF(known);
        for (int64_t j = start; j < full; j++)
            ids[j - start] = table[r * cols + j];
        int failed = publish_row(kind, index, key_of, (uint8_t *)v[6].buf, known, (Py_ssize_t)start,
                                 (Py_ssize_t)full, ids, (const uint8_t *)v[5].buf, v[5].len, 4 * bs, stored, -1);
        Py_DECREF(known);
        if (failed < 0)
            goto fail;
    }
    if (ids != small)
        PyMem_Free(ids);
    release_all(v, 8);
    i64s_release(&rows);
    i64s_release(&computed);
    return stored;

fail:
    if (ids != small)
        PyMem_Free(ids);
    Py_XDECREF(stored);
    release_all(v, 8);
    i64s_release(&rows);
    i64s_release(&computed);
    return NULL;
}

/* The tokens every group holds of row r: the least of the groups' num_tokens[r] (`v`: 5 views a group). */
static int64_t held_by_all(const Py_buffer *v, Py_ssize_t ngroups, int64_t r)
{
    int64_t held = ((const int64_t *)v[0].buf)[r];
    for (Py_ssize_t g = 1; g < ngroups; g++) {
        int64_t h = ((const int64_t *)v[5 * g].buf)[r];
        if (h < held)
            held = h;
    }
    return held;
}

/*
 * publish_groups(kind, prefix, seq_keys, rows, computed, groups, tokens, block_size) -> list[int]
 * (PythonBackend.publish_groups; `prefix` is (index, key_of, keyed), `groups` one (num_tokens,
 * num_computed, hashable, num_published, table) tuple per KV cache group)
 *
 * Everything is checked first (types, rows in range of every array, computed counts, table columns, token
 * columns, block ids); computed None reads each row's count from the groups (`held_by_all`); then row by row: every group's num_computed[r] = c; the row's keys are extended
 * (from its token ids, row r of the int32 matrix `tokens`) to the furthest block any group publishes, and
 * each group's new full blocks go through `publish_row` under that group's qualified keys.
 */
static PyObject *native_publish_groups(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames)
{
    static const char *const names[] = {"kind", "prefix", "seq_keys", "rows", "computed", "groups", "tokens",
                                        "block_size"};
    const char *const fname = "publish_groups";
    PyObject *a[8];
    int kind;
    Py_ssize_t bs;
    if (parse_args(fname, names, 8, 8, 8, args, nargs, kwnames, a) < 0 || get_kind(fname, a[0], &kind) < 0 ||
        get_ssize(a[7], &bs) < 0)
        return NULL;
    if (!PyTuple_Check(a[1]) || PyTuple_GET_SIZE(a[1]) != 3)
        return PyErr_Format(PyExc_TypeError, "%s: prefix must be a tuple (index, key_of, keyed)", fname);
    PyObject *index = PyTuple_GET_ITEM(a[1], 0), *key_of = PyTuple_GET_ITEM(a[1], 1);
    PyObject *seq_keys = a[2], *groups = a[5];
    if (check_exact(fname, "index", index, &PyDict_Type) < 0 ||
        check_exact(fname, "key_of", key_of, &PyList_Type) < 0 ||
        check_exact(fname, "seq_keys", seq_keys, &PyList_Type) < 0)
        return NULL;
    if (!PyTuple_Check(groups) || PyTuple_GET_SIZE(groups) < 1 || PyTuple_GET_SIZE(groups) > 256)
        return PyErr_Format(PyExc_TypeError, "%s: groups must be a tuple of 1 to 256 table tuples", fname);
    if (bs <= 0)
        return PyErr_Format(PyExc_ValueError, "%s: block_size must be >= 1, not %zd", fname, bs);
    Py_ssize_t ngroups = PyTuple_GET_SIZE(groups), nkeys = PyList_GET_SIZE(key_of);
    I64s rows = {0}, computed = {0};
    Py_buffer flags = {0}, toks = {0};
    Py_buffer *v = PyMem_Calloc((size_t)(5 * ngroups), sizeof(Py_buffer));
    PyObject *stored = NULL;
    int64_t *ids = NULL;
    if (v == NULL)
        return PyErr_NoMemory();
    int with_computed = a[4] != Py_None;
    if (i64s_get(fname, "rows", a[3], &rows) < 0 ||
        (with_computed && i64s_get(fname, "computed", a[4], &computed) < 0) ||
        int_array(fname, "tokens", a[6], 2, 4, 0, &toks) < 0)
        goto fail;
    if (with_computed && computed.len != rows.len) {
        PyErr_Format(PyExc_ValueError, "%s: %zd rows but %zd computed counts", fname, rows.len, computed.len);
        goto fail;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(a[1], 2), &flags, PyBUF_RECORDS_RO) < 0) {
        flags.obj = NULL;
        PyErr_Clear();
    }
    if (flags.obj == NULL || flags.readonly || flags.ndim != 1 || flags.itemsize != 1 ||
        !PyBuffer_IsContiguous(&flags, 'C') || flags.len < nkeys) {
        PyErr_Format(PyExc_TypeError, "%s: keyed must be a writable C-contiguous 1-D array of 1-byte items, "
                     "at least as long as key_of", fname);
        goto fail;
    }
    Py_ssize_t n = PyList_GET_SIZE(seq_keys), tcols = toks.shape[1], widest = 0;
    if (toks.shape[0] < n)
        n = toks.shape[0];
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        PyObject *t = PyTuple_GET_ITEM(groups, g);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) {
            PyErr_Format(PyExc_TypeError, "%s: groups[%zd] must be a tuple (num_tokens, num_computed, hashable, "
                         "num_published, table)", fname, g);
            goto fail;
        }
        Py_buffer *w = v + 5 * g;
        if (int_array(fname, "num_tokens", PyTuple_GET_ITEM(t, 0), 1, 8, 0, &w[0]) < 0 ||
            int_array(fname, "num_computed", PyTuple_GET_ITEM(t, 1), 1, 8, 1, &w[1]) < 0 ||
            int_array(fname, "hashable", PyTuple_GET_ITEM(t, 2), 1, 8, 0, &w[2]) < 0 ||
            int_array(fname, "num_published", PyTuple_GET_ITEM(t, 3), 1, 8, 1, &w[3]) < 0 ||
            int_array(fname, "table", PyTuple_GET_ITEM(t, 4), 2, 4, 0, &w[4]) < 0)
            goto fail;
        for (int i = 0; i < 5; i++)
            if (w[i].shape[0] < n)
                n = w[i].shape[0];
    }

    /* check everything first */
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i];
        if (r < 0 || r >= (int64_t)n) {
            PyErr_Format(PyExc_IndexError, "%s: row %lld out of range", fname, (long long)r);
            goto fail;
        }
        int64_t c = with_computed ? computed.values[i] : held_by_all(v, ngroups, r);
        if (c < 0) {
            PyErr_Format(PyExc_ValueError, "%s: row %lld has %lld computed tokens", fname, (long long)r, (long long)c);
            goto fail;
        }
        for (Py_ssize_t g = 0; g < ngroups; g++) {
            Py_buffer *w = v + 5 * g;
            const int64_t *hashable = w[2].buf, *published = w[3].buf;
            const int32_t *table = w[4].buf;
            Py_ssize_t cols = w[4].shape[1];
            int64_t full = (c < hashable[r] ? c : hashable[r]) / bs, start = published[r] < 0 ? 0 : published[r];
            if (full <= start)
                continue;
            if (full > (int64_t)cols || full > (int64_t)(tcols / bs)) {
                PyErr_Format(PyExc_ValueError, "%s: row %lld publishes %lld blocks, past its table or tokens",
                             fname, (long long)r, (long long)full);
                goto fail;
            }
            for (int64_t j = start; j < full; j++) {
                int32_t b = table[r * cols + j];
                if (b < 0 || b >= nkeys) {
                    PyErr_Format(PyExc_IndexError, "%s: block id %d out of range", fname, (int)b);
                    goto fail;
                }
            }
            if (full - start > widest)
                widest = (Py_ssize_t)(full - start);
        }
    }
    if ((ids = PyMem_Malloc((size_t)(widest > 0 ? widest : 1) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }

    stored = PyList_New(0);
    if (stored == NULL)
        goto fail;
    const uint8_t *token_bytes = toks.buf;
    for (Py_ssize_t i = 0; i < rows.len; i++) {
        int64_t r = rows.values[i], c = with_computed ? computed.values[i] : held_by_all(v, ngroups, r), furthest = 0;
        for (Py_ssize_t g = 0; g < ngroups; g++) {
            Py_buffer *w = v + 5 * g;
            ((int64_t *)w[1].buf)[r] = c;
            const int64_t *hashable = w[2].buf, *published = w[3].buf;
            int64_t full = (c < hashable[r] ? c : hashable[r]) / bs;
            if (full > published[r] && full > furthest)
                furthest = full;
        }
        if (furthest == 0)
            continue;
        if (r >= PyList_GET_SIZE(seq_keys)) { /* only Python code run by an odd key object could shrink it */
            PyErr_Format(PyExc_RuntimeError, "%s: seq_keys changed size", fname);
            goto fail;
        }
        PyObject *known = PyList_GET_ITEM(seq_keys, r);
        if (known != Py_None && !PyList_CheckExact(known)) {
            PyErr_Format(PyExc_TypeError, "%s: seq_keys[%lld] must be a list or None", fname, (long long)r);
            goto fail;
        }
        Py_INCREF(known);
        if (known != Py_None && extend_known(fname, kind, known, token_bytes + r * tcols * 4, tcols * 4, 4 * bs,
                                             (Py_ssize_t)furthest) < 0) {
            Py_DECREF(known);
            goto fail;
        }
        for (Py_ssize_t g = 0; g < ngroups; g++) {
            Py_buffer *w = v + 5 * g;
            const int64_t *hashable = w[2].buf;
            int64_t *published = w[3].buf;
            const int32_t *table = w[4].buf;
            Py_ssize_t cols = w[4].shape[1];
            int64_t full = (c < hashable[r] ? c : hashable[r]) / bs, start = published[r];
            if (full <= start)
                continue;
            published[r] = full;
            if (known == Py_None) /* prefix caching off: nothing is keyed */
                continue;
            for (int64_t j = start; j < full; j++)
                ids[j - start] = table[r * cols + j];
            if (publish_row(kind, index, key_of, (uint8_t *)flags.buf, known, (Py_ssize_t)start, (Py_ssize_t)full,
                            ids, NULL, 0, 4 * bs, stored, (int)g) < 0) {
                Py_DECREF(known);
                goto fail;
            }
        }
        Py_DECREF(known);
    }
    PyMem_Free(ids);
    release_all(v, (int)(5 * ngroups));
    PyMem_Free(v);
    PyBuffer_Release(&flags);
    PyBuffer_Release(&toks);
    i64s_release(&rows);
    i64s_release(&computed);
    return stored;

fail:
    PyMem_Free(ids);
    Py_XDECREF(stored);
    release_all(v, (int)(5 * ngroups));
    PyMem_Free(v);
    if (flags.obj != NULL)
        PyBuffer_Release(&flags);
    if (toks.obj != NULL)
        PyBuffer_Release(&toks);
    i64s_release(&rows);
    i64s_release(&computed);
    return NULL;
}

/*
 * extend_keys(kind, known, data, width, stop) -> None  (PythonBackend.extend_keys)
 *
 * `extend_known` over `data` (block j's bytes at data[j * width : (j + 1) * width]).
 */
static PyObject *native_extend_keys(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"kind", "known", "data", "width", "stop"};
    const char *const fname = "extend_keys";
    PyObject *a[5];
    int kind;
    Py_ssize_t width, stop;
    if (parse_args(fname, names, 5, 5, 5, args, nargs, kwnames, a) < 0 || get_kind(fname, a[0], &kind) < 0 ||
        check_exact(fname, "known", a[1], &PyList_Type) < 0 || get_ssize(a[3], &width) < 0 ||
        get_ssize(a[4], &stop) < 0)
        return NULL;
    if (width < 0)
        return PyErr_Format(PyExc_ValueError, "%s: width must be >= 0, not %zd", fname, width);
    Py_buffer data;
    if (get_data(fname, "data", a[2], &data) < 0)
        return NULL;
    int failed = extend_known(fname, kind, a[1], (const uint8_t *)data.buf, data.len, width, stop);
    PyBuffer_Release(&data);
    if (failed < 0)
        return NULL;
    Py_RETURN_NONE;
}

/*
 * release_refs(ref, keyed, ids, stack, top, out) -> (top, kept)  (PythonBackend.release_refs)
 *
 * The pool's release: one reference less on each of `ids` (distinct: the caller's contract). A block that
 * reaches zero without a key is pushed on the free stack above `top` (the first of `ids` ends on top);
 * one with a key is written to out[kept++] for the eviction policy. Every check comes first: ids in range,
 * each held, room on the stack and in `out`.
 */
static PyObject *native_release_refs(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"ref", "keyed", "ids", "stack", "top", "out"};
    const char *const fname = "release_refs";
    PyObject *a[6];
    Py_ssize_t top;
    if (parse_args(fname, names, 6, 6, 6, args, nargs, kwnames, a) < 0 || get_ssize(a[4], &top) < 0)
        return NULL;
    Py_buffer v[4] = {{0}, {0}, {0}, {0}}; /* ref, stack, out, keyed */
    I64s ids = {0};
    if (int_array(fname, "ref", a[0], 1, 4, 1, &v[0]) < 0 || int_array(fname, "stack", a[3], 1, 8, 1, &v[1]) < 0 ||
        int_array(fname, "out", a[5], 1, 8, 1, &v[2]) < 0 || i64s_get(fname, "ids", a[2], &ids) < 0)
        goto fail;
    if (PyObject_GetBuffer(a[1], &v[3], PyBUF_C_CONTIGUOUS) < 0) {
        v[3].obj = NULL;
        goto fail;
    }
    int32_t *ref = v[0].buf;
    int64_t *stack = v[1].buf, *out = v[2].buf;
    const uint8_t *keyed = v[3].buf;
    Py_ssize_t nref = v[0].shape[0], nstack = v[1].shape[0];
    if (v[3].itemsize != 1 || v[3].len < nref) {
        PyErr_Format(PyExc_TypeError, "%s: keyed must be a 1-byte array as long as ref", fname);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < ids.len; i++) { /* checked first, in the reference's order: nothing changes */
        if (ids.values[i] < 0 || ids.values[i] >= (int64_t)nref) {
            PyErr_Format(PyExc_IndexError, "%s: block id out of range of ref", fname);
            goto fail;
        }
    }
    if (v[2].shape[0] < ids.len || top < 0 || top > nstack) {
        PyErr_Format(PyExc_ValueError, "%s: needs len(out) >= len(ids) and 0 <= top <= len(stack)", fname);
        goto fail;
    }
    Py_ssize_t plain = 0;
    for (Py_ssize_t i = 0; i < ids.len; i++) {
        int64_t b = ids.values[i];
        if (ref[b] < 1) {
            PyErr_Format(PyExc_ValueError, "%s: a block holds no reference", fname);
            goto fail;
        }
        plain += ref[b] == 1 && !keyed[b];
    }
    if (top + plain > nstack) {
        PyErr_Format(PyExc_ValueError, "%s: no room on the free stack", fname);
        goto fail;
    }
    Py_ssize_t kept = 0, pushed = 0;
    for (Py_ssize_t i = 0; i < ids.len; i++) {
        int64_t b = ids.values[i];
        if (--ref[b] != 0)
            continue;
        if (keyed[b])
            out[kept++] = b;
        else /* the first released lands on top: it is taken first */
            stack[top + plain - 1 - pushed++] = b;
    }
    release_all(v, 4);
    i64s_release(&ids);
    return Py_BuildValue("(nn)", top + plain, kept);

fail:
    release_all(v, 4);
    i64s_release(&ids);
    return NULL;
}

/*
 * take_live(queue_ids, queue_stamps, head, tail, stamp, out, filled) -> (head, filled)
 * (PythonBackend.take_live)
 *
 * Eviction's scan of one LRU queue: from `head`, each entry (queue_ids[h], queue_stamps[h]) is live while
 * the block's stamp still equals the entry's; live blocks are taken in order into out[filled:] (their
 * stamp bumped, so the entry goes stale) until `out` is full or the queue ends at `tail`. Returns the new
 * head (just past the last entry taken, or `tail`) and how much of `out` is filled.
 */
static PyObject *native_take_live(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    static const char *const names[] = {"queue_ids", "queue_stamps", "head", "tail", "stamp", "out", "filled"};
    const char *const fname = "take_live";
    PyObject *a[7];
    Py_ssize_t head, tail, filled;
    if (parse_args(fname, names, 7, 7, 7, args, nargs, kwnames, a) < 0 || get_ssize(a[2], &head) < 0 ||
        get_ssize(a[3], &tail) < 0 || get_ssize(a[6], &filled) < 0)
        return NULL;
    Py_buffer v[4] = {{0}, {0}, {0}, {0}};
    if (int_array(fname, "queue_ids", a[0], 1, 8, 0, &v[0]) < 0 ||
        int_array(fname, "queue_stamps", a[1], 1, 8, 0, &v[1]) < 0 ||
        int_array(fname, "stamp", a[4], 1, 8, 1, &v[2]) < 0 || int_array(fname, "out", a[5], 1, 8, 1, &v[3]) < 0)
        goto fail;
    const int64_t *ids = v[0].buf, *stamps = v[1].buf;
    int64_t *stamp = v[2].buf, *out = v[3].buf;
    Py_ssize_t nstamp = v[2].shape[0], nout = v[3].shape[0];
    if (head < 0 || tail < head || tail > v[0].shape[0] || tail > v[1].shape[0] || filled < 0 || filled > nout) {
        PyErr_Format(PyExc_ValueError, "%s: needs 0 <= head <= tail <= queue length and 0 <= filled <= len(out)",
                     fname);
        goto fail;
    }
    for (Py_ssize_t h = head; h < tail; h++) { /* checked first: nothing changes on a bad id */
        if (ids[h] < 0 || ids[h] >= (int64_t)nstamp) {
            PyErr_Format(PyExc_IndexError, "%s: block id %lld out of range of stamp", fname, (long long)ids[h]);
            goto fail;
        }
    }
    while (head < tail && filled < nout) {
        int64_t b = ids[head];
        if (stamp[b] == stamps[head]) {
            out[filled++] = b;
            stamp[b] += 1;
        }
        head++;
    }
    release_all(v, 4);
    return Py_BuildValue("(nn)", head, filled);

fail:
    release_all(v, 4);
    return NULL;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Test hooks and the module                                                                               */
/* ------------------------------------------------------------------------------------------------------ */

/* sha256(data, *, portable=False) -> bytes: the digest of a bytes-like object. */
static PyObject *native_sha256(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"data", "portable"};
    PyObject *a[2];
    if (parse_args("sha256", names, 2, 1, 1, args, nargs, kwnames, a) < 0)
        return NULL;
    int portable = a[1] == NULL ? 0 : PyObject_IsTrue(a[1]);
    if (portable < 0)
        return NULL;
    Py_buffer data;
    if (get_data("sha256", "data", a[0], &data) < 0)
        return NULL;
    PyObject *digest = PyBytes_FromStringAndSize(NULL, 32);
    if (digest != NULL) {
        Sha256 s;
        sha_init(&s, portable ? sha_compress_portable : sha_compress_best);
        sha_update(&s, (const uint8_t *)data.buf, (size_t)data.len);
        sha_final(&s, (uint8_t *)PyBytes_AS_STRING(digest));
    }
    PyBuffer_Release(&data);
    return digest;
}

static PyObject *native_has_sha_ni(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(sha_compress_best != sha_compress_portable);
}

PyDoc_STRVAR(match_doc,
             "match(kind, index, known, data, width, max_blocks, group=None) -> list[int]\n\n"
             "Leading blocks of `data` found in the cache; hotpath.PythonBackend.match in C.");
PyDoc_STRVAR(publish_rows_doc,
             "publish_rows(kind, prefix, key_lists, starts, stops, blocks, width, ids) "
             "-> list[int]\n\n"
             "Key and index the blocks [starts[r], stops[r]) of each row; hotpath.PythonBackend.publish_rows "
             "in C.");
PyDoc_STRVAR(forget_keys_doc,
             "forget_keys(prefix, ids, dropped=None) -> None\n\n"
             "Drop the keys of evicted blocks from the index and key_of; hotpath.PythonBackend.forget_keys in C.");
PyDoc_STRVAR(check_rows_doc,
             "check_rows(on_device, mark, rows) -> int\n\n"
             "0 if every row is on the device and distinct, 1 if one is not on the device, 2 if one repeats.");
PyDoc_STRVAR(growth_doc, "growth(rows, num_tokens, num_blocks, k, block_size) -> (total_new, max_cols)\n\n"
                         "Blocks a batch needs for k more tokens each; hotpath.PythonBackend.growth in C.");
PyDoc_STRVAR(grow_doc,
             "grow(rows, num_tokens, num_blocks, table, k, block_size, ids, tokens, block_tokens) -> None\n\n"
             "Append new blocks and k tokens to each row; hotpath.PythonBackend.grow in C.");
PyDoc_STRVAR(publish_computed_doc,
             "publish_computed(kind, prefix, seq_keys, epochs, epoch, rows, computed, tables, blocks) -> list[int]\n\n"
             "mark_computed's publishing for a batch; hotpath.PythonBackend.publish_computed in C.");
PyDoc_STRVAR(publish_groups_doc,
             "publish_groups(kind, prefix, seq_keys, rows, computed, groups, tokens, block_size) -> list[int]\n\n"
             "mark_computed's publishing over KV cache groups; hotpath.PythonBackend.publish_groups in C.");
PyDoc_STRVAR(extend_keys_doc, "extend_keys(kind, known, data, width, stop) -> None\n\n"
                              "Chain keys over data's blocks up to block stop; hotpath.PythonBackend.extend_keys in C.");
PyDoc_STRVAR(release_refs_doc,
             "release_refs(ref, keyed, ids, stack, top, out) -> (top, kept)\n\n"
             "The pool's release in one pass; hotpath.PythonBackend.release_refs in C.");
PyDoc_STRVAR(take_live_doc,
             "take_live(queue_ids, queue_stamps, head, tail, stamp, out, filled) -> (head, filled)\n\n"
             "Eviction's scan of one LRU queue; hotpath.PythonBackend.take_live in C.");
PyDoc_STRVAR(sha256_doc, "sha256(data, *, portable=False) -> bytes\n\n"
                         "SHA-256 digest of a bytes-like object (SHA-NI when available unless portable).");
PyDoc_STRVAR(has_sha_ni_doc,
             "has_sha_ni() -> bool\n\nWhether keys are hashed with the x86 SHA instructions.");

static PyMethodDef native_methods[] = {
    {"match", (PyCFunction)(void (*)(void))native_match, METH_FASTCALL | METH_KEYWORDS, match_doc},
    {"publish_rows", (PyCFunction)(void (*)(void))native_publish_rows, METH_FASTCALL | METH_KEYWORDS,
     publish_rows_doc},
    {"forget_keys", (PyCFunction)(void (*)(void))native_forget_keys, METH_FASTCALL | METH_KEYWORDS,
     forget_keys_doc},
    {"check_rows", (PyCFunction)(void (*)(void))native_check_rows, METH_FASTCALL | METH_KEYWORDS,
     check_rows_doc},
    {"growth", (PyCFunction)(void (*)(void))native_growth, METH_FASTCALL | METH_KEYWORDS, growth_doc},
    {"grow", (PyCFunction)(void (*)(void))native_grow, METH_FASTCALL | METH_KEYWORDS, grow_doc},
    {"publish_computed", (PyCFunction)(void (*)(void))native_publish_computed, METH_FASTCALL | METH_KEYWORDS,
     publish_computed_doc},
    {"publish_groups", (PyCFunction)(void (*)(void))native_publish_groups, METH_FASTCALL | METH_KEYWORDS,
     publish_groups_doc},
    {"extend_keys", (PyCFunction)(void (*)(void))native_extend_keys, METH_FASTCALL | METH_KEYWORDS, extend_keys_doc},
    {"release_refs", (PyCFunction)(void (*)(void))native_release_refs, METH_FASTCALL | METH_KEYWORDS,
     release_refs_doc},
    {"take_live", (PyCFunction)(void (*)(void))native_take_live, METH_FASTCALL | METH_KEYWORDS, take_live_doc},
    {"sha256", (PyCFunction)(void (*)(void))native_sha256, METH_FASTCALL | METH_KEYWORDS, sha256_doc},
    {"has_sha_ni", native_has_sha_ni, METH_NOARGS, has_sha_ni_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pagedkv.core._native",
    .m_doc = "The per-block loops of prefix caching in C (see pagedkv.core.hotpath).",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
#ifdef PAGEDKV_SHA_NI
    /* PAGEDKV_SHA=portable keeps the portable code (to measure or test what a CPU without SHA-NI gets) */
    const char *choice = getenv("PAGEDKV_SHA");
    if (cpu_has_sha_ni() && !(choice != NULL && strcmp(choice, "portable") == 0))
        sha_compress_best = sha_compress_shani;
#endif
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddStringConstant(module, "NAME", "native") < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
