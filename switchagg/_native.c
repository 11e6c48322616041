/* switchagg._native: the C parts of switchagg, as one extension module.
 *
 * This file only puts the module together; each part is a file of its own that depends on no
 * other but the codec's loops: _codec.c (quantize, dequantize, block_maxabs, add_be),
 * _stream.c (Stream: the worker's reduction), _switch.c (Switch: the embedded switch). */
#include "_codec.h"  /* Python.h first */
#include "_stream.h"
#include "_switch.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "switchagg._native",
    "One-pass loops of the block floating point codec and of the switch's adds; the worker's Stream; the "
    "embedded switch's data plane.", -1, sa_codec_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    int simd = sa_codec_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "SIMD", simd) < 0 || sa_add_stream_type(m) < 0
                      || sa_add_switch_type(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
