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
 *
 * Shards (Switch(num_slots, shards, by_slot)): the embedded switch on several cores is one Switch served
 * by `shards` threads at once, each calling process() with its own shard number and its own socket's
 * arrays. process() runs without the GIL. The registers are one table that every shard may touch:
 * the kernel steers a datagram to a shard by its job or a hash of its slot (switch/server.py), but a
 * segmented message (GSO: up to 128 datagrams of one sender) reaches one socket whole, so a shard may
 * serve a datagram steered elsewhere (off_home counts them). Each copy has a mutex (with more than one shard), taken for the stages a packet
 * runs on it, so any shard's service of a copy is exactly the one-shard switch's in some order of
 * arrival. Counters are per shard (a row each, never written by another shard) and summed when read.
 * The job table is read under a read lock for a whole batch; install, remove and every read of
 * counters or registers take it for writing, so no packet sees a job half installed, and a
 * counter read is a snapshot of every shard.
 */
#include "_codec.h"  /* Python.h first */
#include "_switch.h"
#include "_wire.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NAME 16  /* sizeof(struct sockaddr_in) */
#define N_JOBS 65536
#define MAX_SHARDS 64
#define LINE 64  /* a cache line: each shard's counters on lines of their own */
#define SPREAD 0x9E3779B1u  /* server.SPREAD: the steering's hash of a slot (uint32_t arithmetic) */

enum { MALFORMED, BAD_VERSION, NOT_ADMITTED, IP_OPTIONS, FRAGMENT, N_GLOBAL };  /* counters.GlobalDrop */
enum {  /* counters.JobCounter */
    CONTRIBUTIONS, RESULTS_MULTICAST, RESULTS_UNICAST, PROBES, WRONG_GENERATION, SLOT_OUT_OF_RANGE, BAD_COUNT,
    STALE, DUPLICATE_PENDING, QUERIES, RESULTS_TO_OWNER, BAD_OWNER, PARTIALS_UP, PARTIALS_RESENT, RESULTS_FROM_PARENT,
    UNEXPECTED_RESULT, N_JOB_COUNTERS
};

typedef struct {
    _Alignas(LINE) unsigned long long c[N_JOB_COUNTERS];
} JobRow;  /* one shard's counters of a job */

typedef struct {
    _Alignas(LINE) unsigned long long c[N_GLOBAL];
    unsigned long long datagrams, off_home;  /* what it served, and of those what the steering sent elsewhere */
} ShardRow;  /* one shard's switch-wide counters */

typedef struct {
    uint32_t id, generation, key, slot_base, slot_count, k;  /* generation: the installed one, which probes answer */
    int n_workers;
    unsigned char names[MAX_WORKERS][NAME];  /* each rank's address */
    /* Its place in a tree (JobEntry): the tree's ranks, the first under each child and the end of the last's, and
     * the parent its partials go to (has_parent 0: none), as one contribution of its job under its key. */
    uint32_t tree_ranks, bases[MAX_WORKERS + 1];
    int has_parent;
    unsigned char parent_name[NAME];
    uint32_t parent_job, parent_worker, parent_key;
    JobRow counters[];  /* a row per shard */
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
    int *children, n_children;  /* the ids of the jobs with a parent: whose RESULTs a datagram may be */
    ShardRow *shard;         /* a row per shard */
    int shards;
    int by_slot;  /* what the steering reads (switch/server.py): 0 the job, 1 the slot */
    int fanout;  /* the most packets one datagram can make: the largest installed job's worker count */
    pthread_rwlock_t table;  /* process() reads under it, a batch at a time; everything else writes */
    int table_ready;
    pthread_mutex_t *copy_lock;  /* a mutex per copy where shards > 1, else NULL */
} Switch;

/* What went wrong inside a batch, which runs without the GIL: raised once it is held again. */
enum { FAULT_NONE, FAULT_NOMEM, FAULT_OUTSIDE, FAULT_FANOUT };
typedef struct {
    int code;
    Py_ssize_t a, b;
} Fault;

/* Serial-number order on 32-bit chunk ids (RFC 1982), as model.chunk_is_newer. */
static inline int chunk_is_newer(uint32_t chunk, uint32_t stored) {
    uint32_t d = chunk - stored;
    return 0 < d && d < 0x80000000u;
}

/* Where a batch's packets out go. Packet j is len[j] bytes at buf[off[j]:] (its header, and its values where
 * they are small), followed by a body, body_len[j] bytes at buf[body_off[j]:], to names row j. A result of
 * SHARE_FROM bytes of values or more is written once, as a body that every packet of its multicast sends
 * from (the socket hands the kernel each packet's two parts as iovecs; the headers differ, each naming its
 * rank, and a reduce-scatter's non-owners get count 0 and no values), rather than once per worker. Smaller
 * values follow each header, one part a packet: at K = 64 (256 bytes) a second iovec cost the kernel's send
 * about 45 ns a packet, more than the copy it saves here (under 10). Process and send, CPU per datagram in,
 * 4 workers on loopback (a 2-core shared box, medians of 4-6 runs): K = 64 shared 330 ns against 290 copied;
 * K = 256 510 against 570; K = 1024 1025 against 1215; K = 16000 11.6 us against 12.6. Values are copied
 * out of the register at all because a later datagram of the batch may overwrite it before the batch is
 * sent. */
#define SHARE_FROM 1024
typedef struct {
    unsigned char *buf, *names;
    uint32_t *off, *len, *body_off, *body_len;
    Py_ssize_t at, made;  /* bytes of buf and packets written so far */
} Out;

/* A packet out to `name` with no body: the datagram's header with its type rewritten; returns the header's
 * row for the caller's other fields. */
static inline unsigned char *emit(Out *o, const unsigned char *p, int type, const unsigned char *name) {
    unsigned char *row = o->buf + o->at;
    memcpy(row, p, HEADER_SIZE);
    row[OFF_TYPE] = (unsigned char)type;
    o->off[o->made] = (uint32_t)o->at;
    o->len[o->made] = HEADER_SIZE;
    o->body_off[o->made] = 0;
    o->body_len[o->made] = 0;
    memcpy(o->names + o->made * NAME, name, NAME);
    o->at += HEADER_SIZE;
    o->made++;
    return row;
}

/* Copy i's values after a packet's header row just made: once per datagram where they are large (a body that every
 * packet of a multicast sends from, at *body once written), else right after the header, in the same part. */
static void attach_values(Out *out, const unsigned char *values, size_t bytes, Py_ssize_t *body) {
    if (bytes >= SHARE_FROM) {
        if (*body < 0) {
            *body = out->at;
            memcpy(out->buf + *body, values, bytes);
            out->at += (Py_ssize_t)bytes;
        }
        out->body_off[out->made - 1] = (uint32_t)*body;
        out->body_len[out->made - 1] = (uint32_t)bytes;
    } else {
        memcpy(out->buf + out->at, values, bytes);
        out->at += (Py_ssize_t)bytes;
        out->len[out->made - 1] += (uint32_t)bytes;
    }
}

/* The child whose branch holds tree rank `rank`, or -1 where it is under another switch (JobEntry.child_of). */
static inline int child_of(const Job *job, uint32_t rank) {
    for (int c = 0; c < job->n_workers; c++)
        if (job->bases[c] <= rank && rank < job->bases[c + 1])
            return c;
    return -1;
}

/* A finished sum on copy i to every child (SwitchModel._down): a replica each, naming its index, the job and its
 * key; whole down a reduce-scatter owner's branch alone, and nowhere whole without values (with_values 0). */
static int send_down(Switch *sw, const Job *job, Py_ssize_t i, const unsigned char *p, int8_t exponent,
                     int with_values, Out *out) {
    int flags = p[OFF_FLAGS], to_owner = (flags & FLAG_OWNER) != 0;
    int owner_child = to_owner ? child_of(job, p[OFF_OWNER]) : -1;
    uint32_t count = get16(p + OFF_COUNT);
    size_t bytes = 4 * (size_t)sw->values_k[i];
    Py_ssize_t body = -1;
    for (int r = 0; r < job->n_workers; r++) {
        int whole = with_values && (!to_owner || r == owner_child);
        unsigned char *row = emit(out, p, TYPE_RESULT, job->names[r]);
        row[OFF_EXPONENT] = (unsigned char)exponent;
        row[OFF_WORKER] = (unsigned char)r;  /* each replica names its rank, as the P4 egress writes it */
        put16(row + OFF_JOB, (uint16_t)job->id);
        put32(row + OFF_KEY, job->key);
        put16(row + OFF_COUNT, whole ? (uint16_t)count : 0);
        if (whole)
            attach_values(out, sw->values[i], bytes, &body);
    }
    return job->n_workers;
}

/* The parent's RESULT on copy i (SwitchModel._from_parent): taken where the copy awaits it (holds the chunk, with
 * count n: its partial sent up), stored (count n + 1, its exponent, its values unless it is a header alone) and
 * sent down; else dropped as unexpected. */
static int take_result(Switch *sw, Job *job, unsigned long long *counters, Py_ssize_t i, const unsigned char *p,
                       Out *out) {
    uint32_t count = get16(p + OFF_COUNT), generation = get32(p + OFF_GENERATION), chunk = get32(p + OFF_CHUNK);
    uint64_t stored = sw->tag[i];
    if ((uint32_t)(stored >> 32) != generation || (uint32_t)stored != chunk
            || sw->count[i] != (uint32_t)job->n_workers || (count && sw->values_k[i] != count)) {
        counters[UNEXPECTED_RESULT]++;
        return 0;
    }
    sw->count[i] = (uint32_t)job->n_workers + 1;
    sw->exponent[i] = (int8_t)p[OFF_EXPONENT];
    if (count)
        memcpy(sw->values[i], p + HEADER_SIZE, 4 * (size_t)count);
    counters[RESULTS_FROM_PARENT]++;
    return send_down(sw, job, i, p, sw->exponent[i], count != 0, out);
}

/* The stages a CONTRIB runs on copy i (tag -> bitmap -> count -> exponent -> values) and the packets it
 * makes, a QUERY's read of the tag and bitmap, or a parent's RESULT; with shards, under the copy's mutex. */
static int serve_copy(Switch *sw, Job *job, unsigned long long *counters, Py_ssize_t i, const unsigned char *p,
                      const unsigned char *src, Out *out, Fault *fault) {
    int type = p[OFF_TYPE], flags = p[OFF_FLAGS], worker = p[OFF_WORKER], owner = p[OFF_OWNER];
    if (type == TYPE_RESULT)
        return take_result(sw, job, counters, i, p, out);
    uint32_t count = get16(p + OFF_COUNT), generation = get32(p + OFF_GENERATION), chunk = get32(p + OFF_CHUNK);
    /* Stage 1, tag: is this chunk new to the copy, the one it holds, or older? */
    uint64_t stored = sw->tag[i];
    int fresh = (uint32_t)(stored >> 32) != generation || chunk_is_newer(chunk, (uint32_t)stored);
    if (!fresh && (uint32_t)stored != chunk) {
        counters[STALE]++;
        return 0;
    }
    if (type == TYPE_QUERY) {  /* read the bitmap, write nothing: SwitchModel._query */
        counters[QUERIES]++;
        put32(emit(out, p, TYPE_PENDING, src) + OFF_KEY, fresh ? 0 : sw->bitmap[i]);
        return 1;
    }
    /* A copy holding this chunk holds K values of the job on its slot (install and remove clear a job's
     * copies); a copy that does not is a drop, never an add past its values. The model has no such case. */
    if (!fresh && sw->values_k[i] != count) {
        counters[BAD_COUNT]++;
        return 0;
    }
    if (fresh)
        sw->tag[i] = (uint64_t)generation << 32 | chunk;
    /* Stage 2, bitmap: has this worker been counted already? */
    uint32_t bit = (uint32_t)1 << worker, old_bitmap = fresh ? 0 : sw->bitmap[i];
    sw->bitmap[i] = old_bitmap | bit;
    int repeat = (old_bitmap & bit) != 0;
    /* Stage 3, count: first write resets, a new worker increments, a repeat only reads. Complete: every child
     * counted; in a tree, n says the partial went up and awaits the parent's sum, n + 1 that it came. */
    if (fresh)
        sw->count[i] = 1;
    else if (!repeat)
        sw->count[i]++;
    uint32_t n = (uint32_t)job->n_workers;
    int complete = sw->count[i] >= n;
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
                fault->code = FAULT_NOMEM;
                return -1;
            }
            sw->values[i] = row;
            sw->values_k[i] = count;
        }
        memcpy(sw->values[i], values, bytes);
    } else if (!repeat) {
        sa_add_be(sw->values[i], values, count);
    }
    if (!complete) {
        counters[CONTRIBUTIONS]++;
        return 0;
    }
    Py_ssize_t body = -1;
    if (job->has_parent && sw->count[i] == n) {  /* the partial up, as one contribution of the parent's job */
        if (repeat && worker != 0) {  /* while it is awaited, child 0's repeat alone sends it again */
            counters[DUPLICATE_PENDING]++;
            return 0;
        }
        counters[repeat ? PARTIALS_RESENT : CONTRIBUTIONS]++;
        if (!repeat)
            counters[PARTIALS_UP]++;
        unsigned char *row = emit(out, p, TYPE_CONTRIB, job->parent_name);
        row[OFF_WORKER] = (unsigned char)job->parent_worker;
        put16(row + OFF_JOB, (uint16_t)job->parent_job);
        put32(row + OFF_KEY, job->parent_key);
        row[OFF_EXPONENT] = (unsigned char)sw->exponent[i];
        attach_values(out, sw->values[i], bytes, &body);
        return 1;
    }
    /* A reduce-scatter's chunk (FLAG_OWNER, as the packet has it) goes whole down its owner's branch alone; every
     * other child gets the header with count 0 (SwitchModel._aggregate). */
    int to_owner = (flags & FLAG_OWNER) != 0;
    if (repeat) {
        counters[RESULTS_UNICAST]++;
        unsigned char *row = emit(out, p, TYPE_RESULT, src);
        row[OFF_EXPONENT] = (unsigned char)sw->exponent[i];
        if (to_owner && child_of(job, (uint32_t)owner) != worker)
            put16(row + OFF_COUNT, 0);
        else
            attach_values(out, sw->values[i], bytes, &body);
        return 1;
    }
    counters[CONTRIBUTIONS]++;
    counters[to_owner ? RESULTS_TO_OWNER : RESULTS_MULTICAST]++;
    return send_down(sw, job, i, p, sw->exponent[i], 1, out);
}

/* Where the steering program sends a datagram (switch/server.py's home_shard): the shard of its job, or of a
 * hash of its slot; shard 0 when it is too short to hold the field, as the program's load fails there. */
static inline int home_shard(const Switch *sw, const unsigned char *p, Py_ssize_t len) {
    uint32_t shards = (uint32_t)sw->shards;
    if (!sw->by_slot)
        return len >= OFF_JOB + 2 ? (int)(get16(p + OFF_JOB) % shards) : 0;
    return len >= OFF_SLOT + 2 ? (int)((get16(p + OFF_SLOT) * SPREAD >> 16) % shards) : 0;
}

/* One datagram, served by `shard`: returns how many packets it added to out, or -1 with the fault said (no
 * memory for a copy's values). */
static int process_one(Switch *sw, int shard, const unsigned char *p, Py_ssize_t len, const unsigned char *src,
                       Out *out, Fault *fault) {
    ShardRow *mine = &sw->shard[shard];
    unsigned long long *global = mine->c;
    mine->datagrams++;
    if (sw->shards > 1)
        mine->off_home += home_shard(sw, p, len) != shard;
    if (len < HEADER_SIZE) {
        global[MALFORMED]++;
        return 0;
    }
    if (p[OFF_VERSION] != VERSION) {
        global[BAD_VERSION]++;
        return 0;
    }
    int type = p[OFF_TYPE], flags = p[OFF_FLAGS], worker = p[OFF_WORKER], owner = p[OFF_OWNER];
    uint32_t count = get16(p + OFF_COUNT);
    int carries = type == TYPE_CONTRIB || type == TYPE_RESULT;  /* the types with values */
    if ((!carries && type != TYPE_PROBE && type != TYPE_QUERY) || flags & ~(FLAG_COPY | FLAG_OWNER)
            || (owner && !(flags & FLAG_OWNER)) || worker >= MAX_WORKERS || len != HEADER_SIZE + 4 * (Py_ssize_t)count
            || (!carries && count)) {
        global[MALFORMED]++;
        return 0;
    }
    Job *job;
    if (type == TYPE_RESULT) {  /* taken only from the parent of one of the jobs, as it names it */
        job = NULL;
        for (int c = 0; c < sw->n_children && job == NULL; c++) {
            Job *child = sw->jobs[sw->children[c]];
            if (child->parent_job == get16(p + OFF_JOB) && child->parent_worker == (uint32_t)worker
                    && child->parent_key == get32(p + OFF_KEY) && !memcmp(child->parent_name + 2, src + 2, 6))
                job = child;
        }
        if (job == NULL) {
            global[MALFORMED]++;
            return 0;
        }
    } else {
        job = sw->jobs[get16(p + OFF_JOB)];
        if (job == NULL || worker >= job->n_workers || memcmp(job->names[worker] + 2, src + 2, 6)
                || get32(p + OFF_KEY) != job->key) {
            global[NOT_ADMITTED]++;
            return 0;
        }
    }
    unsigned long long *counters = job->counters[shard].c;
    if (type == TYPE_PROBE) {
        counters[PROBES]++;
        put32(emit(out, p, TYPE_PROBE_REPLY, src) + OFF_GENERATION, job->generation);
        return 1;
    }
    uint32_t generation = get32(p + OFF_GENERATION), slot = get16(p + OFF_SLOT);
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
    if ((uint32_t)owner >= job->tree_ranks) {  /* not one of the tree's ranks (0 without FLAG_OWNER: every job's) */
        counters[BAD_OWNER]++;
        return 0;
    }
    /* a parent's RESULT: K values, or its header alone for an owner under another switch (FLAG_OWNER) */
    if ((type == TYPE_CONTRIB && count != job->k)
            || (type == TYPE_RESULT && count != job->k && (count || !(flags & FLAG_OWNER)))) {
        counters[BAD_COUNT]++;
        return 0;
    }
    Py_ssize_t i = 2 * ((Py_ssize_t)job->slot_base + slot) + (flags & FLAG_COPY);
    if (sw->copy_lock == NULL)
        return serve_copy(sw, job, counters, i, p, src, out, fault);
    pthread_mutex_lock(&sw->copy_lock[i]);
    int n = serve_copy(sw, job, counters, i, p, src, out, fault);
    pthread_mutex_unlock(&sw->copy_lock[i]);
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
"process(in_buf, in_offsets, in_lengths, in_names, start, stop, out_buf, out_offsets, out_lengths, out_names,\n"
"        out_body_offsets, out_body_lengths, shard=0) -> (next, made)\n\n"
"Handle datagrams start..stop-1 (datagram i is in_lengths[i] bytes at in_buf[in_offsets[i]:], from the\n"
"sockaddr_in in row i of in_names) and write the packets they make into out_buf: packet j is\n"
"out_lengths[j] bytes at out_offsets[j] (its header, and small values), then a body, out_body_lengths[j]\n"
"bytes at out_body_offsets[j] (a result's values of 1 KiB or more, written once for all the packets of\n"
"its multicast; else empty), to the destination in row j of out_names. Stops before a datagram whose\n"
"packets might not fit; returns the next datagram to handle and how many packets were made. It runs\n"
"without the GIL; `shard` (0..shards-1) is whose counters it adds to, and several threads may call it\n"
"at once, each with a shard of its own and arrays of its own.");

typedef struct {
    const unsigned char *in, *in_names;
    const uint32_t *in_off, *in_len;
    Py_ssize_t in_bytes, cap, out_bytes;
    unsigned char *out, *out_names;
    uint32_t *out_off, *out_len, *body_off, *body_len;
} Batch;

/* Datagrams start..stop-1 of the batch under the table's read lock, without the GIL; returns the next one to
 * handle, *made the packets written. */
static Py_ssize_t serve_batch(Switch *sw, int shard, const Batch *b, Py_ssize_t start, Py_ssize_t stop,
                              Py_ssize_t *made_out, Fault *fault) {
    Py_ssize_t i = start;
    Out out = {b->out, b->out_names, b->out_off, b->out_len, b->body_off, b->body_len, 0, 0};
    pthread_rwlock_rdlock(&sw->table);
    for (; i < stop; i++) {
        Py_ssize_t len = b->in_len[i];
        if ((size_t)b->in_off[i] + (size_t)len > (size_t)b->in_bytes) {
            fault->code = FAULT_OUTSIDE;
            fault->a = i;
            break;
        }
        /* the most one datagram makes: a header per worker, and its values once (shared) or after each */
        Py_ssize_t values = len > HEADER_SIZE ? len - HEADER_SIZE : 0;
        Py_ssize_t room = sw->fanout * HEADER_SIZE + (values >= SHARE_FROM ? 1 : sw->fanout) * values;
        if (out.made + sw->fanout > b->cap || out.at + room > b->out_bytes) {
            if (out.made == 0) {
                fault->code = FAULT_FANOUT;
                fault->a = sw->fanout;
                fault->b = room;
            }
            break;
        }
        if (process_one(sw, shard, b->in + b->in_off[i], len, b->in_names + i * NAME, &out, fault) < 0)
            break;
    }
    pthread_rwlock_unlock(&sw->table);
    *made_out = out.made;
    return i;
}

static PyObject *Switch_process(Switch *sw, PyObject *args) {
    PyObject *o[10];
    Py_ssize_t start, stop;
    int shard = 0;
    if (!PyArg_ParseTuple(args, "OOOOnnOOOOOO|i", &o[0], &o[1], &o[2], &o[3], &start, &stop, &o[4], &o[5], &o[6],
                          &o[7], &o[8], &o[9], &shard))
        return NULL;
    if (shard < 0 || shard >= sw->shards)
        return PyErr_Format(PyExc_ValueError, "Switch.process: shard %d, this switch has shards 0..%d", shard,
                            sw->shards - 1);
    static const char *names[] = {"in_buf", "in_offsets", "in_lengths", "in_names", "out_buf", "out_offsets",
                                  "out_lengths", "out_names", "out_body_offsets", "out_body_lengths"};
    static const Py_ssize_t widths[] = {-1, 0, 0, NAME, -1, 0, 0, NAME, 0, 0};
    Py_buffer b[10];
    int got = 0;
    for (; got < 10; got++)
        if (get_array(o[got], &b[got], got >= 4, widths[got], names[got]) < 0)
            break;
    PyObject *result = NULL;
    if (got < 10)
        goto done;
    Py_ssize_t rows = b[1].shape[0], cap = b[5].shape[0];
    if (start < 0 || stop > rows || b[2].shape[0] < rows || b[3].shape[0] < rows || b[6].shape[0] < cap
            || b[7].shape[0] < cap || b[8].shape[0] < cap || b[9].shape[0] < cap) {
        PyErr_SetString(PyExc_ValueError, "Switch.process: start..stop must lie within in_offsets; the in arrays "
                        "need a row per in_offsets row, the out arrays one per out_offsets row");
        goto done;
    }
    Batch batch = {b[0].buf, b[3].buf, b[1].buf, b[2].buf, b[0].len, cap, b[4].len, b[4].buf, b[7].buf, b[5].buf,
                   b[6].buf, b[8].buf, b[9].buf};
    Fault fault = {FAULT_NONE, 0, 0};
    Py_ssize_t next, made;
    Py_BEGIN_ALLOW_THREADS
    next = serve_batch(sw, shard, &batch, start, stop, &made, &fault);
    Py_END_ALLOW_THREADS
    switch (fault.code) {
    case FAULT_NONE:
        result = Py_BuildValue("nn", next, made);
        break;
    case FAULT_NOMEM:
        PyErr_NoMemory();
        break;
    case FAULT_OUTSIDE:
        PyErr_Format(PyExc_ValueError, "Switch.process: datagram %zd lies outside in_buf", fault.a);
        break;
    default:
        PyErr_Format(PyExc_ValueError, "Switch.process: out_buf and out_offsets must hold a multicast: %zd "
                     "packets, %zd bytes", fault.a, fault.b);
    }
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return result;
}

/* The table for writing (install, remove, and every read of counters or registers, so that a read is a
 * snapshot of every shard), waited for without the GIL: a shard holding the read lock never needs the GIL. */
static void write_lock(Switch *sw) {
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&sw->table);
    Py_END_ALLOW_THREADS
}

static void write_unlock(Switch *sw) {
    pthread_rwlock_unlock(&sw->table);
}

static Job *job_of(Switch *sw, int job_id) {
    if (job_id < 0 || job_id >= N_JOBS || sw->jobs[job_id] == NULL) {
        PyErr_Format(PyExc_KeyError, "job %d is not installed", job_id);
        return NULL;
    }
    return sw->jobs[job_id];
}

/* What the table's jobs imply, anew after each install or remove: the most packets a datagram makes, and which
 * jobs have a parent (whose RESULTs are admitted by scanning them). */
static void index_jobs(Switch *sw) {
    sw->fanout = 1;
    sw->n_children = 0;
    for (int j = 0; j < N_JOBS; j++) {
        if (sw->jobs[j] == NULL)
            continue;
        if (sw->jobs[j]->n_workers > sw->fanout)
            sw->fanout = sw->jobs[j]->n_workers;
        if (sw->jobs[j]->has_parent)
            sw->children[sw->n_children++] = j;
    }
}

/* A job with a counter row per shard, zeroed, on whole cache lines. */
static Job *new_job(Switch *sw) {
    size_t size = offsetof(Job, counters) + (size_t)sw->shards * sizeof(JobRow);
    size = (size + LINE - 1) / LINE * LINE;
    Job *job = aligned_alloc(LINE, size);
    if (job != NULL)
        memset(job, 0, size);
    return job;
}

/* Both copies of slots slot_base..slot_base+slot_count-1 back to the power-up state (SwitchModel._clear): a
 * job's state must not outlive it, or a job re-added on those slots with the old generation would take its
 * chunks for its own. Under the table's write lock. */
static void clear_copies(Switch *sw, uint32_t slot_base, uint32_t slot_count) {
    for (Py_ssize_t i = 2 * (Py_ssize_t)slot_base; i < 2 * ((Py_ssize_t)slot_base + slot_count); i++) {
        sw->tag[i] = 0;
        sw->bitmap[i] = sw->count[i] = sw->values_k[i] = 0;
        sw->exponent[i] = 0;
        free(sw->values[i]);
        sw->values[i] = NULL;
    }
}

PyDoc_STRVAR(install_doc,
"install(job_id, generation, key, slot_base, slot_count, k, names, tree_ranks, bases, parent_name, parent_job,\n"
"        parent_worker, parent_key)\n\n"
"Install or update a job; names holds each rank's sockaddr_in (16 bytes each). Its place in a tree\n"
"(JobEntry): the tree's ranks, bases the first under each child and the end (uint32, native order, n + 1),\n"
"and its parent's sockaddr_in (b'' for none), job, this job's child index there and the parent job's key.\n"
"A new job's slots\n"
"are cleared first; a job that is already installed keeps its counters and registers (a reset is\n"
"a new generation, not a new job). Every shard sees the job whole or not at all: a batch in\n"
"progress finishes first.");

static PyObject *Switch_install(Switch *sw, PyObject *args) {
    int job_id;
    unsigned int generation, key, slot_base, slot_count, k, tree_ranks, parent_job, parent_worker, parent_key;
    Py_buffer names, bases, parent;
    if (!PyArg_ParseTuple(args, "iIIIIIy*Iy*y*III", &job_id, &generation, &key, &slot_base, &slot_count, &k, &names,
                          &tree_ranks, &bases, &parent, &parent_job, &parent_worker, &parent_key))
        return NULL;
    Py_ssize_t n = names.len / NAME;
    int ok = 0 <= job_id && job_id < N_JOBS && names.len % NAME == 0 && 1 <= n && n <= MAX_WORKERS
             && k <= 0xffff && 2 * ((Py_ssize_t)slot_base + slot_count) <= sw->copies
             && bases.len == (n + 1) * (Py_ssize_t)sizeof(uint32_t) && (parent.len == 0 || parent.len == NAME)
             && parent_job <= 0xffff && parent_worker < MAX_WORKERS;
    if (!ok) {
        PyBuffer_Release(&names);
        PyBuffer_Release(&bases);
        PyBuffer_Release(&parent);
        return PyErr_Format(PyExc_ValueError, "Switch.install: job %d does not fit (1..%d workers, K < 65536, "
                            "slots within the switch's, a base per worker and one more, a parent's job id of 16 "
                            "bits and child index below %d)", job_id, MAX_WORKERS, MAX_WORKERS);
    }
    write_lock(sw);
    Job *job = sw->jobs[job_id];
    if (job == NULL) {
        if ((job = sw->jobs[job_id] = new_job(sw)) == NULL) {
            write_unlock(sw);
            PyBuffer_Release(&names);
            return PyErr_NoMemory();
        }
        clear_copies(sw, slot_base, slot_count);
    }
    job->generation = generation;
    job->key = key;
    job->slot_base = slot_base;
    job->slot_count = slot_count;
    job->k = k;
    job->id = (uint32_t)job_id;
    job->n_workers = (int)n;
    memcpy(job->names, names.buf, (size_t)names.len);
    job->tree_ranks = tree_ranks;
    memcpy(job->bases, bases.buf, (size_t)bases.len);
    job->has_parent = parent.len == NAME;
    if (job->has_parent)
        memcpy(job->parent_name, parent.buf, NAME);
    job->parent_job = parent_job;
    job->parent_worker = parent_worker;
    job->parent_key = parent_key;
    index_jobs(sw);
    write_unlock(sw);
    PyBuffer_Release(&names);
    PyBuffer_Release(&bases);
    PyBuffer_Release(&parent);
    Py_RETURN_NONE;
}

static PyObject *Switch_remove(Switch *sw, PyObject *arg) {
    int job_id = PyLong_AsLong(arg);
    if (job_id == -1 && PyErr_Occurred())
        return NULL;
    write_lock(sw);
    if (job_of(sw, job_id) == NULL) {
        write_unlock(sw);
        return NULL;
    }
    clear_copies(sw, sw->jobs[job_id]->slot_base, sw->jobs[job_id]->slot_count);
    free(sw->jobs[job_id]);
    sw->jobs[job_id] = NULL;
    index_jobs(sw);
    write_unlock(sw);
    Py_RETURN_NONE;
}

static PyObject *counter_list(const unsigned long long *c, Py_ssize_t n) {
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

PyDoc_STRVAR(counters_doc,
"counters(job_id, shard=None) -> list\n\n"
"counters(None): the GlobalDrop counters; counters(job_id): that job's JobCounter counters. Summed over\n"
"the shards, or the one shard named.");

static PyObject *Switch_counters(Switch *sw, PyObject *args) {
    PyObject *which, *shard_arg = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &which, &shard_arg))
        return NULL;
    int job_id = -1, shard = -1;
    if (which != Py_None && (job_id = PyLong_AsLong(which)) == -1 && PyErr_Occurred())
        return NULL;
    if (shard_arg != Py_None && (shard = PyLong_AsLong(shard_arg)) == -1 && PyErr_Occurred())
        return NULL;
    if (shard_arg != Py_None && (shard < 0 || shard >= sw->shards))
        return PyErr_Format(PyExc_IndexError, "shard %d: this switch has shards 0..%d", shard, sw->shards - 1);
    unsigned long long sum[N_JOB_COUNTERS] = {0};
    Py_ssize_t n = which == Py_None ? N_GLOBAL : N_JOB_COUNTERS;
    write_lock(sw);
    Job *job = which == Py_None ? NULL : job_of(sw, job_id);
    if (which != Py_None && job == NULL) {
        write_unlock(sw);
        return NULL;
    }
    for (int s = 0; s < sw->shards; s++) {
        if (shard >= 0 && s != shard)
            continue;
        const unsigned long long *c = job ? job->counters[s].c : sw->shard[s].c;
        for (Py_ssize_t i = 0; i < n; i++)
            sum[i] += c[i];
    }
    write_unlock(sw);
    return counter_list(sum, n);
}

static PyObject *Switch_shard_stats(Switch *sw, PyObject *Py_UNUSED(ignored)) {
    unsigned long long row[2 * MAX_SHARDS];
    write_lock(sw);
    for (int s = 0; s < sw->shards; s++) {
        row[2 * s] = sw->shard[s].datagrams;
        row[2 * s + 1] = sw->shard[s].off_home;
    }
    write_unlock(sw);
    PyObject *out = PyList_New(sw->shards);
    for (int s = 0; out && s < sw->shards; s++) {
        PyObject *pair = Py_BuildValue("KK", row[2 * s], row[2 * s + 1]);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, s, pair);
    }
    return out;
}

static PyObject *Switch_copy_state(Switch *sw, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0 || i >= sw->copies)
        return PyErr_Format(PyExc_IndexError, "copy %zd: the switch has %zd", i, sw->copies);
    write_lock(sw);
    PyObject *out;
    if (sw->values[i] == NULL)
        out = Py_BuildValue("KIIiO", (unsigned long long)sw->tag[i], sw->bitmap[i], sw->count[i], sw->exponent[i],
                            Py_None);
    else
        out = Py_BuildValue("KIIiy#", (unsigned long long)sw->tag[i], sw->bitmap[i], sw->count[i], sw->exponent[i],
                            (const char *)sw->values[i], (Py_ssize_t)sw->values_k[i] * 4);
    write_unlock(sw);
    return out;
}

static int Switch_init(Switch *sw, PyObject *args, PyObject *kw) {
    static char *keywords[] = {"num_slots", "shards", "by_slot", NULL};
    Py_ssize_t num_slots;
    int shards = 1, by_slot = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|ip", keywords, &num_slots, &shards, &by_slot))
        return -1;
    if (sw->tag != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Switch: already initialised");
        return -1;
    }
    if (num_slots < 1 || num_slots > 0x10000) {
        PyErr_Format(PyExc_ValueError, "num_slots = %zd: a switch has 1..65536 slots", num_slots);
        return -1;
    }
    if (shards < 1 || shards > MAX_SHARDS) {
        PyErr_Format(PyExc_ValueError, "shards = %d: a switch has 1..%d shards", shards, MAX_SHARDS);
        return -1;
    }
    size_t c = 2 * (size_t)num_slots;
    sw->copies = (Py_ssize_t)c;
    sw->fanout = 1;
    sw->shards = shards;
    sw->by_slot = by_slot;
    sw->tag = calloc(c, sizeof(uint64_t));  /* the power-up state: all zeros, every copy empty */
    sw->bitmap = calloc(c, sizeof(uint32_t));
    sw->count = calloc(c, sizeof(uint32_t));
    sw->exponent = calloc(c, 1);
    sw->values = calloc(c, sizeof(unsigned char *));
    sw->values_k = calloc(c, sizeof(uint32_t));
    sw->jobs = calloc(N_JOBS, sizeof(Job *));
    sw->children = calloc(N_JOBS, sizeof(int));
    sw->shard = aligned_alloc(LINE, (size_t)shards * sizeof(ShardRow));
    if (!sw->tag || !sw->bitmap || !sw->count || !sw->exponent || !sw->values || !sw->values_k || !sw->jobs
            || !sw->children || !sw->shard) {
        PyErr_NoMemory();
        return -1;
    }
    memset(sw->shard, 0, (size_t)shards * sizeof(ShardRow));
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#ifdef PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP  /* a control request is not starved by shards taking turns */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    int err = pthread_rwlock_init(&sw->table, &attr);
    pthread_rwlockattr_destroy(&attr);
    if (err) {
        PyErr_SetString(PyExc_RuntimeError, "Switch: no lock for the job table");
        return -1;
    }
    sw->table_ready = 1;
    if (shards > 1) {
        if ((sw->copy_lock = calloc(c, sizeof(pthread_mutex_t))) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        pthread_mutexattr_t mattr;
        pthread_mutexattr_init(&mattr);
#ifdef PTHREAD_MUTEX_ADAPTIVE_NP  /* held for a copy's stages: spin a little before sleeping */
        pthread_mutexattr_settype(&mattr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
        for (size_t i = 0; i < c; i++)
            pthread_mutex_init(&sw->copy_lock[i], &mattr);
        pthread_mutexattr_destroy(&mattr);
    }
    return 0;
}

static void Switch_dealloc(Switch *sw) {
    for (Py_ssize_t i = 0; sw->values && i < sw->copies; i++)
        free(sw->values[i]);
    for (int j = 0; sw->jobs && j < N_JOBS; j++)
        free(sw->jobs[j]);
    if (sw->copy_lock != NULL)
        for (Py_ssize_t i = 0; i < sw->copies; i++)
            pthread_mutex_destroy(&sw->copy_lock[i]);
    if (sw->table_ready)
        pthread_rwlock_destroy(&sw->table);
    free(sw->copy_lock);
    free(sw->shard);
    free(sw->tag);
    free(sw->bitmap);
    free(sw->count);
    free(sw->exponent);
    free(sw->values);
    free(sw->values_k);
    free(sw->jobs);
    free(sw->children);
    Py_TYPE(sw)->tp_free((PyObject *)sw);
}

static PyMethodDef Switch_methods[] = {
    {"process", (PyCFunction)Switch_process, METH_VARARGS, process_doc},
    {"install", (PyCFunction)Switch_install, METH_VARARGS, install_doc},
    {"remove", (PyCFunction)Switch_remove, METH_O,
     "Remove a job: its packets are no longer admitted, and its slots' copies return to the power-up state."},
    {"counters", (PyCFunction)Switch_counters, METH_VARARGS, counters_doc},
    {"shard_stats", (PyCFunction)Switch_shard_stats, METH_NOARGS,
     "shard_stats() -> [(datagrams, off_home), ...]: per shard, the datagrams it served and how many of them\n"
     "the steering would have sent to another shard (slot % shards; 0 with one shard)."},
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
