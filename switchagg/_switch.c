/* Switch: the embedded switch's data plane in C, for the server's batches of datagrams.
 *
 * It is switchagg.switch.model.SwitchModel.process, rule for rule (the same checks in the same
 * order, the same drop counters, the same register stages tag -> bitmap -> count -> exponent ->
 * values, the same packets out in the same order), with no Python object made per packet: in
 * Python the switch spends more CPU per packet than the four workers it serves together, and on a
 * shared host that CPU is the allreduce's wall time. SwitchModel stays the specification (and the
 * reference the P4 program is tested against); model.NativeSwitch wraps this type with the
 * model's control plane, and tests/test_switch_model.py runs the model's tests and seeded random
 * packet sequences on both, comparing every packet out and every counter.
 *
 * Admission is what SwitchModel's (job, worker, source IP, source port, key) table holds, stored
 * per job: a packet is admitted when its job is installed, its worker is one of the job's ranks,
 * its source is that rank's address and its key is the job's. Addresses are sockaddr_in as
 * recvmmsg/sendmmsg use them.
 */
#include "_codec.h"  /* Python.h first */
#include "_switch.h"
#include "_wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NAME 16  /* sizeof(struct sockaddr_in) */
#define N_JOBS 65536

enum { MALFORMED, BAD_VERSION, NOT_ADMITTED, IP_OPTIONS, FRAGMENT, N_GLOBAL };  /* counters.GlobalDrop */
enum {  /* counters.JobCounter */
    CONTRIBUTIONS, RESULTS_MULTICAST, RESULTS_UNICAST, PROBES, WRONG_GENERATION, SLOT_OUT_OF_RANGE, BAD_COUNT,
    STALE, DUPLICATE_PENDING, QUERIES, RESULTS_TO_OWNER, BAD_OWNER, N_JOB_COUNTERS
};

typedef struct {
    uint32_t generation, key, slot_base, slot_count, k;  /* generation: the installed one, which probes answer */
    int n_workers;
    unsigned char names[MAX_WORKERS][NAME];  /* each rank's address */
    unsigned long long counters[N_JOB_COUNTERS];
} Job;

typedef struct {
    PyObject_HEAD
    Py_ssize_t copies;  /* 2 * num_slots */
    uint64_t *tag;      /* generation << 32 | chunk id */
    uint32_t *bitmap, *count;
    int8_t *exponent;
    unsigned char **values;  /* per copy: its sums in wire order, or NULL before its first write */
    uint32_t *values_k;      /* how many values each holds */
    Job **jobs;              /* by job id, NULL where none is installed */
    unsigned long long global[N_GLOBAL];
    int fanout;  /* the most packets one datagram can make: the largest installed job's worker count */
} Switch;

/* Serial-number order on 32-bit chunk ids (RFC 1982), as model.chunk_is_newer. */
static inline int chunk_is_newer(uint32_t chunk, uint32_t stored) {
    uint32_t d = chunk - stored;
    return 0 < d && d < 0x80000000u;
}

/* The packets one datagram makes go to rows out[0..): header copied from the datagram with its type
 * (and, for a result, exponent and worker) rewritten, then the values. */
static inline void write_head(unsigned char *row, const unsigned char *p, int type) {
    memcpy(row, p, HEADER_SIZE);
    row[OFF_TYPE] = (unsigned char)type;
}

/* One datagram: returns how many packets it made in out rows [0..), or -1 when the copy's stored
 * values have another length (SwitchModel raises there too). */
static int process_one(Switch *sw, const unsigned char *p, Py_ssize_t len, const unsigned char *src,
                       unsigned char *out, Py_ssize_t out_stride, uint32_t *out_len, unsigned char *out_names) {
    if (len < HEADER_SIZE) {
        sw->global[MALFORMED]++;
        return 0;
    }
    if (p[OFF_VERSION] != VERSION) {
        sw->global[BAD_VERSION]++;
        return 0;
    }
    int type = p[OFF_TYPE], flags = p[OFF_FLAGS], worker = p[OFF_WORKER], owner = p[OFF_OWNER];
    uint32_t count = get16(p + OFF_COUNT);
    if ((type != TYPE_CONTRIB && type != TYPE_PROBE && type != TYPE_QUERY) || flags & ~(FLAG_COPY | FLAG_OWNER)
            || (owner && !(flags & FLAG_OWNER)) || worker >= MAX_WORKERS || len != HEADER_SIZE + 4 * (Py_ssize_t)count || (type != TYPE_CONTRIB && count)) {
        sw->global[MALFORMED]++;
        return 0;
    }
    Job *job = sw->jobs[get16(p + OFF_JOB)];
    if (job == NULL || worker >= job->n_workers || memcmp(job->names[worker] + 2, src + 2, 6)
            || get32(p + OFF_KEY) != job->key) {
        sw->global[NOT_ADMITTED]++;
        return 0;
    }
    unsigned long long *counters = job->counters;
    if (type == TYPE_PROBE) {
        counters[PROBES]++;
        write_head(out, p, TYPE_PROBE_REPLY);
        put32(out + OFF_GENERATION, job->generation);
        *out_len = HEADER_SIZE;
        memcpy(out_names, src, NAME);
        return 1;
    }
    uint32_t generation = get32(p + OFF_GENERATION), slot = get16(p + OFF_SLOT), chunk = get32(p + OFF_CHUNK);
    /* Any generation but 0 is a run's (the session its workers agreed on; the tag keeps runs apart); 0 is
     * what every tag powers up holding, so its chunk 0 would read a never-used copy as its own. */
    if (generation == 0) {
        counters[WRONG_GENERATION]++;
        return 0;
    }
    if (slot >= job->slot_count) {
        counters[SLOT_OUT_OF_RANGE]++;
        return 0;
    }
    if (owner >= job->n_workers) {  /* not one of the job's ranks (0 without FLAG_OWNER, which every job has) */
        counters[BAD_OWNER]++;
        return 0;
    }
    if (type == TYPE_CONTRIB && count != job->k) {
        counters[BAD_COUNT]++;
        return 0;
    }
    Py_ssize_t i = 2 * ((Py_ssize_t)job->slot_base + slot) + (flags & FLAG_COPY);
    /* Stage 1, tag: is this chunk new to the copy, the one it holds, or older? */
    uint64_t stored = sw->tag[i];
    int fresh = (uint32_t)(stored >> 32) != generation || chunk_is_newer(chunk, (uint32_t)stored);
    if (!fresh && (uint32_t)stored != chunk) {
        counters[STALE]++;
        return 0;
    }
    if (type == TYPE_QUERY) {  /* read the bitmap, write nothing: SwitchModel._query */
        counters[QUERIES]++;
        write_head(out, p, TYPE_PENDING);
        put32(out + OFF_KEY, fresh ? 0 : sw->bitmap[i]);
        *out_len = HEADER_SIZE;
        memcpy(out_names, src, NAME);
        return 1;
    }
    if (fresh)
        sw->tag[i] = (uint64_t)generation << 32 | chunk;
    /* Stage 2, bitmap: has this worker been counted already? */
    uint32_t bit = (uint32_t)1 << worker, old_bitmap = fresh ? 0 : sw->bitmap[i];
    sw->bitmap[i] = old_bitmap | bit;
    int repeat = (old_bitmap & bit) != 0;
    /* Stage 3, count: first write resets, a new worker increments, a repeat only reads. */
    if (fresh)
        sw->count[i] = 1;
    else if (!repeat)
        sw->count[i]++;
    int complete = sw->count[i] == (uint32_t)job->n_workers;
    if (repeat && !complete) {
        counters[DUPLICATE_PENDING]++;
        return 0;
    }
    /* Stage 4, exponent: the max over workers of the exponent proposed for the slot's next chunk. */
    int8_t proposed = (int8_t)p[OFF_EXPONENT];
    if (fresh)
        sw->exponent[i] = proposed;
    else if (!repeat && proposed > sw->exponent[i])
        sw->exponent[i] = proposed;
    /* Stage 5, values: write, add (wrapping like int32 hardware) or read. */
    const unsigned char *values = p + HEADER_SIZE;
    size_t bytes = 4 * (size_t)count;
    if (fresh) {
        if (sw->values[i] == NULL || sw->values_k[i] != count) {
            unsigned char *row = realloc(sw->values[i], bytes ? bytes : 1);
            if (row == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            sw->values[i] = row;
            sw->values_k[i] = count;
        }
        memcpy(sw->values[i], values, bytes);
    } else if (sw->values_k[i] != count) {
        PyErr_Format(PyExc_ValueError, "add_be: %zu bytes added to %zu", bytes, 4 * (size_t)sw->values_k[i]);
        return -1;
    } else if (!repeat) {
        sa_add_be(sw->values[i], values, count);
    }
    if (!complete) {
        counters[CONTRIBUTIONS]++;
        return 0;
    }
    /* A reduce-scatter's chunk (FLAG_OWNER, as the packet has it) goes whole to its owner alone; every other
     * worker gets the header with count 0 (SwitchModel._aggregate). */
    int to_owner = (flags & FLAG_OWNER) != 0, n = repeat ? 1 : job->n_workers;
    for (int r = 0; r < n; r++) {
        unsigned char *row = out + r * out_stride;
        int rank = repeat ? worker : r, whole = !to_owner || rank == owner;
        write_head(row, p, TYPE_RESULT);
        row[OFF_EXPONENT] = (unsigned char)sw->exponent[i];
        row[OFF_WORKER] = (unsigned char)rank;  /* each replica names its rank, as the P4 egress writes it */
        if (whole) {
            memcpy(row + HEADER_SIZE, sw->values[i], bytes);
        } else {
            put16(row + OFF_COUNT, 0);
        }
        out_len[r] = (uint32_t)(HEADER_SIZE + (whole ? bytes : 0));
        memcpy(out_names + r * NAME, repeat ? src : job->names[r], NAME);
    }
    if (repeat) {
        counters[RESULTS_UNICAST]++;
    } else {
        counters[CONTRIBUTIONS]++;
        counters[to_owner ? RESULTS_TO_OWNER : RESULTS_MULTICAST]++;
    }
    return n;
}

/* A C-contiguous buffer: bytes (width -1), a 2-d uint8 array of rows of `width` bytes (names), or a 1-d
 * uint32 array (width 0: offsets, lengths). */
static int get_array(PyObject *obj, Py_buffer *b, int writable, Py_ssize_t width, const char *what) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    int ok = width < 0 ? b->itemsize == 1
           : width ? b->ndim == 2 && b->itemsize == 1 && b->shape[1] == width
                   : b->ndim == 1 && b->itemsize == 4;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "Switch.process: %s must be %s", what,
                     width < 0 ? "a byte buffer" : width ? "a 2-d uint8 array of 16-byte rows" : "a 1-d uint32 array");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(process_doc,
"process(in_buf, in_offsets, in_lengths, in_names, start, stop, out_buf, out_offsets, out_lengths, out_names)\n"
"-> (next, made)\n\n"
"Handle datagrams start..stop-1 (datagram i is in_lengths[i] bytes at in_buf[in_offsets[i]:], from the\n"
"sockaddr_in in row i of in_names) and write the packets they make one after another into out_buf,\n"
"packet j described by out_offsets[j], out_lengths[j] and its destination in row j of out_names. Stops\n"
"before a datagram whose packets might not fit; returns the next datagram to handle and how many\n"
"packets were made.");

static PyObject *Switch_process(Switch *sw, PyObject *args) {
    PyObject *o[8];
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "OOOOnnOOOO", &o[0], &o[1], &o[2], &o[3], &start, &stop, &o[4], &o[5], &o[6],
                          &o[7]))
        return NULL;
    static const char *names[] = {"in_buf", "in_offsets", "in_lengths", "in_names",
                                  "out_buf", "out_offsets", "out_lengths", "out_names"};
    static const Py_ssize_t widths[] = {-1, 0, 0, NAME, -1, 0, 0, NAME};
    Py_buffer b[8];
    int got = 0;
    for (; got < 8; got++)
        if (get_array(o[got], &b[got], got >= 4, widths[got], names[got]) < 0)
            break;
    PyObject *result = NULL;
    if (got < 8)
        goto done;
    Py_ssize_t rows = b[1].shape[0], cap = b[5].shape[0];
    if (start < 0 || stop > rows || b[2].shape[0] < rows || b[3].shape[0] < rows || b[6].shape[0] < cap
            || b[7].shape[0] < cap) {
        PyErr_SetString(PyExc_ValueError, "Switch.process: start..stop must lie within in_offsets, and each "
                        "lengths and names array must have a row per offset");
        goto done;
    }
    const unsigned char *in = b[0].buf, *in_names = b[3].buf;
    const uint32_t *in_off = b[1].buf, *in_len = b[2].buf;
    unsigned char *out = b[4].buf, *out_names = b[7].buf;
    uint32_t *out_off = b[5].buf, *out_len = b[6].buf;
    Py_ssize_t i = start, made = 0, at = 0;
    for (; i < stop; i++) {
        Py_ssize_t len = in_len[i], size = len > HEADER_SIZE ? len : HEADER_SIZE;  /* what each packet out takes */
        if ((size_t)in_off[i] + (size_t)len > (size_t)b[0].len) {
            PyErr_Format(PyExc_ValueError, "Switch.process: datagram %zd lies outside in_buf", i);
            goto done;
        }
        if (made + sw->fanout > cap || at + sw->fanout * size > b[4].len) {
            if (made == 0) {
                PyErr_Format(PyExc_ValueError, "Switch.process: out_buf and out_offsets must hold a multicast of "
                             "%d packets of %zd bytes", sw->fanout, size);
                goto done;
            }
            break;
        }
        int n = process_one(sw, in + in_off[i], len, in_names + i * NAME, out + at, size, out_len + made,
                            out_names + made * NAME);
        if (n < 0)
            goto done;
        for (int r = 0; r < n; r++)
            out_off[made + r] = (uint32_t)(at + r * size);
        made += n;
        at += n * size;
    }
    result = Py_BuildValue("nn", i, made);
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return result;
}

static Job *job_of(Switch *sw, int job_id) {
    if (job_id < 0 || job_id >= N_JOBS || sw->jobs[job_id] == NULL) {
        PyErr_Format(PyExc_KeyError, "job %d is not installed", job_id);
        return NULL;
    }
    return sw->jobs[job_id];
}

static void set_fanout(Switch *sw) {
    sw->fanout = 1;
    for (int j = 0; j < N_JOBS; j++)
        if (sw->jobs[j] && sw->jobs[j]->n_workers > sw->fanout)
            sw->fanout = sw->jobs[j]->n_workers;
}

PyDoc_STRVAR(install_doc,
"install(job_id, generation, key, slot_base, slot_count, k, names)\n\n"
"Install or update a job; names holds each rank's sockaddr_in (16 bytes each). A job that is\n"
"already installed keeps its counters (a reset is a new generation, not a new job).");

static PyObject *Switch_install(Switch *sw, PyObject *args) {
    int job_id;
    unsigned int generation, key, slot_base, slot_count, k;
    Py_buffer names;
    if (!PyArg_ParseTuple(args, "iIIIIIy*", &job_id, &generation, &key, &slot_base, &slot_count, &k, &names))
        return NULL;
    Py_ssize_t n = names.len / NAME;
    int ok = 0 <= job_id && job_id < N_JOBS && names.len % NAME == 0 && 1 <= n && n <= MAX_WORKERS
             && k <= 0xffff && 2 * ((Py_ssize_t)slot_base + slot_count) <= sw->copies;
    if (!ok) {
        PyBuffer_Release(&names);
        return PyErr_Format(PyExc_ValueError, "Switch.install: job %d does not fit (1..%d workers, K < 65536, "
                            "slots within the switch's)", job_id, MAX_WORKERS);
    }
    Job *job = sw->jobs[job_id];
    if (job == NULL && (job = sw->jobs[job_id] = calloc(1, sizeof(Job))) == NULL) {
        PyBuffer_Release(&names);
        return PyErr_NoMemory();
    }
    job->generation = generation;
    job->key = key;
    job->slot_base = slot_base;
    job->slot_count = slot_count;
    job->k = k;
    job->n_workers = (int)n;
    memcpy(job->names, names.buf, (size_t)names.len);
    PyBuffer_Release(&names);
    set_fanout(sw);
    Py_RETURN_NONE;
}

static PyObject *Switch_remove(Switch *sw, PyObject *arg) {
    int job_id = PyLong_AsLong(arg);
    if ((job_id == -1 && PyErr_Occurred()) || job_of(sw, job_id) == NULL)
        return NULL;
    free(sw->jobs[job_id]);
    sw->jobs[job_id] = NULL;
    set_fanout(sw);
    Py_RETURN_NONE;
}

static PyObject *Switch_counters(Switch *sw, PyObject *arg) {
    unsigned long long *c = sw->global;
    Py_ssize_t n = N_GLOBAL;
    if (arg != Py_None) {
        int job_id = PyLong_AsLong(arg);
        Job *job = (job_id == -1 && PyErr_Occurred()) ? NULL : job_of(sw, job_id);
        if (job == NULL)
            return NULL;
        c = job->counters;
        n = N_JOB_COUNTERS;
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *Switch_copy_state(Switch *sw, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0 || i >= sw->copies)
        return PyErr_Format(PyExc_IndexError, "copy %zd: the switch has %zd", i, sw->copies);
    if (sw->values[i] == NULL)
        return Py_BuildValue("KIIiO", (unsigned long long)sw->tag[i], sw->bitmap[i], sw->count[i], sw->exponent[i],
                             Py_None);
    return Py_BuildValue("KIIiy#", (unsigned long long)sw->tag[i], sw->bitmap[i], sw->count[i], sw->exponent[i],
                         (const char *)sw->values[i], (Py_ssize_t)sw->values_k[i] * 4);
}

static int Switch_init(Switch *sw, PyObject *args, PyObject *kw) {
    Py_ssize_t num_slots;
    if (!PyArg_ParseTuple(args, "n", &num_slots))
        return -1;
    if (sw->tag != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Switch: already initialised");
        return -1;
    }
    if (num_slots < 1 || num_slots > 0x10000) {
        PyErr_Format(PyExc_ValueError, "num_slots = %zd: a switch has 1..65536 slots", num_slots);
        return -1;
    }
    size_t c = 2 * (size_t)num_slots;
    sw->copies = (Py_ssize_t)c;
    sw->fanout = 1;
    sw->tag = calloc(c, sizeof(uint64_t));  /* the power-up state: all zeros, every copy empty */
    sw->bitmap = calloc(c, sizeof(uint32_t));
    sw->count = calloc(c, sizeof(uint32_t));
    sw->exponent = calloc(c, 1);
    sw->values = calloc(c, sizeof(unsigned char *));
    sw->values_k = calloc(c, sizeof(uint32_t));
    sw->jobs = calloc(N_JOBS, sizeof(Job *));
    if (!sw->tag || !sw->bitmap || !sw->count || !sw->exponent || !sw->values || !sw->values_k || !sw->jobs) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Switch_dealloc(Switch *sw) {
    for (Py_ssize_t i = 0; sw->values && i < sw->copies; i++)
        free(sw->values[i]);
    for (int j = 0; sw->jobs && j < N_JOBS; j++)
        free(sw->jobs[j]);
    free(sw->tag);
    free(sw->bitmap);
    free(sw->count);
    free(sw->exponent);
    free(sw->values);
    free(sw->values_k);
    free(sw->jobs);
    Py_TYPE(sw)->tp_free((PyObject *)sw);
}

static PyMethodDef Switch_methods[] = {
    {"process", (PyCFunction)Switch_process, METH_VARARGS, process_doc},
    {"install", (PyCFunction)Switch_install, METH_VARARGS, install_doc},
    {"remove", (PyCFunction)Switch_remove, METH_O, "Remove a job: its packets are no longer admitted."},
    {"counters", (PyCFunction)Switch_counters, METH_O,
     "counters(None): the GlobalDrop counters; counters(job_id): that job's JobCounter counters."},
    {"copy_state", (PyCFunction)Switch_copy_state, METH_O,
     "copy_state(i) -> (tag, bitmap, count, exponent, values or None) of register index i = 2 * slot + copy\n"
     "(the fields of switchagg.switch.registers.CopyState)."},
    {NULL},
};

static PyTypeObject SwitchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchagg._native.Switch",
    .tp_basicsize = sizeof(Switch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("The embedded switch's registers and admission, as SwitchModel holds them (see _switch.c)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Switch_init,
    .tp_dealloc = (destructor)Switch_dealloc,
    .tp_methods = Switch_methods,
};

int sa_add_switch_type(PyObject *module) {
    if (PyType_Ready(&SwitchType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Switch", (PyObject *)&SwitchType);
}
