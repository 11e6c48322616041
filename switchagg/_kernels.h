/* One extension module: the codec's loops (_kernels.c), the worker's stream (_stream.c), the switch (_switch.c). */
#ifndef SWITCHAGG_KERNELS_H
#define SWITCHAGG_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* float32 x[0..n) times 2^shift, rounded half to even, as big-endian int32 into q[0..size), zero-padded. */
void sa_quantize(const float *x, unsigned char *q, Py_ssize_t n, Py_ssize_t size, int shift);
/* Big-endian int32 s[0..n) times 2^-shift into float32 y[0..n). */
void sa_dequantize(const unsigned char *s, float *y, Py_ssize_t n, int shift);
/* Big-endian int32 s[0..n) added into big-endian int32 acc[0..n), wrapping modulo 2^32. */
void sa_add_be(unsigned char *acc, const unsigned char *s, Py_ssize_t n);
/* Add the Stream (_stream.c) and Switch (_switch.c) types to the module. */
int sa_add_stream_type(PyObject *module);
int sa_add_switch_type(PyObject *module);

#endif
