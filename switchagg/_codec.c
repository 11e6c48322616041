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
 * tests/test_codec.py holds these kernels to a plain numpy statement of the same arithmetic, on
 * every path this machine runs.
 *
 * Three paths, chosen at import from what the CPU has (the best one) and switchable at run time
 * (codec_path(); SWITCHAGG_CODEC_PATH at import): "scalar" (plain C, every machine), "avx2" and
 * "avx512" (x86-64, each function compiled for its instruction set by a target attribute, so the
 * build needs no -march and the module runs on any x86-64). They compute the same bits: the
 * vector conversions round half to even as lrintf does (the default rounding mode, which Python
 * never changes), and max-abs compares integers either way. The class codes of a marked chunk
 * (rare: some rank held NaN or infinity) are scalar on every path.
 *
 * Buffers are byte buffers (the buffer protocol, C-contiguous); the big-endian side may be at any
 * alignment, so it is read and written through memcpy, which compilers turn into plain moves.
 */
#include "_codec.h"  /* Python.h first */
#include "_wire.h"

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

enum { PATH_SCALAR, PATH_AVX2, PATH_AVX512, N_PATHS };
static const char *const path_names[N_PATHS] = {"scalar", "avx2", "avx512"};
static int has_path[N_PATHS] = {1};  /* what this CPU runs: set by sa_codec_init */
static int path = PATH_SCALAR;       /* the loops in use: sa_codec_init, codec_path() */

/* The codec multiplies by 2^shift in float32 where 2^shift is a float32 (as numpy does); beyond,
 * in two steps that are each exact for the values the protocol lets through. */
static inline int fits_float(int shift) { return -126 <= shift && shift <= 127; }

/* 2^e for -126 <= e <= 127, from its bits: ldexpf is a call, and the stream scales every packet. */
static inline float pow2f(int e) {
    uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* max|x| is taken on the floats' bits with the sign cleared: for these, integer order is float
 * order, and NaN and infinity are exactly the patterns from 0x7f800000 up (NaN's above infinity's),
 * so the maximum is a NaN where the block holds one. Integer maxima vectorise, and no float compare
 * has to agree with another about NaN. */
#define ABS_MASK 0x7fffffffu
#define BITS_MARKED 0x7e800000u  /* 2^126: from here on a value is past the codec's range */

/* codec.propose_exponents for one block, from its max-abs bits: the smallest e with max|x| < 2^e
 * (frexp's exponent: the biased exponent less 126 for a normal number), clamped to
 * [MIN_EXPONENT, 126]; EXP_NONE for an all-zero block, EXP_NONFINITE from 2^126 up (infinity and
 * NaN included). Denormals from 2^-127 up have frexp's -126, smaller ones less, which the clamp
 * makes -127. */
#define MIN_EXPONENT (-127)
static inline int exponent_of(uint32_t maxbits) {
    if (maxbits == 0)
        return EXP_NONE;
    if (maxbits >= BITS_MARKED)
        return EXP_NONFINITE;
    if (maxbits < 0x00400000u)
        return MIN_EXPONENT;
    return (int)(maxbits >> 23) - 126;
}

static uint32_t maxabs_scalar(const float *x, Py_ssize_t n) {
    uint32_t best = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        bits &= ABS_MASK;
        best = bits > best ? bits : best;
    }
    return best;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* gcc does not vectorise these mixed float/int loops by itself, so x86 gets them written out, for
 * AVX2 (every x86-64 since 2013) and AVX-512 (F and BW: the byte shuffle), each chosen at run time.
 * The AVX2 loops do whole vectors and return how many values they did, for the scalar loops to do
 * the last few; the AVX-512 ones do the rest under a mask, which loads nothing past the end. */
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2")))
#define AVX512 __attribute__((target("avx512f,avx512bw")))

AVX2 static inline __m256i swap32x8(__m256i v) {
    const __m256i order = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                                           3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    return _mm256_shuffle_epi8(v, order);
}

AVX512 static inline __m512i swap32x16(__m512i v) {
    const __m512i order = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    return _mm512_shuffle_epi8(v, order);
}

/* the lanes [0, n) of a 16-lane vector, n < 16 */
AVX512 static inline __mmask16 first_lanes(Py_ssize_t n) { return (__mmask16)((1u << n) - 1); }

/* Rounding: cvtps2dq rounds half to even (the default mode), like lrintf. */
AVX2 static Py_ssize_t quantize_avx2(const float *x, unsigned char *q, Py_ssize_t n, float first, float second) {
    const __m256 a = _mm256_set1_ps(first), b = _mm256_set1_ps(second);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), a), b);
        _mm256_storeu_si256((__m256i *)(q + 4 * i), swap32x8(_mm256_cvtps_epi32(v)));
    }
    return i;
}

AVX512 static Py_ssize_t quantize_avx512(const float *x, unsigned char *q, Py_ssize_t n, float first, float second) {
    const __m512 a = _mm512_set1_ps(first), b = _mm512_set1_ps(second);
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), a), b);
        _mm512_storeu_si512(q + 4 * i, swap32x16(_mm512_cvtps_epi32(v)));
    }
    if (i < n) {
        __mmask16 m = first_lanes(n - i);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), a), b);
        _mm512_mask_storeu_epi32(q + 4 * i, m, swap32x16(_mm512_cvtps_epi32(v)));
    }
    return n;
}

AVX2 static Py_ssize_t dequantize_avx2(const unsigned char *s, float *y, Py_ssize_t n, float scale) {
    const __m256 a = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v = swap32x8(_mm256_loadu_si256((const __m256i *)(s + 4 * i)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), a));
    }
    return i;
}

AVX512 static Py_ssize_t dequantize_avx512(const unsigned char *s, float *y, Py_ssize_t n, float scale) {
    const __m512 a = _mm512_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = swap32x16(_mm512_loadu_si512(s + 4 * i));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_cvtepi32_ps(v), a));
    }
    if (i < n) {
        __mmask16 m = first_lanes(n - i);
        __m512i v = swap32x16(_mm512_maskz_loadu_epi32(m, s + 4 * i));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_cvtepi32_ps(v), a));
    }
    return n;
}

/* Four values of dequantize_avx512, in 128-bit registers (the same conversion and product, lane by lane). */
AVX512 static inline __m128 dequantize4(const unsigned char *s, __m128 a) {
    const __m128i order = _mm_set_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    return _mm_mul_ps(_mm_cvtepi32_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)s), order)), a);
}

/* dequantize_avx512 with every store past the cache (non-temporal): where y is a result's place in a
 * call's output, read again only after the call, a store that first reads its line for ownership moves the
 * line twice; without, the line is written once, whole, from the write-combining buffer. y's whole lines go
 * 64 bytes a store, the parts of a line it shares with the values before and after it 16 bytes a store
 * (a 64 MiB numpy array starts 16 bytes into a page), which the buffer combines with the neighbour's when
 * that comes next, as a call's results mostly do: plain stores there, mixed with the streamed ones, made
 * the whole slower than plain stores throughout. Where y is not 16-byte aligned, plain stores. */
AVX512 static void dequantize_nt_avx512(const unsigned char *s, float *y, Py_ssize_t n, float scale) {
    if ((uintptr_t)y & 15) {
        dequantize_avx512(s, y, n, scale);
        return;
    }
    const __m512 a = _mm512_set1_ps(scale);
    const __m128 a4 = _mm_set1_ps(scale);
    Py_ssize_t i = 0, line = (Py_ssize_t)(((64 - ((uintptr_t)y & 63)) & 63) / 4);  /* floats before y's first line */
    for (; i < line && i + 4 <= n; i += 4)
        _mm_stream_ps(y + i, dequantize4(s + 4 * i, a4));
    for (; i + 16 <= n; i += 16) {
        __m512i v = swap32x16(_mm512_loadu_si512(s + 4 * i));
        _mm512_stream_ps(y + i, _mm512_mul_ps(_mm512_cvtepi32_ps(v), a));
    }
    for (; i + 4 <= n; i += 4)
        _mm_stream_ps(y + i, dequantize4(s + 4 * i, a4));
    if (i < n) {
        __mmask16 m = first_lanes(n - i);
        __m512i v = swap32x16(_mm512_maskz_loadu_epi32(m, s + 4 * i));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_cvtepi32_ps(v), a));
    }
}

AVX2 static Py_ssize_t add_be_avx2(const unsigned char *s, unsigned char *acc, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v = swap32x8(_mm256_loadu_si256((const __m256i *)(s + 4 * i)));
        __m256i *dst = (__m256i *)(acc + 4 * i);
        _mm256_storeu_si256(dst, swap32x8(_mm256_add_epi32(swap32x8(_mm256_loadu_si256(dst)), v)));
    }
    return i;
}

AVX512 static Py_ssize_t add_be_avx512(const unsigned char *s, unsigned char *acc, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = swap32x16(_mm512_loadu_si512(s + 4 * i));
        _mm512_storeu_si512(acc + 4 * i, swap32x16(_mm512_add_epi32(swap32x16(_mm512_loadu_si512(acc + 4 * i)), v)));
    }
    if (i < n) {
        __mmask16 m = first_lanes(n - i);
        __m512i v = swap32x16(_mm512_maskz_loadu_epi32(m, s + 4 * i));
        __m512i sum = _mm512_add_epi32(swap32x16(_mm512_maskz_loadu_epi32(m, acc + 4 * i)), v);
        _mm512_mask_storeu_epi32(acc + 4 * i, m, swap32x16(sum));
    }
    return n;
}

/* The bits are non-negative once the sign is cleared, so signed maxima order them as unsigned ones. */
AVX2 static uint32_t maxabs_avx2(const float *x, Py_ssize_t n) {
    const __m256i mask = _mm256_set1_epi32((int)ABS_MASK);
    __m256i best = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        best = _mm256_max_epi32(best, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), mask));
    __m128i half = _mm_max_epi32(_mm256_castsi256_si128(best), _mm256_extracti128_si256(best, 1));
    half = _mm_max_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
    half = _mm_max_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t lanes = (uint32_t)_mm_cvtsi128_si32(half), rest = maxabs_scalar(x + i, n - i);
    return lanes > rest ? lanes : rest;
}

AVX512 static uint32_t maxabs_avx512(const float *x, Py_ssize_t n) {
    const __m512i mask = _mm512_set1_epi32((int)ABS_MASK);
    __m512i best = _mm512_setzero_si512();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16)
        best = _mm512_max_epi32(best, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
    if (i < n)  /* the lanes past the end load as zeros, which no maximum picks over a real |x| */
        best = _mm512_max_epi32(best, _mm512_and_si512(_mm512_maskz_loadu_epi32(first_lanes(n - i), x + i), mask));
    return (uint32_t)_mm512_reduce_max_epi32(best);
}
/* The stream's send of data chunk d, which proposes chunk d + S (_stream.c, proposal_of): x quantized
 * into q and next's max-abs in one loop, x's loads (from the cache: its max-abs was read S packets
 * ago) beside next's (from memory, the one read of it until its own send). */
AVX2 static uint32_t quantize_maxabs_avx2(const float *x, unsigned char *q, Py_ssize_t n, float first,
                                          float second, const float *next, Py_ssize_t n_next) {
    const __m256 a = _mm256_set1_ps(first), b = _mm256_set1_ps(second);
    const __m256i mask = _mm256_set1_epi32((int)ABS_MASK);
    __m256i best = _mm256_setzero_si256();
    Py_ssize_t i = 0, both = n < n_next ? n : n_next;
    for (; i + 8 <= both; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), a), b);
        best = _mm256_max_epi32(best, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(next + i)), mask));
        _mm256_storeu_si256((__m256i *)(q + 4 * i), swap32x8(_mm256_cvtps_epi32(v)));
    }
    Py_ssize_t done = i + quantize_avx2(x + i, q + 4 * i, n - i, first, second);
    for (; done < n; done++)
        store_u32(q + 4 * done, swap32((uint32_t)(int32_t)lrintf(x[done] * first * second)));
    __m128i half = _mm_max_epi32(_mm256_castsi256_si128(best), _mm256_extracti128_si256(best, 1));
    half = _mm_max_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
    half = _mm_max_epi32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(2, 3, 0, 1)));
    uint32_t lanes = (uint32_t)_mm_cvtsi128_si32(half);
    if (i == n_next)  /* a whole chunk's were all in the loop: no second reduction for none */
        return lanes;
    uint32_t rest = maxabs_avx2(next + i, n_next - i);
    return lanes > rest ? lanes : rest;
}

AVX512 static uint32_t quantize_maxabs_avx512(const float *x, unsigned char *q, Py_ssize_t n, float first,
                                              float second, const float *next, Py_ssize_t n_next) {
    const __m512 a = _mm512_set1_ps(first), b = _mm512_set1_ps(second);
    const __m512i mask = _mm512_set1_epi32((int)ABS_MASK);
    __m512i best = _mm512_setzero_si512();
    Py_ssize_t i = 0, both = n < n_next ? n : n_next;
    for (; i + 16 <= both; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), a), b);
        best = _mm512_max_epi32(best, _mm512_and_si512(_mm512_loadu_si512(next + i), mask));
        _mm512_storeu_si512(q + 4 * i, swap32x16(_mm512_cvtps_epi32(v)));
    }
    quantize_avx512(x + i, q + 4 * i, n - i, first, second);
    uint32_t lanes = (uint32_t)_mm512_reduce_max_epi32(best);
    if (i == n_next)  /* a whole chunk's were all in the loop: no second reduction for none */
        return lanes;
    uint32_t rest = maxabs_avx512(next + i, n_next - i);
    return lanes > rest ? lanes : rest;
}
#else
#define HAVE_X86 0
#endif

void sa_quantize(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift) {
    const float first = fits_float(shift) ? pow2f(shift) : ldexpf(1.0f, 127);
    const float second = fits_float(shift) ? 1.0f : ldexpf(1.0f, shift - 127);
    Py_ssize_t i = 0;
#if HAVE_X86
    if (path == PATH_AVX512)
        i = quantize_avx512(x, q, n, first, second);
    else if (path == PATH_AVX2)
        i = quantize_avx2(x, q, n, first, second);
#endif
    for (; i < n; i++)
        store_u32(q + 4 * i, swap32((uint32_t)(int32_t)lrintf(x[i] * first * second)));
    if (n < size)  /* as sa_quantize_propose's */
        memset(q + 4 * n, 0, 4 * (size_t)(size - n));
}

void sa_dequantize(const unsigned char *s, float *y, Py_ssize_t n, int shift) {
    Py_ssize_t i = 0;
    if (fits_float(-shift)) {
        const float scale = pow2f(-shift);
#if HAVE_X86
        if (path == PATH_AVX512)
            i = dequantize_avx512(s, y, n, scale);
        else if (path == PATH_AVX2)
            i = dequantize_avx2(s, y, n, scale);
#endif
        for (; i < n; i++)
            y[i] = (float)(int32_t)swap32(load_u32(s + 4 * i)) * scale;
    } else {  /* exact in double, then one rounding to float32, as ldexp would */
        const double scale = ldexp(1.0, -shift);
        for (; i < n; i++)
            y[i] = (float)((double)(float)(int32_t)swap32(load_u32(s + 4 * i)) * scale);
    }
}

void sa_dequantize_past_cache(const unsigned char *s, float *y, Py_ssize_t n, int shift) {
#if HAVE_X86
    if (path == PATH_AVX512 && fits_float(-shift)) {
        dequantize_nt_avx512(s, y, n, pow2f(-shift));
        return;
    }
#endif
    sa_dequantize(s, y, n, shift);
}

void sa_store_fence(void) {
#if HAVE_X86
    _mm_sfence();
#endif
}

static uint32_t maxabs(const float *x, Py_ssize_t n) {
#if HAVE_X86
    if (path == PATH_AVX512)
        return maxabs_avx512(x, n);
    if (path == PATH_AVX2)
        return maxabs_avx2(x, n);
#endif
    return maxabs_scalar(x, n);
}

int sa_propose(const float *x, Py_ssize_t n) { return exponent_of(maxabs(x, n)); }

int sa_quantize_propose(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift, const float *next,
                        Py_ssize_t n_next) {
#if HAVE_X86
    if (path != PATH_SCALAR && fits_float(shift)) {
        const float first = pow2f(shift);
        uint32_t best = path == PATH_AVX512 ? quantize_maxabs_avx512(x, q, n, first, 1.0f, next, n_next)
                                            : quantize_maxabs_avx2(x, q, n, first, 1.0f, next, n_next);
        if (n < size)  /* the last chunk's padding; every other packet's would be a call to clear nothing */
            memset(q + 4 * n, 0, 4 * (size_t)(size - n));
        return exponent_of(best);
    }
#endif
    sa_quantize(x, q, n, size, shift);
    return sa_propose(next, n_next);
}

/* A marked chunk's class codes: a count of +inf in the low 16 bits and of -inf in the high 16, a NaN
 * counting in both (as +inf + -inf does), so that an aggregation tree's int32 sum over up to 65,535
 * contributors, at any fan-in per level, adds each count without a carry into the other or a wrap. */
#define CLASS_POS 1u                       /* +inf, or a value >= 2^126 */
#define CLASS_NEG (1u << 16)               /* -inf, or a value <= -2^126 */
#define CLASS_NAN (CLASS_POS | CLASS_NEG)  /* NaN */
#define BITS_INF 0x7f800000u  /* float32 bit patterns, with the sign cleared */
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
        int pos = (v & 0xffffu) != 0, neg = (v >> 16) != 0;
        /* one sign alone keeps its infinity; anything else is NaN: both halves (a NaN, or both signs),
         * or neither (all-finite positions, because their finite sum was never sent) */
        uint32_t bits = pos == neg ? BITS_QNAN : pos ? BITS_INF : BITS_INF | 0x80000000u;
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
"dequantize(src, dst, shift, past_cache=False)\n\n"
"Big-endian int32 sums ``src`` times 2**-shift into float32 ``dst`` (as many as ``dst`` holds); with\n"
"``past_cache``, as the stream writes a result: the same bits, stored past the cache where the loops can.");

static PyObject *dequantize(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    int shift, past_cache = 0;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OOi|p", &src, &dst, &shift, &past_cache)
            || decode_buffers("dequantize", src, &in, dst, &out) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (past_cache) {
        sa_dequantize_past_cache(in.buf, out.buf, out.len / 4, shift);
        sa_store_fence();
    } else {
        sa_dequantize(in.buf, out.buf, out.len / 4, shift);
    }
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(encode_nonfinite_doc,
"encode_nonfinite(src, dst)\n\n"
"The class code of each float32 of ``src`` into ``dst`` as big-endian int32, zero-padded: 0 for\n"
"a finite value below 2**126 in magnitude, 1 for +inf or >= 2**126, 1 << 16 for -inf or <= -2**126,\n"
"1 | 1 << 16 for NaN. What a chunk whose agreed exponent is EXP_NONFINITE carries instead of values.");

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
"where only the low 16 bits counted (only +inf), -inf where only the high 16 (only -inf), NaN\n"
"everywhere else (both: a NaN or both infinities; neither: only finite values, whose sum the\n"
"marked chunk did not carry). Exact for up to 65,535 contributors.");

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

/* Blocks of k floats of `src` and one item of `itemsize` bytes per block in `dst`; the number of
 * blocks, or -1 with an exception set. */
static Py_ssize_t block_buffers(const char *name, PyObject *src, Py_buffer *in, Py_ssize_t k, PyObject *dst,
                                Py_buffer *out, Py_ssize_t itemsize) {
    if (get_buffers(src, in, dst, out) < 0)
        return -1;
    Py_ssize_t n = in->len / 4, blocks = k > 0 ? (n + k - 1) / k : -1;
    if (k <= 0 || in->len % 4 || out->len != itemsize * blocks) {
        release(in, out);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes in blocks of %zd floats need %zd bytes of results, not %zd",
                     name, in->len, k, itemsize * blocks, out->len);
        return -1;
    }
    return blocks;
}

PyDoc_STRVAR(block_maxabs_doc,
"block_maxabs(src, k, dst)\n\n"
"max|x| of each block of ``k`` float32 of ``src`` into float32 ``dst`` (one per block, the last\n"
"block may be short); a block holding NaN gets a NaN, one holding an infinity and no NaN gets inf.");

static PyObject *block_maxabs(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    Py_ssize_t k, blocks;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OnO", &src, &k, &dst)
            || (blocks = block_buffers("block_maxabs", src, &in, k, dst, &out, 4)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    const float *x = in.buf;
    Py_ssize_t n = in.len / 4;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        uint32_t best = maxabs(x + b * k, (b + 1) * k < n ? k : n - b * k);
        memcpy((float *)out.buf + b, &best, 4);
    }
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(propose_doc,
"propose(src, k, dst)\n\n"
"The proposed exponent of each block of ``k`` float32 of ``src`` (the last block may be short) into\n"
"int8 ``dst``, one per block: the smallest e with max|x| < 2**e, clamped to [-127, 126]; -128\n"
"(EXP_NONE) for an all-zero block, 127 (EXP_NONFINITE) for one holding NaN, an infinity or a\n"
"magnitude of at least 2**126. codec.propose_exponents, in one pass.");

static PyObject *propose(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    Py_ssize_t k, blocks;
    Py_buffer in, out;
    if (!PyArg_ParseTuple(args, "OnO", &src, &k, &dst)
            || (blocks = block_buffers("propose", src, &in, k, dst, &out, 1)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    const float *x = in.buf;
    Py_ssize_t n = in.len / 4;
    for (Py_ssize_t b = 0; b < blocks; b++)
        ((int8_t *)out.buf)[b] = (int8_t)sa_propose(x + b * k, (b + 1) * k < n ? k : n - b * k);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(quantize_propose_doc,
"quantize_propose(src, dst, shift, next) -> int\n\n"
"quantize(src, dst, shift), and the exponent float32 ``next`` proposes (propose's, for one block)\n"
"taken in the same loop: what the stream does as it sends data chunk d, which proposes chunk d + S.");

static PyObject *quantize_propose(PyObject *self, PyObject *args) {
    PyObject *src, *dst, *next_obj;
    int shift, e;
    Py_buffer in, out, next;
    if (!PyArg_ParseTuple(args, "OOiO", &src, &dst, &shift, &next_obj)
            || PyObject_GetBuffer(next_obj, &next, PyBUF_SIMPLE) < 0)
        return NULL;
    if (encode_buffers("quantize_propose", src, &in, dst, &out) < 0) {
        PyBuffer_Release(&next);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    e = sa_quantize_propose(in.buf, out.buf, in.len / 4, out.len / 4, shift, next.buf, next.len / 4);
    Py_END_ALLOW_THREADS
    release(&in, &out);
    PyBuffer_Release(&next);
    return PyLong_FromLong(e);
}

void sa_add_be(unsigned char *acc, const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
#if HAVE_X86
    if (path == PATH_AVX512)
        i = add_be_avx512(s, acc, n);
    else if (path == PATH_AVX2)
        i = add_be_avx2(s, acc, n);
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

static int path_named(const char *name) {
    for (int p = 0; p < N_PATHS; p++)
        if (strcmp(name, path_names[p]) == 0)
            return p;
    return -1;
}

PyDoc_STRVAR(codec_paths_doc,
"codec_paths() -> tuple\n\n"
"The codec's loops this CPU runs, slowest first: \"scalar\" everywhere, then \"avx2\" and \"avx512\"\n"
"where the processor has them. Each computes the same bits.");

static PyObject *codec_paths(PyObject *self, PyObject *unused) {
    Py_ssize_t count = 0;
    for (int p = 0; p < N_PATHS; p++)
        count += has_path[p];
    PyObject *names = PyTuple_New(count);
    for (int p = 0, i = 0; p < N_PATHS && names != NULL; p++) {
        PyObject *name = has_path[p] ? PyUnicode_FromString(path_names[p]) : NULL;
        if (has_path[p] && name == NULL)
            Py_CLEAR(names);
        else if (has_path[p])
            PyTuple_SET_ITEM(names, i++, name);
    }
    return names;
}

PyDoc_STRVAR(codec_path_doc,
"codec_path(name=None) -> str\n\n"
"The codec's loops in use (\"scalar\", \"avx2\" or \"avx512\"), after switching the whole process to\n"
"``name`` where one is given (ValueError where this CPU cannot run it: codec_paths()). At import\n"
"the best one the CPU has is chosen, or the best up to SWITCHAGG_CODEC_PATH where that is set\n"
"(SWITCHAGG_NO_SIMD=1: scalar). The tests run each path this way against the scalar one.");

static PyObject *codec_path(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    if (name != NULL) {
        int p = path_named(name);
        if (p < 0)
            return PyErr_Format(PyExc_ValueError, "no codec path %R: scalar, avx2 or avx512", PyTuple_GET_ITEM(args, 0));
        if (!has_path[p])
            return PyErr_Format(PyExc_ValueError, "this CPU cannot run the codec's %s path", name);
        path = p;
    }
    return PyUnicode_FromString(path_names[path]);
}

PyMethodDef sa_codec_methods[] = {
    {"quantize", quantize, METH_VARARGS, quantize_doc},
    {"dequantize", dequantize, METH_VARARGS, dequantize_doc},
    {"encode_nonfinite", encode_nonfinite, METH_VARARGS, encode_nonfinite_doc},
    {"decode_nonfinite", decode_nonfinite, METH_VARARGS, decode_nonfinite_doc},
    {"block_maxabs", block_maxabs, METH_VARARGS, block_maxabs_doc},
    {"propose", propose, METH_VARARGS, propose_doc},
    {"quantize_propose", quantize_propose, METH_VARARGS, quantize_propose_doc},
    {"add_be", add_be, METH_VARARGS, add_be_doc},
    {"codec_paths", codec_paths, METH_NOARGS, codec_paths_doc},
    {"codec_path", codec_path, METH_VARARGS, codec_path_doc},
    {NULL, NULL, 0, NULL},
};

int sa_codec_init(void) {
#if HAVE_X86
    __builtin_cpu_init();
    has_path[PATH_AVX2] = __builtin_cpu_supports("avx2") != 0;  /* a feature's bit, not 1 */
    has_path[PATH_AVX512] = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    /* the widest path the environment allows: AVX-512 where the CPU has it (on Zen 4 as fast as AVX2 but
     * for the switch's add, on recent Xeons faster; SWITCHAGG_CODEC_PATH=avx2 where 512-bit vectors
     * lower the clock of the whole core, as on the first AVX-512 Xeons) */
    int most = N_PATHS - 1;
    const char *want = getenv("SWITCHAGG_CODEC_PATH");
    if (getenv("SWITCHAGG_NO_SIMD") != NULL)
        most = PATH_SCALAR;
    else if (want != NULL && *want && path_named(want) >= 0)
        most = path_named(want);
    else if (want != NULL && *want && PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "SWITCHAGG_CODEC_PATH=%s is no "
                                                      "codec path (scalar, avx2, avx512): ignored", want) < 0)
        PyErr_Clear();  /* warnings as errors: the import still succeeds, on the best path */
    path = most;
    while (!has_path[path])
        path--;
    return path != PATH_SCALAR;
}
