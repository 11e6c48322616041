/* The codec's and the switch's per-element loops, one pass each.
 *
 * numpy needs three passes and two temporary arrays to turn a float32 block into big-endian int32
 * (scale, round, cast-and-swap) and two to turn it back; on a 64 MiB tensor those passes cost more
 * than the system calls that move the packets. These loops do each job in one pass, write straight
 * into the buffer a packet is sent from, and release the GIL while they run.
 *
 * The arithmetic is the codec's (docs/protocol.md section 2), bit for bit: a power-of-two scale in
 * float32, rounding half to even, and a sum converted to float32 before its scaling by 2^-shift.
 * A chunk whose agreed exponent is EXP_NONFINITE travels as class codes instead (sa_encode_nonfinite).
 * tests/test_codec.py holds these kernels to a plain numpy statement of the same arithmetic.
 *
 * Buffers are byte buffers (the buffer protocol, C-contiguous); the big-endian side may be at any
 * alignment, so it is read and written through memcpy, which compilers turn into plain moves.
 */
#include "_codec.h"  /* Python.h first */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t swap32(uint32_t v) {
    return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

static inline uint32_t load_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void store_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* gcc does not vectorise these mixed float/int loops by itself, so x86 gets them written out for
 * AVX2 (every x86-64 since 2013), chosen at run time; the scalar loops after them do the last few
 * values, and everything on other machines. */
#define LANES 8
#define SIMD __attribute__((target("avx2")))
static int use_simd;  /* set by sa_codec_init */
SIMD static inline __m256i swap32x8(__m256i v) {
    const __m256i order = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                                           3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    return _mm256_shuffle_epi8(v, order);
}
#else
#define LANES 0
#endif

/* The codec multiplies by 2^shift in float32 where 2^shift is a float32 (as numpy does); beyond,
 * in two steps that are each exact for the values the protocol lets through. */
static inline int fits_float(int shift) { return -126 <= shift && shift <= 127; }

#if LANES
/* Each returns how many values it did (a multiple of LANES); cvtps2dq rounds half to even (the
 * default mode, which Python never changes), like lrintf. */
SIMD static Py_ssize_t quantize_simd(const float *x, unsigned char *q, Py_ssize_t n, float first, float second) {
    const __m256 a = _mm256_set1_ps(first), b = _mm256_set1_ps(second);
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), a), b);
        _mm256_storeu_si256((__m256i *)(q + 4 * i), swap32x8(_mm256_cvtps_epi32(v)));
    }
    return i;
}

SIMD static Py_ssize_t dequantize_simd(const unsigned char *s, float *y, Py_ssize_t n, float scale) {
    const __m256 a = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m256i v = swap32x8(_mm256_loadu_si256((const __m256i *)(s + 4 * i)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), a));
    }
    return i;
}

SIMD static Py_ssize_t add_be_simd(const unsigned char *s, unsigned char *acc, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        __m256i v = swap32x8(_mm256_loadu_si256((const __m256i *)(s + 4 * i)));
        __m256i *dst = (__m256i *)(acc + 4 * i);
        _mm256_storeu_si256(dst, swap32x8(_mm256_add_epi32(swap32x8(_mm256_loadu_si256(dst)), v)));
    }
    return i;
}
#endif

void sa_quantize(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift) {
    const float first = fits_float(shift) ? ldexpf(1.0f, shift) : ldexpf(1.0f, 127);
    const float second = fits_float(shift) ? 1.0f : ldexpf(1.0f, shift - 127);
    Py_ssize_t i = 0;
#if LANES
    if (use_simd)
        i = quantize_simd(x, q, n, first, second);
#endif
    for (; i < n; i++)
        store_u32(q + 4 * i, swap32((uint32_t)(int32_t)lrintf(x[i] * first * second)));
    memset(q + 4 * n, 0, 4 * (size_t)(size - n));
}

void sa_dequantize(const unsigned char *s, float *y, Py_ssize_t n, int shift) {
    Py_ssize_t i = 0;
    if (fits_float(-shift)) {
        const float scale = ldexpf(1.0f, -shift);
#if LANES
        if (use_simd)
            i = dequantize_simd(s, y, n, scale);
#endif
        for (; i < n; i++)
            y[i] = (float)(int32_t)swap32(load_u32(s + 4 * i)) * scale;
    } else {  /* exact in double, then one rounding to float32, as ldexp would */
        const double scale = ldexp(1.0, -shift);
        for (; i < n; i++)
            y[i] = (float)((double)(float)(int32_t)swap32(load_u32(s + 4 * i)) * scale);
    }
}

/* A marked chunk's class codes: one count per class in its own byte, so that the switch's int32 sum
 * over up to MAX_WORKERS (32 < 256) workers adds each class's count without a carry into the next. */
#define CLASS_POS 1u          /* +inf, or a value >= 2^126 */
#define CLASS_NEG (1u << 8)   /* -inf, or a value <= -2^126 */
#define CLASS_NAN (1u << 16)  /* NaN */
#define BITS_INF 0x7f800000u  /* float32 bit patterns, with the sign cleared */
#define BITS_MARKED 0x7e800000u  /* 2^126: from here on a value is past the codec's range */
#define BITS_QNAN 0x7fc00000u  /* the one NaN decoding writes (numpy's and torch's default NaN) */

void sa_encode_nonfinite(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits, code = 0;
        memcpy(&bits, x + i, 4);
        uint32_t mag = bits & 0x7fffffffu;
        if (mag > BITS_INF)
            code = CLASS_NAN;
        else if (mag >= BITS_MARKED)
            code = bits >> 31 ? CLASS_NEG : CLASS_POS;
        store_u32(q + 4 * i, swap32(code));
    }
    memset(q + 4 * n, 0, 4 * (size_t)(size - n));
}

void sa_decode_nonfinite(const unsigned char *s, float *y, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = swap32(load_u32(s + 4 * i));
        int pos = (v & 0xffu) != 0, neg = (v >> 8 & 0xffu) != 0, nan = (v >> 16 & 0xffu) != 0;
        /* one sign alone keeps its infinity; anything else is NaN, all-finite positions included,
         * because their finite sum was never sent */
        uint32_t bits = nan || pos == neg ? BITS_QNAN : pos ? BITS_INF : BITS_INF | 0x80000000u;
        memcpy(y + i, &bits, 4);
    }
}

static int get_buffers(PyObject *src, Py_buffer *in, PyObject *dst, Py_buffer *out) {
    if (PyObject_GetBuffer(src, in, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(dst, out, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(in);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *in, Py_buffer *out) {
    PyBuffer_Release(in);
    PyBuffer_Release(out);
}

/* The floats of `src` and the big-endian values of `dst`, `dst` at least as long; -1 with an
 * exception set otherwise. */
static int encode_buffers(const char *name, PyObject *src, Py_buffer *in, PyObject *dst, Py_buffer *out) {
    if (get_buffers(src, in, dst, out) < 0)
        return -1;
    if (in->len > out->len || in->len % 4 || out->len % 4) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of floats do not fit %zd bytes of values", name, in->len,
                     out->len);
        release(in, out);
        return -1;
    }
    return 0;
}

/* The big-endian sums of `src` and the floats of `dst`, `src` at least as long; -1 with an
 * exception set otherwise. */
static int decode_buffers(const char *name, PyObject *src, Py_buffer *in, PyObject *dst, Py_buffer *out) {
    if (get_buffers(src, in, dst, out) < 0)
        return -1;
    if (in->len < out->len || out->len % 4) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of sums cannot fill %zd bytes of floats", name, in->len,
                     out->len);
        release(in, out);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(quantize_doc,
"quantize(src, dst, shift)\n\n"
"float32 ``src`` times 2**shift, rounded half to even, into ``dst`` as big-endian int32; the\n"
"values of ``dst`` past ``src``'s are zeros (the last block of a tensor is padded).");

static PyObject *quantize(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    int shift;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OOi", &src, &dst, &shift) || encode_buffers("quantize", src, &in, dst, &out) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sa_quantize(in.buf, out.buf, in.len / 4, out.len / 4, shift);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dequantize_doc,
"dequantize(src, dst, shift)\n\n"
"Big-endian int32 sums ``src`` times 2**-shift into float32 ``dst`` (as many as ``dst`` holds).");

static PyObject *dequantize(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    int shift;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OOi", &src, &dst, &shift) || decode_buffers("dequantize", src, &in, dst, &out) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sa_dequantize(in.buf, out.buf, out.len / 4, shift);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(encode_nonfinite_doc,
"encode_nonfinite(src, dst)\n\n"
"The class code of each float32 of ``src`` into ``dst`` as big-endian int32, zero-padded: 0 for\n"
"a finite value below 2**126 in magnitude, 1 for +inf or >= 2**126, 1 << 8 for -inf or <= -2**126,\n"
"1 << 16 for NaN. What a chunk whose agreed exponent is EXP_NONFINITE carries instead of values.");

static PyObject *encode_nonfinite(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OO", &src, &dst) || encode_buffers("encode_nonfinite", src, &in, dst, &out) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sa_encode_nonfinite(in.buf, out.buf, in.len / 4, out.len / 4);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_nonfinite_doc,
"decode_nonfinite(src, dst)\n\n"
"Summed class codes ``src`` (big-endian int32) into float32 ``dst`` (as many as ``dst`` holds): +inf\n"
"where only +inf was counted, -inf where only -inf, NaN everywhere else (a NaN, both infinities,\n"
"or only finite values, whose sum the marked chunk did not carry).");

static PyObject *decode_nonfinite(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OO", &src, &dst) || decode_buffers("decode_nonfinite", src, &in, dst, &out) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sa_decode_nonfinite(in.buf, out.buf, out.len / 4);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(block_maxabs_doc,
"block_maxabs(src, k, dst)\n\n"
"max|x| of each block of ``k`` float32 of ``src`` into float32 ``dst`` (one per block, the last\n"
"block may be short); a block holding NaN gets a NaN, one holding an infinity and no NaN gets inf.");

static PyObject *block_maxabs(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    Py_ssize_t k;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OnO", &src, &k, &dst) || get_buffers(src, &in, dst, &out) < 0)
        return NULL;
    Py_ssize_t n = in.len / 4, blocks = k > 0 ? (n + k - 1) / k : -1;
    if (k <= 0 || in.len % 4 || out.len != 4 * blocks) {
        release(&in, &out);
        return PyErr_Format(PyExc_ValueError, "block_maxabs: %zd bytes in blocks of %zd floats need %zd bytes "
                            "of maxima, not %zd", in.len, k, 4 * blocks, out.len);
    }
    Py_BEGIN_ALLOW_THREADS
    /* |x| as the float's bits with the sign cleared: for these, integer order is float order, and
     * NaN and infinity are exactly the patterns from 0x7f800000 up (NaN's above infinity's), so the
     * maximum is a NaN where the block holds one. Integer maxima vectorise. */
    const unsigned char *x = in.buf;
    float *m = out.buf;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t end = (b + 1) * k < n ? (b + 1) * k : n;
        int32_t best = 0;
        for (Py_ssize_t i = b * k; i < end; i++) {
            int32_t bits;
            memcpy(&bits, x + 4 * i, 4);
            bits &= 0x7fffffff;
            best = bits > best ? bits : best;
        }
        memcpy(m + b, &best, 4);
    }
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

void sa_add_be(unsigned char *acc, const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
#if LANES
    if (use_simd)
        i = add_be_simd(s, acc, n);
#endif
    for (; i < n; i++)
        store_u32(acc + 4 * i, swap32(swap32(load_u32(acc + 4 * i)) + swap32(load_u32(s + 4 * i))));
}

PyDoc_STRVAR(add_be_doc,
"add_be(acc, src)\n\n"
"Add big-endian int32 ``src`` into big-endian int32 ``acc``, wrapping modulo 2**32 like the\n"
"switch's registers (which hold their sums in wire order, so a result is sent as it lies).");

static PyObject *add_be(PyObject *self, PyObject *args) {
    PyObject *dst, *src;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OO", &dst, &src) || get_buffers(src, &in, dst, &out) < 0)
        return NULL;
    if (in.len != out.len || out.len % 4) {
        release(&in, &out);
        return PyErr_Format(PyExc_ValueError, "add_be: %zd bytes added to %zd", in.len, out.len);
    }
    Py_BEGIN_ALLOW_THREADS
    sa_add_be(out.buf, in.buf, out.len / 4);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyMethodDef sa_codec_methods[] = {
    {"quantize", quantize, METH_VARARGS, quantize_doc},
    {"dequantize", dequantize, METH_VARARGS, dequantize_doc},
    {"encode_nonfinite", encode_nonfinite, METH_VARARGS, encode_nonfinite_doc},
    {"decode_nonfinite", decode_nonfinite, METH_VARARGS, decode_nonfinite_doc},
    {"block_maxabs", block_maxabs, METH_VARARGS, block_maxabs_doc},
    {"add_be", add_be, METH_VARARGS, add_be_doc},
    {NULL, NULL, 0, NULL},
};

int sa_codec_init(void) {
#if LANES
    __builtin_cpu_init();
    use_simd = __builtin_cpu_supports("avx2") && getenv("SWITCHAGG_NO_SIMD") == NULL;
    return use_simd;
#else
    return 0;
#endif
}
