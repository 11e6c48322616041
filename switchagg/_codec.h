/* The codec's and the switch's per-element loops (_codec.c), which the worker's stream (_stream.c)
 * and the switch (_switch.c) call, and which the module (_native.c) exposes to Python. */
#ifndef SWITCHAGG_CODEC_H
#define SWITCHAGG_CODEC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* float32 x[0..n) times 2^shift, rounded half to even, as big-endian int32 into q[0..size), zero-padded. */
void sa_quantize(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift);
/* Big-endian int32 s[0..n) times 2^-shift into float32 y[0..n). */
void sa_dequantize(const unsigned char *s, float *y, Py_ssize_t n, int shift);
/* The same values, stored past the cache (non-temporal stores) where the loops in use can (AVX-512, y
 * 16-byte aligned): the stream's results, read only after the call. sa_store_fence() orders those stores
 * before any later store, as a caller that hands y to another thread needs. */
void sa_dequantize_past_cache(const unsigned char *s, float *y, Py_ssize_t n, int shift);
void sa_store_fence(void);
/* A chunk whose agreed exponent is EXP_NONFINITE (127) carries class codes, not values: float32 x[0..n)
 * as big-endian int32 into q[0..size), zero-padded: 0 for a finite value of magnitude below 2^126,
 * 1 for +inf or >= 2^126, 1 << 16 for -inf or <= -2^126, 1 | 1 << 16 for NaN. +inf counts in the
 * low 16 bits and -inf in the high 16, so a tree's int32 sum over up to 65,535 contributors keeps the
 * counts apart. */
void sa_encode_nonfinite(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size);
/* Summed class codes s[0..n) (big-endian int32) into float32 y[0..n): +inf where only the low half
 * counted, -inf where only the high half, NaN (0x7fc00000) everywhere else: both halves (a NaN, or
 * both infinities) or neither (only finite values: the chunk carried no finite sums). */
void sa_decode_nonfinite(const unsigned char *s, float *y, Py_ssize_t n);
/* The exponent float32 x[0..n) proposes (codec.propose_exponents for one block): the smallest e
 * with max|x| < 2^e, clamped to [-127, 126]; EXP_NONE for all zeros, EXP_NONFINITE where a value is
 * NaN, infinite or at least 2^126 in magnitude. */
int sa_propose(const float *x, Py_ssize_t n);
/* sa_quantize of x, and sa_propose of next[0..n_next) in the same loop: the stream's send of data chunk d,
 * which proposes the exponent of chunk d + S. Returns next's proposal. */
int sa_quantize_propose(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift, const float *next,
                        Py_ssize_t n_next);
/* Ask for the cache lines of p[0..bytes) ahead of their use: for reading, or (write) for writing, which
 * fetches them owned, before the stores that would otherwise stall on the read for ownership. */
static inline void sa_prefetch(const void *p, Py_ssize_t bytes, int write) {
#if defined(__GNUC__)
    for (Py_ssize_t b = 0; b < bytes; b += 64) {
        if (write)
            __builtin_prefetch((const char *)p + b, 1, 3);
        else
            __builtin_prefetch((const char *)p + b, 0, 3);
    }
#endif
}
/* Big-endian int32 s[0..n) added into big-endian int32 acc[0..n), wrapping modulo 2^32. */
void sa_add_be(unsigned char *acc, const unsigned char *s, Py_ssize_t n);
/* The codec's functions for Python: quantize, dequantize, encode_nonfinite, decode_nonfinite,
 * block_maxabs, propose, quantize_propose, add_be; codec_paths and codec_path, which say and switch the loops in use. */
extern PyMethodDef sa_codec_methods[];
/* Choose the loops this CPU runs best (AVX-512, AVX2 or scalar; at most SWITCHAGG_CODEC_PATH's where that
 * is set, scalar under SWITCHAGG_NO_SIMD); returns 1 where vector loops were chosen. */
int sa_codec_init(void);

#endif
