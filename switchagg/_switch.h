/* The embedded switch's data plane (_switch.c), for Python as Switch. */
#ifndef SWITCHAGG_SWITCH_H
#define SWITCHAGG_SWITCH_H

#include <Python.h>

/* Add the Switch type to module. */
int sa_add_switch_type(PyObject *module);

#endif
