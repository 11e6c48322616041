/* The worker's stream (_stream.c): one reduction's packets, windows and timers, for Python as Stream. */
#ifndef SWITCHAGG_STREAM_H
#define SWITCHAGG_STREAM_H

#include <Python.h>

/* Add the Stream and Arena types, and the wire layout it was compiled with (HEADER_LAYOUT, WIRE), to module. */
int sa_add_stream_type(PyObject *module);

#endif
