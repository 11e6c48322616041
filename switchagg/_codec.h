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
/* A chunk whose agreed exponent is EXP_NONFINITE (127) carries class codes, not values: float32 x[0..n)
 * as big-endian int32 into q[0..size), zero-padded: 0 for a finite value of magnitude below 2^126,
 * 1 for +inf or >= 2^126, 1 << 8 for -inf or <= -2^126, 1 << 16 for NaN. Each class counts in a
 * byte of its own, so the switch's sum over up to 32 workers keeps the counts apart. */
void sa_encode_nonfinite(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size);
/* Summed class codes s[0..n) (big-endian int32) into float32 y[0..n): +inf where only +inf was
 * counted, -inf where only -inf, NaN (0x7fc00000) everywhere else: a NaN, both infinities, or only
 * finite values (the chunk carried no finite sums). */
void sa_decode_nonfinite(const unsigned char *s, float *y, Py_ssize_t n);
/* Big-endian int32 s[0..n) added into big-endian int32 acc[0..n), wrapping modulo 2^32. */
void sa_add_be(unsigned char *acc, const unsigned char *s, Py_ssize_t n);
/* The codec's functions for Python: quantize, dequantize, encode_nonfinite,
 * decode_nonfinite, block_maxabs, add_be. */
extern PyMethodDef sa_codec_methods[];
/* Choose the loops this CPU runs (AVX2 or scalar); returns 1 where the AVX2 ones were chosen. */
int sa_codec_init(void);

#endif
