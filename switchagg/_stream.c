/* Stream: the worker's side of one allreduce or reduce-scatter call over float32 or int32 data, in C.
 *
 * It is switchagg.protocol.Reduction, step for step (the same schedule, the same window and timer
 * arithmetic, the same packets in the same order), with the per-packet work in one C loop instead
 * of a dozen Python calls per packet: on a loaded host those calls cost the worker more CPU than
 * the codec and the system calls together. Reduction stays the specification; tests/test_protocol.py
 * runs every simulated-network test on both and checks that they send the same bytes at the same
 * times (tests/test_torch_codec.py a staged call's too).
 *
 * Sans-I/O like Reduction: emit() writes the packets due into rows the caller sends, and
 * receive_batch() takes the datagrams the caller received. The congestion window is the caller's
 * protocol.Window object: its fields are read at construction and live here for the whole call, and
 * go back into it once, when the call is over (or stalls, or Python asks: hand_back), so the next
 * call (either implementation) starts with what this one learned. Nothing reads the window during a
 * call, and writing it back after every batch of results cost a tuple of 22 fields and a Python call
 * per batch. The per-call arrays come from an Arena that a client keeps from one call to the next.
 *
 * A staged call (staged=True: a tensor on a GPU, switchagg.torch_payloads) quantizes elsewhere: its
 * chunks' exponents are the stream's, but their values come quantized, a row of K int32 per chunk, and
 * a data chunk goes only once the caller has prepared it (prepare()), which it does a window of chunks
 * at a time as their exponents are agreed (agreed_upto(), exponents()); the sums go back as rows, which
 * the caller takes a window at a time (summed_upto()).
 *
 * The header layout is _wire.h's (HEADER_LAYOUT and WIRE below; a test holds them to wire.py).
 */
#include "_codec.h"  /* Python.h first */
#include "_stream.h"
#include "_wire.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_EXPONENT (-127)
/* protocol's constants (a test holds them to protocol.py: _native.PROTOCOL) */
#define LOSS_SHARE (1.0 / 8)
#define QUEUE_LIMIT 0.032
#define LOSS_QUEUE 0.0004
#define DELAY_SAMPLES 4
#define DELAY_BETA 0.8
#define BACKOFF_CAP 3
#define MIN_RESEND 0.002
#define TAIL_RTTS 4
#define RESEND_DEVIATIONS 3
#define MIN_PROBE 0.01
#define MIN_PROBE_LOSSY 0.003
#define LOSSY_RESULTS 1024
#define EARLY_PROBE 4
#define BURST_STEPS 3  /* protocol.BURST_STEPS */
#define RUN_CAP 64  /* protocol.RUN_CAP */
#define RUN_ASK 8  /* protocol.RUN_ASK */

/* protocol.Window's state (protocol.WindowState, WINDOW_FIELDS below). */
typedef struct {
    double cwnd, ssthresh, min_rto, max_rto, rto, srtt, rttvar, recovery_until, cwnd_before_loss, min_rtt,
        epoch_end, epoch_losses, delay_until, delay_min, recent_rtt, resend_wait, resend_dev;
    int has_srtt;  /* srtt is None until the first sample */
    long since_loss;  /* results since the last loss, counted up to LOSSY_RESULTS (Window.lossy) */
    long delay_samples, losses_seen, losses, max_size;
} Win;

/* An entry's index in a list's links: entries are fewer than NONE (Stream_init; a chunk's id is 32 bits). */
#define NONE UINT32_MAX

/* A doubly linked list of entries, whose links live in the entries (Entry.link): its ends, NONE when empty. */
typedef struct {
    uint32_t head, tail;
} List;
enum { TIMERS, SENDS };  /* the lists: Entry.link's first index */
enum { PREV, NEXT };     /* a neighbour: Entry.link's second index */

/* What the call knows of entry t (the call round, then the data chunks), in one place: a packet's send, emit
 * and result each touch a line or two of it, where a dozen arrays cost a line (and a prefetch stream) each.
 * Only entries the schedule reached (t < next) hold anything (fill). */
typedef struct {
    double deadline;   /* its timer's: the timers list is in (deadline, t) order */
    double last_send;
    Py_ssize_t order;  /* its last send's place among the call's sends */
    long retries;
    uint32_t link[2][2];  /* its neighbours in the timers and sends lists (NONE at either end) */
    uint16_t slot;     /* its slot and shadow copy (fill) */
    uint8_t copy;
    uint8_t done, in_flight;
    uint8_t state;     /* SENT, ASKED or WAITING (protocol.py) */
    int8_t agreed;     /* the exponent its result carried: read only once it is done */
    int8_t used;       /* the exponent its values are quantized with: its slot's last result's (fill), kept
                        * here because that entry's line, a slot count of entries back, is out of the cache
                        * again by the time this one's packet is written and its result read */
} Entry;

/* When an entry was first sent and first resent (or asked about): read only for a result of an entry
 * resent, so written only by resends, apart from the entries every packet touches (send_entry). */
typedef struct {
    double first_send, resent_at;
} Resend;

/* Arena: the memory of a call's per-entry, per-chunk and per-slot arrays (one block) and of its
 * outbox, kept from one call to the next. A call of a 64 MiB tensor at K = 64 has 262k entries and
 * ~23 MB of such arrays: allocated afresh, each call took them as new pages from the kernel, faulted
 * in and zeroed, and gave them back at its end. A client keeps one Arena and lends it to each of its
 * calls in turn; the block grows to the largest call and is never cleared (an entry's state is set
 * when the schedule first reaches it: fill). */
typedef struct {
    PyObject_HEAD
    unsigned char *block;
    size_t size;
    Py_ssize_t *outbox;
    Py_ssize_t out_cap;
    int lent;          /* a Stream holds it */
    long allocations;  /* blocks allocated for it: the first, and each larger one */
} Arena;

static PyTypeObject ArenaType;

typedef struct {
    PyObject_HEAD
    PyObject *window;
    Win w;
    int window_changed;  /* w holds what the Python Window does not yet (hand_back) */
    Arena *arena;        /* where the arrays below live, lent for the Stream's life */
    Py_buffer x, out;  /* the flat input and the output: float32, or int32 when there are no proposals */
    int floats;
    /* Staged: x holds each data chunk's values quantized (a row of K int32), out a row of sums per chunk
     * this rank receives; data chunk d goes only once d < prepared. A plain call's are all prepared. */
    int staged;
    Py_ssize_t prepared;
    Py_ssize_t n_agreed, n_summed;  /* data chunks [0, n_agreed) have their exponents, [0, n_summed) their results */
    int8_t *proposals;  /* per data chunk, floats only */
    Py_ssize_t proposed;  /* proposals[0, proposed) are known: all that the caller gave, else proposal_of's */
    uint8_t *copy0;     /* per slot: the shadow copy of its first use in this call */
    uint16_t job;
    uint8_t worker;
    uint32_t key, generation, first_id;
    int log2n;  /* bits of headroom for the call's ranks */
    unsigned int n_workers;  /* the job's on this switch: its PENDING bitmap's bits (a leaf's fan-in in a tree) */
    unsigned int rank, ranks;  /* the call's: this rank and how many (a tree's, docs/protocol.md section 10) */
    int ask_first;  /* StreamParams.ask_first */
    uint32_t all;  /* a PENDING's bitmap of a finished sum: every worker's bit */
    Py_ssize_t slots, k, n_chunks, rounds, total, numel;
    /* A reduce-scatter (calls.Layout): each rank's shard of `shard` values is `per_shard` chunks, data
     * chunk d belongs to rank d / per_shard, and `out` holds this rank's shard alone. */
    int scatter;
    Py_ssize_t shard, per_shard;
    /* The call round (switchagg.calls): this rank's values and the sum they must come back as, `parts`
     * chunks of K values each (entry t carries part t % parts), and the sum of each part as it came
     * (seen: which came). No data goes before every part's sum is in (unseen = 0); where any differs,
     * the call ends then (mismatch set, the sums in `gathered`). */
    unsigned char *call_row, *expect, *gathered, *seen;
    Py_ssize_t parts, unseen;
    int differs, mismatch;
    Entry *entries;    /* per entry t: the call round's, then the data chunks' */
    Resend *resends;
    int marked;      /* some result carried EXP_NONFINITE (Reduction.marked) */
    Py_ssize_t next, n_done, n_in_flight, n_sends;
    /* The packets in flight twice over: by timer, in (deadline, t) order (Reduction's heap
     * order), and by their last send, oldest first (the order of Reduction._outstanding). */
    List timers, sends;
    uint32_t fill_last;  /* the entry fill() last timed: where it seeks the next one's place from (NONE: none) */
    /* A contribution's header as every packet of the call has it (write_header fills in the rest), and
     * the ids a result must carry as they lie in its header: bytes 2-5 (flags, worker, job) under
     * ids_mask, which leaves the flags out, and bytes 12-19 (generation, key) */
    unsigned char header[HEADER_SIZE];
    uint32_t worker_job, ids_mask;
    uint64_t generation_key;
    Py_ssize_t walk_slot, walk_round;  /* where fill()'s walk of the schedule is: the next data chunk's */
    /* RACK: the order and round trip of the latest-sent packet, sent once, whose result came back */
    Py_ssize_t rack_order;
    double rack_rtt;
    /* The receive batch's results of packets sent once, for the window (win_on_results, once the batch is
     * in): how many, their longest and shortest round trips, how many settled and the shortest of those */
    long taken, settled;
    double longest, shortest, settled_shortest;
    long probes;          /* tail loss probes sent since the last new result */
    int bursting;         /* the silence began on a lossy path: its probes are bursts (probe_burst) */
    double run_lost;      /* the first send of a lossy silence's probe answered in this batch (resend_run); -inf */
    Py_ssize_t quiet_from;  /* the order of the first send after the call's last silence (a probe or timeout) */
    double run_at, run_first;  /* when, and the first send of, the last QUERY about a lost packet sent once */
    double probe_from;    /* the last new result or probe: the next probe waits from here */
    double first_result;  /* when this call's first result came */
    int stalled;          /* a packet was resent for an RTO of silence since the last new result */
    Py_ssize_t *outbox;  /* entries to send, oldest first, from outbox[out_head]; ~t: a QUERY about t */
    Py_ssize_t out_head, out_len, out_cap;
    double last_progress, progress_timeout;
    int started;
    long retransmissions, queries;
    long protocol_errors;  /* results of this call's packets whose owner or count was not the packet's */
    long foreign;  /* datagrams no result or answer of this run's at all (Reduction.foreign) */
    int ready;  /* __init__ succeeded */
} Stream;

/* A Stream whose __init__ failed has no state to work on. */
static int unready(const Stream *s) {
    if (s->ready)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "this Stream was not initialised");
    return 1;
}

/* ---- the window (protocol.Window's methods) ------------------------------------------------- */

/* The window's state travels as protocol.WindowState, a tuple in this order (WINDOW_FIELDS, which
 * tests/test_protocol.py holds to WindowState._fields): Window.state() gives it, Window.restore() takes it. */
#define WINDOW_FIELDS "cwnd", "ssthresh", "min_rto", "max_rto", "rto", "srtt", "rttvar", "recovery_until", \
    "cwnd_before_loss", "min_rtt", "epoch_end", "epoch_losses", "delay_until", "delay_min", "delay_samples", \
    "losses_seen", "since_loss", "recent_rtt", "resend_wait", "resend_dev", "losses", "max_size"

static int win_load(Stream *s) {
    PyObject *state = PyObject_CallMethod(s->window, "state", NULL);
    if (state == NULL)
        return -1;
    Win *w = &s->w;
    PyObject *srtt;
    int ok = PyArg_ParseTuple(state, "dddddOddddddddllldddll;Window.state() must give a protocol.WindowState",
                              &w->cwnd, &w->ssthresh, &w->min_rto, &w->max_rto, &w->rto, &srtt, &w->rttvar,
                              &w->recovery_until, &w->cwnd_before_loss, &w->min_rtt, &w->epoch_end,
                              &w->epoch_losses, &w->delay_until, &w->delay_min, &w->delay_samples,
                              &w->losses_seen, &w->since_loss, &w->recent_rtt, &w->resend_wait, &w->resend_dev, &w->losses, &w->max_size);
    if (ok) {
        w->has_srtt = srtt != Py_None;
        w->srtt = w->has_srtt ? PyFloat_AsDouble(srtt) : 0.0;
    }
    Py_DECREF(state);
    return ok && !PyErr_Occurred() ? 0 : -1;
}

static int win_store(Stream *s) {
    const Win *w = &s->w;
    PyObject *srtt = w->has_srtt ? PyFloat_FromDouble(w->srtt) : Py_NewRef(Py_None);
    PyObject *state = srtt ? Py_BuildValue("(dddddNddddddddllldddll)", w->cwnd, w->ssthresh, w->min_rto, w->max_rto,
                                           w->rto, srtt, w->rttvar, w->recovery_until, w->cwnd_before_loss,
                                           w->min_rtt, w->epoch_end, w->epoch_losses, w->delay_until, w->delay_min,
                                           w->delay_samples, w->losses_seen, w->since_loss, w->recent_rtt, w->resend_wait, w->resend_dev,
                                           w->losses, w->max_size) : NULL;
    if (state == NULL)
        return -1;
    PyObject *rc = PyObject_CallMethod(s->window, "restore", "(N)", state);
    Py_XDECREF(rc);
    return rc == NULL ? -1 : 0;
}

/* The window goes back into the Python Window, where it changed since it last did. */
static int hand_back(Stream *s) {
    if (!s->window_changed)
        return 0;
    if (win_store(s) < 0)
        return -1;
    s->window_changed = 0;
    return 0;
}

static int call_over(const Stream *s) { return s->n_done == s->total || s->mismatch; }

static inline double dmin(double a, double b) { return b < a ? b : a; }  /* Python's min(a, b) */
static inline double dmax(double a, double b) { return b > a ? b : a; }  /* Python's max(a, b) */

static long win_size(const Win *w) {
    long size = (long)w->cwnd;
    return size > 1 ? size : 1;
}

/* Window.on_results: `count` results of packets sent once, taken together at `now` (a receive batch) */
static void win_on_results(Win *w, double now, long count, double longest, double shortest, long settled,
                           double settled_shortest) {
    if (longest >= 0) {  /* a round trip of the path among them (-inf: none, they waited for a recovery) */
        if (!w->has_srtt) {
            w->srtt = longest;
            w->rttvar = longest / 2;
            w->has_srtt = 1;
        } else {
            w->rttvar = 0.75 * w->rttvar + 0.25 * fabs(w->srtt - longest);
            w->srtt = 0.875 * w->srtt + 0.125 * longest;
        }
        w->min_rtt = dmin(w->min_rtt, shortest);
        w->rto = dmin(w->max_rto, dmax(w->min_rto, w->srtt + dmax(4 * w->rttvar, w->srtt / 2)));
    }
    w->since_loss = w->since_loss + count < LOSSY_RESULTS ? w->since_loss + count : LOSSY_RESULTS;
    if (settled) {
        if (!w->delay_samples)  /* a round trip's results, from the first on */
            w->delay_until = now + 2 * dmin(settled_shortest, w->recent_rtt);
        w->delay_min = dmin(w->delay_min, settled_shortest);
        w->delay_samples += settled;
        if (w->delay_samples >= DELAY_SAMPLES && now >= w->delay_until) {
            double low = w->delay_min;
            w->recent_rtt = low < w->recent_rtt ? low : 0.875 * w->recent_rtt + 0.125 * low;
            long lost = w->losses - w->losses_seen;  /* the queue it stands: less, the more it loses */
            double stood = lost ? dmin(QUEUE_LIMIT, LOSS_QUEUE * (double)(lost + w->delay_samples) / (double)lost)
                                : QUEUE_LIMIT;
            w->delay_min = INFINITY;
            w->delay_samples = 0;
            w->losses_seen = w->losses;
            double queue = low - w->min_rtt - stood;
            if (queue > 0) {
                w->cwnd = dmax(1.0, w->cwnd * dmax(0.5, 1 - DELAY_BETA * queue / low));
                w->ssthresh = w->cwnd;
                return;
            }
        }
    }
    if (w->cwnd < w->ssthresh) {  /* +1 a result in slow start, up to ssthresh, and 1/cwnd a result after */
        double room = ceil(w->ssthresh - w->cwnd);
        long steps = room < (double)count ? (long)room : count;
        w->cwnd += (double)steps;
        count -= steps;
    }
    if (count)
        w->cwnd += (double)count / w->cwnd;
    w->cwnd = dmin((double)w->max_size, w->cwnd);
}

/* Window.on_result: one result's round trip */
static void win_on_result(Win *w, double rtt, double now, int settled) {
    win_on_results(w, now, 1, rtt, rtt, settled != 0, rtt);
}

static void win_on_timeout(Win *w, double now) {
    w->losses += 1;
    w->since_loss = 0;
    if (now >= w->epoch_end) {
        w->epoch_end = now + (w->has_srtt && w->srtt != 0.0 ? w->srtt : w->rto);
        w->epoch_losses = 0;
    }
    w->epoch_losses += 1;
    if (now < w->recovery_until || w->epoch_losses <= dmax(2.0, w->cwnd * LOSS_SHARE))
        return;
    w->cwnd_before_loss = w->cwnd;
    w->ssthresh = dmax(1.0, w->cwnd / 2);
    w->cwnd = w->ssthresh;
    w->recovery_until = now + w->rto;  /* the packets out now time out within an RTO: this cut answers them all */
}

static double probe_timeout(const Win *w);

/* Window.on_resend_result */
static void win_on_resend_result(Win *w, double wait) {
    wait = dmin(wait, 2 * (w->resend_wait == INFINITY ? probe_timeout(w) : w->resend_wait));
    if (w->resend_wait == INFINITY) {
        w->resend_wait = wait;
        w->resend_dev = wait / 2;
        return;
    }
    w->resend_dev = 0.75 * w->resend_dev + 0.25 * fabs(w->resend_wait - wait);
    w->resend_wait = 0.875 * w->resend_wait + 0.125 * wait;
}

/* Window.probe_timeout */
static double probe_timeout(const Win *w) {
    double rtt = w->recent_rtt < INFINITY ? w->recent_rtt : w->min_rtt < INFINITY ? w->min_rtt : 0.0;
    return dmax(w->since_loss < LOSSY_RESULTS ? MIN_PROBE_LOSSY : MIN_PROBE, 2 * rtt);
}

/* Window.resend_timeout */
static double resend_timeout(const Win *w) {
    if (w->resend_wait == INFINITY)
        return probe_timeout(w);
    double floor = dmax(MIN_RESEND, w->recent_rtt < INFINITY ? w->recent_rtt : 0.0);
    return dmax(floor, w->resend_wait + RESEND_DEVIATIONS * w->resend_dev);
}

/* Window.tail_timeout */
static double tail_timeout(const Win *w) {
    return dmax(MIN_RESEND, TAIL_RTTS * w->min_rtt);
}

static void win_undo(Win *w) {
    w->cwnd = dmax(w->cwnd, w->cwnd_before_loss);
    w->ssthresh = dmax(w->ssthresh, w->cwnd_before_loss);
}

static double win_timeout_for(const Win *w, long retries) { return dmin(w->max_rto, w->rto * ldexp(1.0, (int)retries)); }

/* ---- the schedule (Reduction._prev, _slot_copy) ----------------------------------------------- */

static Py_ssize_t prev_of(const Stream *s, Py_ssize_t t) {
    if (t < s->rounds)
        return -1;
    Py_ssize_t d = t - s->rounds;
    if (d < s->slots)
        return s->rounds ? d : -1;
    return t - s->slots;
}

static int exponent_used(const Stream *s, Py_ssize_t t) {
    Py_ssize_t prev = prev_of(s, t);
    return prev < 0 ? EXP_NONE : s->entries[prev].agreed;
}

static int shift_for(const Stream *s, int exponent) {  /* codec.scale_shift */
    return 31 - (exponent == EXP_NONE ? MIN_EXPONENT : exponent) - s->log2n;
}

/* The rank that receives entry t's sum whole (Reduction._owner): a reduce-scatter's data chunk's
 * owner; -1 where every rank does (the call round, an allreduce). */
static int owner_of(const Stream *s, Py_ssize_t t) {
    return !s->scatter || t < s->rounds ? -1 : (int)((t - s->rounds) / s->per_shard);
}

/* Data chunk d's values in x (calls.Layout.source): *n of them from the returned index. */
static inline Py_ssize_t source_of(const Stream *s, Py_ssize_t d, Py_ssize_t *n) {
    if (s->scatter) {
        Py_ssize_t owner = d / s->per_shard, at = (d - owner * s->per_shard) * s->k;
        *n = s->shard - at < s->k ? s->shard - at : s->k;
        return owner * s->shard + at;
    }
    Py_ssize_t start = d * s->k;
    *n = s->numel - start < s->k ? s->numel - start : s->k;
    return start;
}

/* Where its sums go in out (calls.Layout.target): an allreduce's where they came from, a reduce-scatter's
 * at the chunk's place in the shard. */
static inline Py_ssize_t target_of(const Stream *s, Py_ssize_t d, Py_ssize_t *n) {
    if (!s->scatter)
        return source_of(s, d, n);
    Py_ssize_t start = d % s->per_shard * s->k;
    *n = s->shard - start < s->k ? s->shard - start : s->k;
    return start;
}

/* ---- sending (Reduction._send, _fill, and the client's packing of the outbox) ----------------- */

/* An array of *cap items of `size` bytes with twice the room (64 at first); NULL, nothing changed,
 * when out of memory. */
static void *grow(void *items, Py_ssize_t *cap, size_t size) {
    Py_ssize_t more = *cap ? 2 * *cap : 64;
    void *grown = realloc(items, (size_t)more * size);
    if (grown != NULL)
        *cap = more;
    return grown;
}

/* Timers are a doubly linked list in firing order rather than a heap: a packet's timer is set when it
 * is sent, at now + the timeout, so it nearly always belongs at the end (found from the end in a
 * step or two), and a result takes it out in one step wherever it is. A heap costs a dozen
 * unpredictable steps for each, per packet, which at K = 64 was a fifth of a worker's CPU. */
static inline int timer_before(const Entry *e, Py_ssize_t a, Py_ssize_t b) {  /* (deadline, t) order */
    if (e[a].deadline != e[b].deadline)
        return e[a].deadline < e[b].deadline;
    return a < b;  /* one timer per entry, so t decides */
}

/* Put t after entry `after` (NONE: at the head) in list `which`. */
static inline void list_insert(Entry *e, List *l, int which, Py_ssize_t t, uint32_t after) {
    uint32_t before = after != NONE ? e[after].link[which][NEXT] : l->head;
    e[t].link[which][PREV] = after;
    e[t].link[which][NEXT] = before;
    if (after != NONE)
        e[after].link[which][NEXT] = (uint32_t)t;
    else
        l->head = (uint32_t)t;
    if (before != NONE)
        e[before].link[which][PREV] = (uint32_t)t;
    else
        l->tail = (uint32_t)t;
}

static inline void list_remove(Entry *e, List *l, int which, Py_ssize_t t) {
    uint32_t a = e[t].link[which][PREV], b = e[t].link[which][NEXT];
    if (a != NONE)
        e[a].link[which][NEXT] = b;
    else
        l->head = b;
    if (b != NONE)
        e[b].link[which][PREV] = a;
    else
        l->tail = a;
}

static void timer_set(Stream *s, Py_ssize_t t, double deadline) {
    Entry *e = s->entries;
    e[t].deadline = deadline;
    uint32_t after = s->timers.tail;
    while (after != NONE && timer_before(e, t, after))
        after = e[after].link[TIMERS][PREV];
    list_insert(e, &s->timers, TIMERS, t, after);
}

/* A packet's timer moved to `deadline` (Reduction._move_timer): out of the timers and back in at its place. */
static void timer_move(Stream *s, Py_ssize_t t, double deadline) {
    list_remove(s->entries, &s->timers, TIMERS, t);
    timer_set(s, t, deadline);
}

/* A packet leaves flight (its result came) or is resent: out of both lists. */
static inline void unlist(Stream *s, Py_ssize_t t) {
    list_remove(s->entries, &s->timers, TIMERS, t);
    list_remove(s->entries, &s->sends, SENDS, t);
}

/* Why a packet is resent (protocol.LOST, PROBE, TIMEOUT), and what was last sent of an entry in flight
 * (protocol.SENT, ASKED, WAITING). */
enum { LOST, PROBE, TIMEOUT };
enum { SENT, ASKED, WAITING };

/* Window.queued_rtt: a round trip as the path's are now, queue and all (0 before any). */
static inline double queued_rtt(const Win *w) {
    return w->has_srtt ? w->srtt + 4 * w->rttvar : 0.0;
}

/* Reduction._resend_wait: how long a packet sent (or asked about) `retries` times again waits. */
static double resend_wait(const Stream *s, long retries) {
    long backoff = retries - 1;
    double wait = resend_timeout(&s->w);
    if (s->n_in_flight <= EARLY_PROBE) {  /* the call's tail: the queue it learned from has drained */
        wait = dmin(wait, tail_timeout(&s->w));
        if (s->n_done)  /* and the second resend waits no longer than the first */
            backoff = backoff > 0 ? backoff - 1 : 0;
    }
    if (s->n_done && backoff > BACKOFF_CAP)
        backoff = BACKOFF_CAP;
    return dmin(s->w.max_rto, wait * ldexp(1.0, (int)backoff));
}

/* Room in the outbox for `more` entries after those in it; -1 when out of memory. */
static int reserve(Stream *s, Py_ssize_t more) {
    if (s->out_head + s->out_len + more <= s->out_cap)
        return 0;
    if (s->out_head) {
        memmove(s->outbox, s->outbox + s->out_head, (size_t)s->out_len * sizeof(Py_ssize_t));
        s->out_head = 0;
    }
    while (s->out_len + more > s->out_cap) {
        Py_ssize_t *grown = grow(s->outbox, &s->out_cap, sizeof(Py_ssize_t));
        if (grown == NULL)
            return -1;
        s->outbox = grown;
    }
    return 0;
}

/* Entry t (~t: a QUERY about t) onto the end of the outbox; -1 when out of memory. */
static inline int post(Stream *s, Py_ssize_t item) {
    if (reserve(s, 1) < 0)
        return -1;
    s->outbox[s->out_head + s->out_len++] = item;
    return 0;
}

/* Reduction._send of an entry sent before (retries >= 1: fill() sends each entry's first): its
 * contribution again (SENT) or a QUERY about it (ASKED); `posted` 0: as if sent, for an entry that waits
 * on the QUERY of another of its run. */
static int send_entry(Stream *s, Py_ssize_t t, double now, long retries, int state, int posted) {
    if (posted && post(s, state == ASKED ? ~t : t) < 0)
        return -1;
    Entry *e = &s->entries[t];
    if (!e->in_flight) {
        e->in_flight = 1;
        s->n_in_flight++;
    }
    if (!e->retries)  /* its first resend: last_send is still its first send's */
        s->resends[t].first_send = e->last_send;
    if (retries == 1)  /* its first resend (or query); a PENDING's answer may send it again at 1 */
        s->resends[t].resent_at = now;
    e->state = (uint8_t)state;
    e->last_send = now;
    e->order = s->n_sends++;
    e->retries = retries;
    timer_set(s, t, now + (s->started ? resend_wait(s, retries) : win_timeout_for(&s->w, retries)));
    list_insert(s->entries, &s->sends, SENDS, t, s->sends.tail);
    return 0;
}

/* How many entries ahead fill() asks for an entry's line, owned (sa_prefetch): the entries it starts are a
 * window ahead of those just answered, so their lines were last written a call ago and come from memory,
 * and each of fill's first stores to one waited on its read for ownership (a third of fill's time at
 * K = 64; asked for 32-64 entries ahead, the decode through the stream ran 8% faster, alternated). */
#define FILL_AHEAD 48

/* Reduction._fill: each entry's first send, in schedule order, while the window and the schedule allow.
 * It runs once a receive batch over what the batch's results let go, so what it changes of the stream
 * is kept in locals and stored once at the end: an entry's byte-wide fields are stored through a type
 * that may alias anything, which made the compiler load and store every counter again for each entry. */
static int fill(Stream *s, double now) {
    if (s->mismatch)
        return 0;
    /* what no send changes: how far the schedule may go, the window, and a first send's timer (every
     * one the same: the timeout of no retries, from now) */
    Py_ssize_t end = s->rounds + s->prepared < s->total ? s->rounds + s->prepared : s->total;
    Py_ssize_t next = s->next, in_flight = s->n_in_flight, window = win_size(&s->w);
    if (next >= end || in_flight >= window)
        return 0;
    if (reserve(s, end - next < window - in_flight ? end - next : window - in_flight) < 0)
        return -1;
    double deadline = now + win_timeout_for(&s->w, 0);
    Entry *entries = s->entries;
    const uint8_t *copy0 = s->copy0;
    const Py_ssize_t rounds = s->rounds, slots = s->slots, unseen = s->unseen;
    Py_ssize_t *outbox = s->outbox + s->out_head + s->out_len, posted = 0;
    Py_ssize_t walk_slot = s->walk_slot, walk_round = s->walk_round, sends = s->n_sends;
    List timers = s->timers, sent = s->sends;
    uint32_t fill_last = s->fill_last;
    for (; next < end && in_flight < window; next++) {
        Py_ssize_t t = next, prev = prev_of(s, t);
        if ((prev >= 0 && !entries[prev].done) || (t >= rounds && unseen))  /* data waits for every part */
            break;
        outbox[posted++] = t;
        if (t + FILL_AHEAD < end)
            sa_prefetch(&entries[t + FILL_AHEAD], sizeof *entries, 1);
        Entry *e = &entries[t];
        /* its slot and shadow copy (Reduction._slot_copy): data chunk d goes on slot d % slots, and each use
         * of a slot flips its copy; the schedule is walked in order, so the division is a running slot
         * and round */
        if (t < rounds) {
            e->slot = (uint16_t)t;
            e->copy = copy0[t] & 1;
        } else {
            e->slot = (uint16_t)walk_slot;
            e->copy = (uint8_t)((copy0[walk_slot] + walk_round + (walk_slot < rounds)) & 1);
            if (++walk_slot == slots) {
                walk_slot = 0;
                walk_round++;
            }
        }
        e->used = (int8_t)(prev < 0 ? EXP_NONE : entries[prev].agreed);
        e->done = 0;  /* the arena's memory holds an earlier call's: t starts here */
        e->in_flight = 1;
        e->state = SENT;
        e->last_send = now;
        e->order = sends++;
        e->retries = 0;
        in_flight++;
        /* timer_set, for an entry after every other: (deadline, t) order is the deadline's alone. Its
         * place is nearly always the end. Where it is not (the RTO fell since the timers at the end were
         * set: a call's first results, whose new timers go before the whole first window's), the list
         * is in that order, so the place is the same sought from anywhere in it: from the entry fill()
         * timed last, where that is still out and before t, rather than back past every later one. */
        e->deadline = deadline;
        uint32_t after = timers.tail, from = fill_last, later;
        if (after != NONE && deadline < entries[after].deadline) {
            if (from != NONE && entries[from].in_flight && deadline >= entries[from].deadline) {
                for (after = from; (later = entries[after].link[TIMERS][NEXT]) != NONE
                                   && entries[later].deadline <= deadline;)
                    after = later;
            } else {
                while (after != NONE && deadline < entries[after].deadline)
                    after = entries[after].link[TIMERS][PREV];
            }
        }
        list_insert(entries, &timers, TIMERS, t, after);
        fill_last = (uint32_t)t;
        list_insert(entries, &sent, SENDS, t, sent.tail);
    }
    s->next = next;
    s->n_in_flight = in_flight;
    s->out_len += posted;
    s->walk_slot = walk_slot;
    s->walk_round = walk_round;
    s->n_sends = sends;
    s->timers = timers;
    s->sends = sent;
    s->fill_last = fill_last;
    return 0;
}

/* Entry t's header: a CONTRIB proposing `proposal` with K values (a reduce-scatter's data chunk
 * marked with its owner), or a QUERY (no values, no owner). The fields every packet of the call has
 * alike come from s->header, in three stores rather than a dozen. */
static inline void write_header(const Stream *s, Py_ssize_t t, unsigned char *row, int type, int proposal) {
    const Entry *e = &s->entries[t];
    memcpy(row, s->header, HEADER_SIZE);
    row[OFF_FLAGS] = e->copy;
    put16(row + OFF_SLOT, e->slot);
    put32(row + OFF_CHUNK, (uint32_t)(s->first_id + (uint32_t)t));
    row[OFF_EXPONENT] = (unsigned char)(int8_t)proposal;
    if (type == TYPE_QUERY) {
        row[OFF_TYPE] = TYPE_QUERY;
        put16(row + OFF_COUNT, 0);
    } else if (s->scatter && t >= s->rounds) {  /* an allreduce pays one test */
        row[OFF_FLAGS] |= FLAG_OWNER;
        row[OFF_OWNER] = (unsigned char)owner_of(s, t);
    }
}

/* How many chunks ahead of its use the stream asks for a chunk's cache lines (sa_prefetch): far
 * enough to cover a read from memory at a few tens of nanoseconds a packet, near enough to stay in L1/L2. */
#define PREFETCH_CHUNKS 8

/* Data chunk c's proposed exponent. Where the caller gave none (proposals=True) the stream makes
 * each one as the schedule first asks for it, which is in chunk order: chunk c < S in the call
 * round, chunk c >= S with data chunk c - S (write_packet, in the same loop as c - S's quantization),
 * S packets before c is itself quantized. So the read for c's max-abs leaves it in the cache that
 * its quantization reads it from (S chunks: 256 KiB in flight by default), and the input comes from
 * memory once, not in a pass of its own before the call and again as it is sent. A resend asks
 * again and gets the same. */
static int proposal_of(Stream *s, Py_ssize_t c) {
    for (; s->proposed <= c; s->proposed++) {
        Py_ssize_t n, start = source_of(s, s->proposed, &n);
        s->proposals[s->proposed] = (int8_t)sa_propose((const float *)s->x.buf + start, n);
    }
    return s->proposals[c];
}

/* Ask for chunk c's input ahead of its max-abs (the hardware's prefetcher, which stops at each 4 KiB
 * page, leaves a read from memory every 16 chunks otherwise). */
static void prefetch_source(const Stream *s, Py_ssize_t c) {
    if (c < s->n_chunks) {
        Py_ssize_t n, start = source_of(s, c, &n);
        sa_prefetch((const float *)s->x.buf + start, 4 * n, 0);
    }
}

static void write_packet(Stream *s, Py_ssize_t t, unsigned char *row) {
    unsigned char *values = row + HEADER_SIZE;
    if (t < s->rounds) {  /* the call round carries the descriptors and the first chunks' proposals */
        write_header(s, t, row, TYPE_CONTRIB, s->floats && t < s->n_chunks ? proposal_of(s, t) : EXP_NONE);
        if (s->floats && s->proposed == t + 1)
            prefetch_source(s, t + PREFETCH_CHUNKS);
        memcpy(values, s->call_row + 4 * (size_t)s->k * (size_t)(t % s->parts), 4 * (size_t)s->k);
        return;
    }
    Py_ssize_t c = t - s->rounds + s->slots;  /* the chunk whose exponent this one proposes */
    if (s->staged) {  /* quantized by the caller: its row as it is, with the proposal */
        const int32_t *q = (const int32_t *)s->x.buf + (t - s->rounds) * s->k;
        for (Py_ssize_t i = 0; i < s->k; i++)
            put32(values + 4 * i, (uint32_t)q[i]);
        write_header(s, t, row, TYPE_CONTRIB, c < s->n_chunks ? s->proposals[c] : EXP_NONE);
        return;
    }
    Py_ssize_t n, start = source_of(s, t - s->rounds, &n);
    int proposal = EXP_NONE;
    if (s->floats) {
        const float *x = (const float *)s->x.buf + start;
        int e = s->entries[t].used;
        if (c < s->n_chunks && c == s->proposed) {  /* c's first proposal: its max-abs read beside x's */
            prefetch_source(s, c + PREFETCH_CHUNKS);
            Py_ssize_t n_next, next = source_of(s, c, &n_next);
            if (e == EXP_NONFINITE) {  /* some rank's chunk held NaN or infinity: class codes, not values */
                sa_encode_nonfinite(x, values, n, s->k);
                proposal = sa_propose((const float *)s->x.buf + next, n_next);
            } else {
                proposal = sa_quantize_propose(x, values, n, s->k, shift_for(s, e), (const float *)s->x.buf + next,
                                               n_next);
            }
            s->proposals[c] = (int8_t)proposal;
            s->proposed++;
        } else {  /* proposed before: by the caller (from memory: ask ahead), or in a send S before */
            prefetch_source(s, t - s->rounds + PREFETCH_CHUNKS);
            if (e == EXP_NONFINITE)
                sa_encode_nonfinite(x, values, n, s->k);
            else
                sa_quantize(x, values, n, s->k, shift_for(s, e));
            if (c < s->n_chunks)
                proposal = proposal_of(s, c);
        }
    } else {
        const int32_t *x = (const int32_t *)s->x.buf + start;
        for (Py_ssize_t i = 0; i < n; i++)
            put32(values + 4 * i, (uint32_t)x[i]);
        memset(values + 4 * n, 0, 4 * (size_t)(s->k - n));
    }
    write_header(s, t, row, TYPE_CONTRIB, proposal);
}

PyDoc_STRVAR(emit_doc,
"emit(rows, lengths) -> int\n\n"
"Write the packets due, oldest first, into the rows of ``rows`` (a writable 2-D uint8 array with\n"
"rows of at least 24 + 4 K bytes), one packet per row, as many as fit, and each one's length into\n"
"``lengths`` (uint32): 24 for a QUERY, 24 + 4 K for a contribution; returns how many.");

static PyObject *Stream_emit(Stream *s, PyObject *args) {
    PyObject *rows_obj, *lengths_obj;
    Py_buffer rows, lengths;
    if (unready(s) || !PyArg_ParseTuple(args, "OO", &rows_obj, &lengths_obj)
            || PyObject_GetBuffer(rows_obj, &rows, PyBUF_WRITABLE | PyBUF_ND) < 0)
        return NULL;
    if (PyObject_GetBuffer(lengths_obj, &lengths, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (rows.ndim != 2 || rows.itemsize != 1 || rows.shape[1] < HEADER_SIZE + 4 * s->k || lengths.itemsize != 4
            || lengths.format == NULL || (lengths.format[0] != 'I' && lengths.format[0] != 'L')) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&lengths);
        return PyErr_Format(PyExc_ValueError, "emit: rows must be a 2-D array of rows of at least %zd bytes, "
                            "lengths a uint32 array", HEADER_SIZE + 4 * s->k);
    }
    Py_ssize_t n = s->out_len < rows.shape[0] ? s->out_len : rows.shape[0];
    n = n < lengths.len / 4 ? n : lengths.len / 4;
    uint32_t *length = lengths.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t t = s->outbox[s->out_head + i];
        unsigned char *row = (unsigned char *)rows.buf + i * rows.shape[1];
        if (t < 0)
            write_header(s, ~t, row, TYPE_QUERY, EXP_NONE);
        else
            write_packet(s, t, row);
        length[i] = (uint32_t)(t < 0 ? HEADER_SIZE : HEADER_SIZE + 4 * s->k);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&lengths);
    s->out_head += n;
    s->out_len -= n;
    if (!s->out_len)
        s->out_head = 0;
    PyBuffer_Release(&rows);
    return PyLong_FromSsize_t(n);
}

/* ---- receiving (Reduction._receive, and the client's checks before it) ------------------------- */

/* A PENDING, the answer to a QUERY (Reduction._receive_pending): the contribution goes again when this
 * worker's bit is clear or every bit is set; else a peer's is missing and t waits as if sent now.
 * Returns 0, or -1 when out of memory. */
static int receive_pending(Stream *s, const unsigned char *p, double now) {
    if (p[OFF_WORKER] != s->worker || get16(p + OFF_JOB) != s->job || get32(p + OFF_GENERATION) != s->generation
            || get16(p + OFF_COUNT) != 0) {
        s->foreign++;  /* not this run's */
        return 0;
    }
    Py_ssize_t t = (Py_ssize_t)(uint32_t)(get32(p + OFF_CHUNK) - s->first_id);
    if (t >= s->next)
        return 0;
    Entry *e = &s->entries[t];
    if (!e->in_flight || e->state != ASKED || get16(p + OFF_SLOT) != e->slot || (p[OFF_FLAGS] & FLAG_COPY) != e->copy)
        return 0;  /* not the answer it waits for */
    uint32_t bitmap = get32(p + OFF_KEY);
    long retries = e->retries;
    if (!(bitmap >> s->worker & 1) || bitmap == s->all) {
        /* lost, and so is what went with it: its run (the packets waiting on this QUERY) and the packets
         * sent once no later than its first send go too (Reduction._receive_pending) */
        double first_send = s->resends[t].first_send;
        unlist(s, t);
        s->retransmissions++;
        if (send_entry(s, t, now, retries, SENT, 1) < 0)
            return -1;
        Entry *entries = s->entries;
        for (uint32_t u = s->sends.head, next; u != NONE; u = next) {
            next = entries[u].link[SENDS][NEXT];  /* u moves to the end, as a resend, where it is not taken again */
            int run = entries[u].state == ASKED && entries[u].retries && s->resends[u].first_send == first_send;
            if (!run && (entries[u].retries || entries[u].last_send > first_send))
                continue;
            long again = entries[u].retries ? entries[u].retries : 1;
            unlist(s, u);
            s->retransmissions++;
            if (send_entry(s, u, now, again, SENT, 1) < 0)
                return -1;
        }
        return 0;
    }
    /* as if sent now: the peer resends now, so what is sent after now reveals a loss (RACK) */
    e->state = WAITING;
    s->bursting = 0;  /* a peer is late, not this worker's path losing runs: its probes burst no more */
    unlist(s, t);
    e->last_send = now;
    e->order = s->n_sends++;
    /* before the job answered, as a resend waits then: the RTO, backing off (peers may be starting) */
    timer_set(s, t, now + (s->started ? resend_wait(s, retries) : win_timeout_for(&s->w, retries)));
    list_insert(s->entries, &s->sends, SENDS, t, s->sends.tail);
    return 0;
}

/* Reduction._cap_tail: with at most EARLY_PROBE packets out, a packet resent (or asked about) before
 * waits no longer from its last send than resend_wait's tail rule allows now. */
static void cap_tail(Stream *s) {
    Entry *e = s->entries;
    for (uint32_t u = s->sends.head; u != NONE; u = e[u].link[SENDS][NEXT]) {
        if (!e[u].retries)
            continue;
        double due = e[u].last_send + resend_wait(s, e[u].retries);
        if (due < e[u].deadline)
            timer_move(s, u, due);
    }
}

/* Whether a RESULT of entry t carries what it must besides its ids (Reduction._shape): no owner and
 * K values where every rank receives the sum; a reduce-scatter's chunk's owner, and K values where this
 * rank owns it, none (a header) where another rank does. */
static inline int result_fits(const Stream *s, const unsigned char *p, Py_ssize_t t) {
    uint32_t owner_count = get32(p + OFF_EXPONENT) & 0xFFFFFF;  /* the owner byte, then the count */
    int owner = owner_of(s, t);
    if (owner < 0)
        return !(p[OFF_FLAGS] & FLAG_OWNER) && owner_count == (uint32_t)s->k;
    return (p[OFF_FLAGS] & FLAG_OWNER)
           && owner_count == ((uint32_t)owner << 16 | ((unsigned int)owner == s->rank ? (uint32_t)s->k : 0));
}

/* Whether header p carries this call's worker, job, generation and key: two loads against the call's
 * own header (s->header) rather than a field at a time. */
static inline int ids_match(const Stream *s, const unsigned char *p) {
    uint32_t worker_job;
    uint64_t generation_key;
    memcpy(&worker_job, p + OFF_FLAGS, 4);
    memcpy(&generation_key, p + OFF_GENERATION, 8);
    return (worker_job & s->ids_mask) == s->worker_job && generation_key == s->generation_key;
}

/* A result's sums (values p[0, 4 K)) of data entry t into out. */
static void take_sums(Stream *s, const unsigned char *p, Py_ssize_t t) {
    Py_ssize_t d = t - s->rounds, n, start = target_of(s, d, &n);
    if (s->staged) {  /* the caller dequantizes: the row as it came (its own, of a reduce-scatter's shard) */
        int32_t *out = (int32_t *)s->out.buf + (s->scatter ? d % s->per_shard : d) * s->k;
        for (Py_ssize_t i = 0; i < s->k; i++)
            out[i] = (int32_t)get32(p + 4 * i);
    } else if (s->floats) {
        int exponent = s->entries[t].used;
        if (exponent == EXP_NONFINITE)
            sa_decode_nonfinite(p, (float *)s->out.buf + start, n);
        else  /* past the cache: out is read only after the call, so its lines need not be read first */
            sa_dequantize_past_cache(p, (float *)s->out.buf + start, n, shift_for(s, exponent));
    } else {
        int32_t *out = (int32_t *)s->out.buf + start;
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (int32_t)get32(p + 4 * i);
    }
}

/* Call-round entry t's sum (values p[0, 4 K)): its part's (Reduction._take_call_round). */
static void take_call_round(Stream *s, const unsigned char *p, Py_ssize_t t) {
    if (s->mismatch)
        return;
    Py_ssize_t part = t % s->parts;
    size_t size = 4 * (size_t)s->k, at = size * (size_t)part;
    memcpy(s->gathered + at, p, size);
    s->differs |= memcmp(p, s->expect + at, size) != 0;
    if (s->seen[part]) {
        s->seen[part] = 0;
        s->unseen--;
    }
    s->mismatch = s->differs && !s->unseen;
}

/* One datagram; returns 1 when it was a new result, 0 when ignored, -1 when out of memory. */
static int receive_one(Stream *s, const unsigned char *p, Py_ssize_t length, double now) {
    if (length == HEADER_SIZE && p[OFF_TYPE] == TYPE_PENDING)
        return receive_pending(s, p, now);
    if (length < HEADER_SIZE || p[OFF_TYPE] != TYPE_RESULT
            || length != HEADER_SIZE + 4 * (Py_ssize_t)get16(p + OFF_COUNT) || !ids_match(s, p)) {
        s->foreign++;  /* too short, another type, lengths that disagree, or another run's */
        return 0;
    }
    Py_ssize_t t = (Py_ssize_t)(uint32_t)(get32(p + OFF_CHUNK) - s->first_id);
    if (t >= s->next || !s->entries[t].in_flight)
        return 0;  /* a duplicate, or a stale result */
    Entry *e = &s->entries[t];
    if (get16(p + OFF_SLOT) != e->slot || (p[OFF_FLAGS] & FLAG_COPY) != e->copy)
        return 0;
    if (!result_fits(s, p, t)) {  /* a switch's error: counted, never decoded; the packet stays out */
        s->protocol_errors++;
        return 0;
    }
    e->in_flight = 0;
    s->n_in_flight--;
    unlist(s, t);
    e->done = 1;
    s->n_done++;
    e->agreed = (int8_t)p[OFF_EXPONENT];
    s->marked |= e->agreed == EXP_NONFINITE;
    if (t < s->rounds) {
        take_call_round(s, p + HEADER_SIZE, t);
    } else if (get16(p + OFF_COUNT)) {  /* a sum this rank receives (a reduce-scatter's others: a header) */
        take_sums(s, p + HEADER_SIZE, t);
    }
    double sent = e->last_send;
    if (e->retries == 0) {  /* the window learns once the batch is in (end_batch) */
        double rtt = now - sent;
        s->taken++;
        /* a round trip of the path only where it waited for no recovery (Reduction._receive) */
        if (e->order >= s->quiet_from && (e->order > s->rack_order || rtt <= s->rack_rtt + s->w.min_rtt / 4)) {
            s->longest = dmax(s->longest, rtt);
            s->shortest = dmin(s->shortest, rtt);
            if (sent >= s->first_result) {
                s->settled++;
                s->settled_shortest = dmin(s->settled_shortest, rtt);
            }
        }
        if (e->order > s->rack_order) {
            s->rack_order = e->order;
            s->rack_rtt = rtt;
        }
    } else if (e->state != WAITING && !s->probes && now - sent < s->w.min_rtt && s->w.min_rtt < INFINITY) {
        /* spurious: the original's result (not in a probed silence, where it is the switch's held copy's) */
        double first_send = s->resends[t].first_send;
        win_undo(&s->w);
        win_on_result(&s->w, now - first_send, now, first_send >= s->first_result);
    } else {
        if (s->w.min_rtt < INFINITY)  /* ambiguous: no round trip, but how long a resent packet waits */
            win_on_resend_result(&s->w, now - s->resends[t].resent_at);  /* (before any, mostly peers starting) */
        if (e->state == SENT && s->probes && e->order > s->rack_order && s->sends.head != NONE
                && s->w.min_rtt < INFINITY) {
            /* RACK from a resent contribution's result that ends a silence, which gives what is out a
             * probe timeout from now (Reduction._receive) */
            s->rack_order = e->order;
            s->rack_rtt = dmax(now - sent, now - s->entries[s->sends.head].last_send + probe_timeout(&s->w));
            if (s->bursting)  /* on a lossy path, what left with it was lost with it (resend_run) */
                s->run_lost = dmax(s->run_lost, s->resends[t].first_send);
        }
    }
    s->last_progress = s->probe_from = now;
    s->first_result = dmin(s->first_result, now);
    if (s->probes) {  /* a silence ended: what was resent during it need not wait out its backoff */
        double due = now + resend_timeout(&s->w);
        Entry *entries = s->entries;
        for (uint32_t u = s->sends.head; u != NONE; u = entries[u].link[SENDS][NEXT]) {
            if (entries[u].retries && entries[u].deadline > due)
                timer_move(s, u, due);
        }
    }
    s->probes = 0;
    s->stalled = 0;
    s->started = 1;
    return 1;
}

/* Reduction._start_batch: no results yet of the receive batch's packets sent once */
static void start_batch(Stream *s) {
    s->taken = s->settled = 0;
    s->longest = -INFINITY;
    s->shortest = s->settled_shortest = INFINITY;
}

static int resend(Stream *s, Py_ssize_t t, int why, double now);

/* Reduction._resend_run: the packets sent once no later than run_lost (at most RUN_CAP, oldest send first)
 * go again, one loss for the window. Returns -1 when out of memory. */
static int resend_run(Stream *s, double now) {
    double due = s->run_lost;
    s->run_lost = -INFINITY;
    Py_ssize_t n = 0;
    Entry *e = s->entries;
    for (uint32_t u = s->sends.head, next; u != NONE && n < RUN_CAP; u = next) {
        next = e[u].link[SENDS][NEXT];  /* u moves to the end, as a resend, where it is not taken again */
        if (e[u].retries || e[u].last_send > due)
            continue;
        n++;
        if (resend(s, u, LOST, now) < 0)
            return -1;
        e = s->entries;
    }
    if (n) {  /* Window.on_loss */
        s->w.losses++;
        s->w.since_loss = 0;
    }
    return 0;
}

/* Reduction.receive_batch's end: the window learns from the batch's round trips, and (new results in it)
 * is filled. Returns -1 when out of memory. */
static int end_batch(Stream *s, double now, Py_ssize_t fresh) {
    if (s->run_lost > -INFINITY && resend_run(s, now) < 0)
        return -1;
    if (s->taken) {
        win_on_results(&s->w, now, s->taken, s->longest, s->shortest, s->settled, s->settled_shortest);
        start_batch(s);
    }
    if (!fresh)
        return 0;
    if (fill(s, now) < 0)
        return -1;
    if (s->n_in_flight <= EARLY_PROBE)
        cap_tail(s);
    return 0;
}

PyDoc_STRVAR(receive_batch_doc,
"receive_batch(buf, offsets, lengths, now) -> int\n\n"
"Take the datagrams received at ``now``: datagram i is ``lengths[i]`` bytes at ``buf[offsets[i]:]``\n"
"(uint32 arrays). Whatever is not a RESULT for this call is ignored (counted in foreign where it is not this\n"
"run's at all); returns how many were new.");

static PyObject *Stream_receive_batch(Stream *s, PyObject *args) {
    PyObject *buf_obj, *off_obj, *len_obj;
    double now;
    Py_buffer buf, offsets, lengths;
    if (unready(s) || !PyArg_ParseTuple(args, "OOOd", &buf_obj, &off_obj, &len_obj, &now))
        return NULL;
    if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(off_obj, &offsets, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (PyObject_GetBuffer(len_obj, &lengths, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&buf);
        PyBuffer_Release(&offsets);
        return NULL;
    }
    Py_ssize_t count = lengths.len / 4;
    const uint32_t *lens = lengths.buf, *offs = offsets.buf;
    int bad = lengths.len % 4 != 0 || offsets.len < lengths.len;
    for (Py_ssize_t i = 0; i < count && !bad; i++)
        bad = (size_t)offs[i] + lens[i] > (size_t)buf.len;
    if (bad) {
        PyBuffer_Release(&buf);
        PyBuffer_Release(&offsets);
        PyBuffer_Release(&lengths);
        return PyErr_Format(PyExc_ValueError, "receive_batch: %zd datagrams do not lie within %zd bytes, or "
                            "there are fewer offsets than lengths", count, buf.len);
    }
    Py_ssize_t fresh = 0;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && rc >= 0; i++) {
        rc = receive_one(s, (const unsigned char *)buf.buf + offs[i], lens[i], now);
        fresh += rc > 0;
    }
    if (rc >= 0)
        rc = end_batch(s, now, fresh);
    sa_store_fence();  /* the sums written past the cache (take_sums) are seen before what follows */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&lengths);
    if (rc < 0)
        return PyErr_NoMemory();
    s->window_changed |= fresh > 0;
    if (call_over(s) && hand_back(s) < 0)  /* the call's last result: the window goes back */
        return NULL;
    return PyLong_FromSsize_t(fresh);
}

/* ---- time (Reduction.next_deadline, tick) ----------------------------------------------------- */

/* Reduction._run_length: of how many packets (up to RUN_ASK) entry t, sent once and found lost, heads a run:
 * those after it sent once in its batch, at the next orders. */
static Py_ssize_t run_length(const Stream *s, Py_ssize_t t) {
    const Entry *e = s->entries;
    Py_ssize_t n = 1;
    while (n < RUN_ASK && t + n < s->next && e[t + n].in_flight && !e[t + n].retries
           && e[t + n].last_send == e[t].last_send && e[t + n].order == e[t].order + n)
        n++;
    return n;
}

/* Reduction._resend: entry t again (`why`), or a QUERY about it first where the job asks first, unless the
 * switch said this worker's contribution is missing (and a lone worker has no one else to blame); a job that
 * resends without asking asks about a run found lost at once (run_length). */
static int resend(Stream *s, Py_ssize_t t, int why, double now) {
    unlist(s, t);
    const Entry *e = &s->entries[t];
    int ask = s->n_workers > 1 && !(e->retries && e->state == SENT);
    if (ask && why == LOST && !e->retries) {  /* a run found lost at once asks one QUERY (Reduction.tick) */
        if (now == s->run_at && e->last_send == s->run_first)
            return send_entry(s, t, now, 1, ASKED, 0);
        if (s->ask_first || run_length(s, t) >= RUN_ASK) {
            s->run_at = now;
            s->run_first = e->last_send;
        } else {
            ask = 0;
        }
    } else if (!s->ask_first && (why != PROBE || s->bursting)) {  /* a quiet path's probe asks (Reduction._resend) */
        ask = 0;
    }
    if (ask)
        s->queries++;
    else
        s->retransmissions++;
    if (send_entry(s, t, now, e->retries + 1, ask ? ASKED : SENT, 1) < 0)
        return -1;
    if (ask && why == PROBE) {  /* a probe's QUERY waits a round trip through the queue (Reduction._resend) */
        double due = now + queued_rtt(&s->w);
        if (due > s->entries[t].deadline)
            timer_move(s, t, due);
    }
    return 0;
}

/* Reduction._probe_burst, sent: the first probe of a lossy silence is `t` and every packet out resent
 * before; each after it 4 ** probes packets (at most 4 ** BURST_STEPS and the window's max_size), oldest
 * send first, each packet as often as it takes where fewer are out. */
static int probe_burst(Stream *s, Py_ssize_t t, double now) {
    Py_ssize_t n = 0, count = 1;
    long copies = 1;
    uint32_t *burst = PyMem_Malloc(sizeof(uint32_t) * (size_t)(s->n_in_flight ? s->n_in_flight : 1));
    if (burst == NULL)
        return -1;
    const Entry *e = s->entries;
    if (!s->probes) {
        burst[n++] = (uint32_t)t;
        double due = now - probe_timeout(&s->w);
        for (uint32_t u = s->sends.head; u != NONE; u = e[u].link[SENDS][NEXT])
            if (e[u].retries && e[u].last_send <= due && (Py_ssize_t)u != t)
                burst[n++] = u;
    } else {
        count = (Py_ssize_t)1 << (2 * (s->probes < BURST_STEPS ? s->probes : BURST_STEPS));
        for (uint32_t u = s->sends.head; u != NONE && n < count; u = e[u].link[SENDS][NEXT])
            burst[n++] = u;
        copies = (long)((count + n - 1) / n);
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = resend(s, burst[i], PROBE, now);
    for (long c = 1; c < copies && rc == 0; c++)  /* round again: what the dark run leaves holds all of it */
        for (Py_ssize_t i = 0; i < n && rc == 0; i++)
            rc = post(s, s->entries[burst[i]].state == ASKED ? ~(Py_ssize_t)burst[i] : (Py_ssize_t)burst[i]);
    PyMem_Free(burst);
    return rc;
}

/* The packet to resend next, when, and why (Reduction._next_loss); -1 when none. */
static Py_ssize_t next_loss(const Stream *s, double *when, int *why) {
    const Entry *e = s->entries;
    uint32_t oldest = s->sends.head, best = NONE;
    *when = INFINITY;
    if (oldest != NONE) {
        if (e[oldest].order < s->rack_order) {
            best = oldest;
            *when = e[oldest].last_send + s->rack_rtt + s->w.min_rtt / 4;
            *why = LOST;
        } else if (s->started && s->bursting && s->probes) {
            /* a lossy silence's bursts (Reduction._burst_wait) */
            best = oldest;
            *when = s->probe_from + dmin(s->w.max_rto, probe_timeout(&s->w)
                                                        * ldexp(1.0, (int)(s->probes > BURST_STEPS ? s->probes - BURST_STEPS : 0)));
            *why = PROBE;
            return best;  /* while they go, they alone resend */
        } else if (s->started && (!s->probes || s->n_in_flight <= EARLY_PROBE)) {
            /* a probe: the oldest packet sent once (Reduction._next_loss) */
            uint32_t first = oldest;
            while (first != NONE && e[first].retries)
                first = e[first].link[SENDS][NEXT];
            if (first == NONE && !s->probes)  /* every packet out went again: the oldest, once */
                first = oldest;
            if (first != NONE) {
                best = first;
                *when = s->probe_from + probe_timeout(&s->w) * ldexp(1.0, (int)s->probes);
                *why = PROBE;
            }
        }
    }
    uint32_t timer = s->timers.head;
    if (timer != NONE && (best == NONE || e[timer].deadline < *when)) {
        *when = e[timer].deadline;
        *why = TIMEOUT;
        return timer;
    }
    return best == NONE ? -1 : (Py_ssize_t)best;
}

static PyObject *Stream_next_deadline(Stream *s, PyObject *Py_UNUSED(ignored)) {
    if (unready(s))
        return NULL;
    double when;
    int why;
    next_loss(s, &when, &why);
    return PyFloat_FromDouble(dmin(when, s->last_progress + s->progress_timeout));
}

PyDoc_STRVAR(tick_doc,
"tick(now) -> bool\n\n"
"Retransmit what timed out. Returns True, doing nothing else, when progress stopped for the\n"
"progress timeout: the caller raises (Reduction.tick raises itself).");

static PyObject *Stream_tick(Stream *s, PyObject *arg) {
    if (unready(s))
        return NULL;
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (now >= s->last_progress + s->progress_timeout && s->n_done < s->total) {
        if (hand_back(s) < 0)  /* the call ends in an error: the window goes back with what it learned */
            return NULL;
        Py_RETURN_TRUE;
    }
    int changed = 0, lost = 0;  /* the losses found at one tick are one loss (a run), counted once */
    double when;
    int why;
    for (Py_ssize_t t = next_loss(s, &when, &why); t >= 0 && when <= now; t = next_loss(s, &when, &why)) {
        if (why != LOST)  /* silence: what is out now waited for it, and tells no round trip */
            s->quiet_from = s->n_sends;
        if (why == PROBE && !s->probes)  /* a silence's first probe: on a lossy path, a burst (Reduction.tick) */
            s->bursting = s->w.since_loss < LOSSY_RESULTS;
        if (why == PROBE && s->bursting) {
            if (probe_burst(s, t, now) < 0)
                return PyErr_NoMemory();
            s->probes++;
            s->probe_from = now;
            changed = 1;
            continue;
        }
        if (why == PROBE) {  /* no sign of loss yet: the window stays */
            s->probes++;
            s->probe_from = now;
        } else if (why == LOST || s->entries[t].retries) {  /* random loss, or a resent packet lost again */
            lost = 1;
            if (why == TIMEOUT && s->entries[t].state == ASKED)  /* an unanswered QUERY was lost */
                s->bursting = 1;
        } else {  /* a packet sent once timed out */
            double due = s->last_progress + s->w.rto;
            if (s->entries[t].last_send < s->last_progress && due > now) {
                /* results still come, of packets sent before it: it waits in a queue behind them, and its
                 * timer runs from the last result (Reduction.tick); the test is the new deadline itself, so
                 * that rounding never re-arms it at now, to fire again at once, forever */
                timer_move(s, t, due);
                continue;
            }
            if (now - s->last_progress >= s->w.rto) {  /* silent for an RTO: the lowest chunk out, once */
                Py_ssize_t lowest = 0;
                while (!s->entries[lowest].in_flight)
                    lowest++;
                if (s->stalled || lowest != t) {
                    timer_move(s, t, now + s->w.rto);
                    if (s->stalled || s->entries[lowest].retries)  /* the lowest has its own timer */
                        continue;
                    t = lowest;
                }
                s->stalled = 1;
            }
            if (s->n_done)  /* before a call's first result, silence means peers on their way to it */
                win_on_timeout(&s->w, now);
        }
        changed = 1;
        if (resend(s, t, why, now) < 0)
            return PyErr_NoMemory();
    }
    if (lost) {  /* Window.on_loss */
        s->w.losses++;
        s->w.since_loss = 0;
    }
    s->window_changed |= changed;
    if (call_over(s) && hand_back(s) < 0)
        return NULL;
    Py_RETURN_FALSE;
}

static PyObject *Stream_pending(Stream *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *list = unready(s) ? NULL : PyList_New(0);
    for (Py_ssize_t t = 0; list && t < s->next; t++) {
        if (!s->entries[t].in_flight)
            continue;
        PyObject *item = Py_BuildValue("(kii)", (unsigned long)(uint32_t)(s->first_id + (uint32_t)t),
                                       (int)s->entries[t].slot, (int)s->entries[t].copy);
        if (item == NULL || PyList_Append(list, item) < 0)
            Py_CLEAR(list);
        Py_XDECREF(item);
    }
    return list;
}

/* ---- construction ------------------------------------------------------------------------------ */

/* A reduce-scatter's buffers and chunks fit its layout: x holds every rank's shard, out this rank's
 * alone, and every shard has per_shard chunks. */
static int layout_fits_scatter(const Stream *s) {
    return s->out.itemsize == 4 && s->out.len == 4 * s->shard && s->numel == (Py_ssize_t)s->ranks * s->shard
           && s->n_chunks == (Py_ssize_t)s->ranks * s->per_shard && s->rank < s->ranks && s->ranks <= 256;
}

/* x and out fit the call: a plain one's the layout's values, a staged one's rows of K (every data chunk's
 * in x, those of the chunks this rank receives in out), with its exponents (proposals). */
static int buffers_fit(const Stream *s) {
    if (s->staged)
        return s->floats && s->x.len == 4 * s->k * s->n_chunks
               && (s->scatter ? s->n_chunks == (Py_ssize_t)s->ranks * s->per_shard && s->rank < s->ranks
                                    && s->ranks <= 256
                                    && s->out.len == 4 * s->k * s->per_shard
                              : s->out.len == 4 * s->k * s->n_chunks);
    return s->scatter ? layout_fits_scatter(s) : s->out.len == s->x.len && s->n_chunks == (s->numel + s->k - 1) / s->k;
}

/* The per-call arrays, one after another (each on a 64-byte boundary) in one block of the arena:
 * lay_out(s, NULL) says how many bytes they take, lay_out(s, block) points them into block. */
static size_t lay_out(Stream *s, unsigned char *block) {
    size_t at = 0, entries = (size_t)s->total + 1;
#define CARVE(array, count) do { \
        if (block != NULL) \
            s->array = (void *)(block + at); \
        at += ((size_t)(count) * sizeof *s->array + 63) & ~(size_t)63; \
    } while (0)
    CARVE(entries, entries);
    CARVE(resends, entries);
    CARVE(proposals, s->n_chunks + 1);
    CARVE(copy0, s->slots);
    CARVE(call_row, 4 * s->k * s->parts);
    CARVE(expect, 4 * s->k * s->parts);
    CARVE(gathered, 4 * s->k * s->parts);
    CARVE(seen, s->parts);
#undef CARVE
    return at;
}

/* s->header, the fields every contribution of the call has alike (write_header), and the ids a result
 * must carry, as loads of its header find them (ids_match). */
static void write_call_header(Stream *s) {
    unsigned char *h = s->header;
    memset(h, 0, HEADER_SIZE);
    h[OFF_VERSION] = VERSION;
    h[OFF_TYPE] = TYPE_CONTRIB;
    h[OFF_WORKER] = s->worker;
    put16(h + OFF_JOB, s->job);
    put32(h + OFF_GENERATION, s->generation);
    put32(h + OFF_KEY, s->key);
    put16(h + OFF_COUNT, (uint16_t)s->k);
    const unsigned char mask[4] = {0, 0xff, 0xff, 0xff};  /* bytes 2-5: not the flags; worker, job */
    memcpy(&s->ids_mask, mask, 4);
    memcpy(&s->worker_job, h + OFF_FLAGS, 4);
    memcpy(&s->generation_key, h + OFF_GENERATION, 8);
}

/* Borrow `given` for this call, or where there is none or another Stream holds it, a new Arena of the
 * call's own; point the call's arrays into its block, grown where the call needs more. */
static int borrow_arena(Stream *s, PyObject *given) {
    Arena *a = given != Py_None && !((Arena *)given)->lent ? (Arena *)Py_NewRef(given)
                                                            : (Arena *)PyObject_CallNoArgs((PyObject *)&ArenaType);
    if (a == NULL)
        return -1;
    s->arena = a;
    a->lent = 1;
    s->outbox = a->outbox;
    s->out_cap = a->out_cap;
    size_t need = lay_out(s, NULL);
    if (a->size < need) {
        free(a->block);  /* nothing in it outlives a call: no copy */
        a->block = malloc(need);
        a->size = a->block != NULL ? need : 0;
        if (a->block == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a->allocations++;
    }
    lay_out(s, a->block);
    return 0;
}

static int Stream_init(Stream *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"window", "x", "out", "proposals", "copy0", "job", "worker", "key", "generation",
                             "n_workers", "values_per_packet", "n_chunks", "rounds", "first_id", "now",
                             "progress_timeout", "started", "ask_first", "call_row", "expect", "shard", "arena",
                             "staged", "rank", "ranks", NULL};
    PyObject *window, *x, *out, *proposals, *copy0, *call_obj = Py_None, *expect_obj = Py_None, *arena = Py_None;
    Py_buffer call_row = {0}, expect = {0};
    unsigned int job, worker, n_workers;
    unsigned long key, generation, first_id;
    Py_ssize_t k, n_chunks, rounds, shard = -1, rank = -1, ranks = -1;
    double now, progress_timeout;
    int started, ask_first = 0, staged = 0;
    if (s->window != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Stream is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOIIkkInnnkddp|pOOnOpnn", kwlist, &window, &x, &out, &proposals,
                                     &copy0, &job, &worker, &key, &generation, &n_workers, &k, &n_chunks,
                                     &rounds, &first_id, &now, &progress_timeout, &started, &ask_first,
                                     &call_obj, &expect_obj, &shard, &arena, &staged, &rank, &ranks))
        return -1;
    if (rank < -1 || ranks < -1 || ranks > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "Stream: rank and ranks are a tree's (0..65535), or -1: the job's own");
        return -1;
    }
    if (arena != Py_None && !PyObject_TypeCheck(arena, &ArenaType)) {
        PyErr_SetString(PyExc_TypeError, "Stream: arena must be an Arena or None");
        return -1;
    }
    /* No call round (None, None): int32 data alone, as the join's sums run. */
    int has_call = call_obj != Py_None;
    if (has_call && (PyObject_GetBuffer(call_obj, &call_row, PyBUF_SIMPLE) < 0
                     || PyObject_GetBuffer(expect_obj, &expect, PyBUF_SIMPLE) < 0)) {
        PyBuffer_Release(&call_row);
        return -1;
    }
    Py_buffer copies;
    if (PyObject_GetBuffer(copy0, &copies, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&call_row);
        PyBuffer_Release(&expect);
        return -1;
    }
    s->slots = copies.len;
    /* proposals: None for int32 data; for floats, the int8 proposal of every chunk, or True where the
     * stream is to make them itself as it sends (proposal_of: one read of the input, not two) */
    s->floats = proposals != Py_None;
    s->window = Py_NewRef(window);
    s->job = (uint16_t)job;
    s->worker = (uint8_t)worker;
    s->key = (uint32_t)key;
    s->generation = (uint32_t)generation;
    s->first_id = (uint32_t)first_id;
    s->n_workers = n_workers;
    s->rank = rank < 0 ? worker : (unsigned int)rank;
    s->ranks = ranks < 0 ? n_workers : (unsigned int)ranks;
    s->log2n = 0;
    while ((1u << s->log2n) < s->ranks)
        s->log2n++;
    s->ask_first = ask_first;
    s->all = n_workers >= 32 ? 0xffffffffu : (1u << n_workers) - 1;
    s->k = k;
    /* shard < 0: an allreduce; else a reduce-scatter of n_workers shards of `shard` values */
    s->scatter = shard >= 0;
    s->shard = shard;
    s->per_shard = k > 0 && shard > 0 ? (shard + k - 1) / k : 0;
    /* calls.parts: the chunks of K values that every rank's two words take (0: no call round) */
    s->parts = 0;
    if (has_call && k > 0) {
        s->parts = (2 * (Py_ssize_t)s->ranks + k - 1) / k;
        if (s->parts < 1)
            s->parts = 1;
    }
    Py_ssize_t data_rounds = s->slots < n_chunks ? s->slots : n_chunks;
    s->staged = staged;
    s->prepared = staged ? 0 : n_chunks;
    s->n_chunks = n_chunks;
    s->rounds = rounds;
    s->total = rounds + n_chunks;
    s->last_progress = now;
    s->progress_timeout = progress_timeout;
    s->started = started;
    int rc = -1;
    if (PyObject_GetBuffer(x, &s->x, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(out, &s->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    s->numel = s->x.len / 4;
    if (s->slots < 1 || s->slots > 0x10000 || k < 1 || s->x.itemsize != 4
            || !buffers_fit(s)
            || s->parts > s->slots || rounds != (!has_call ? 0 : s->parts > data_rounds ? s->parts : data_rounds)
            || (has_call && (call_row.len != 4 * k * s->parts || expect.len != 4 * k * s->parts))
            || (!has_call && s->floats)
            || s->total >= NONE) {
        PyErr_SetString(PyExc_ValueError, "Stream: x and out must be equal-sized 4-byte arrays in n_chunks chunks "
                        "of values_per_packet (a reduce-scatter's: x ranks shards of `shard` values, out one, "
                        "n_chunks ranks x ceil(shard / K), ranks at most 256, the owner byte's; a staged call's: rows of K, x n_chunks, out those this "
                        "rank receives, and proposals), rounds = max(P, min(slots, n_chunks)) "
                        "with a call round (call_row and expect P x K values each, P = calls.parts(ranks, K), "
                        "at most slots), else 0, floats need one, and "
                        "there are fewer than 2^32 - 1 packets");
        goto done;
    }
    if (win_load(s) < 0 || borrow_arena(s, arena) < 0)
        goto done;
    s->timers.head = s->timers.tail = s->sends.head = s->sends.tail = s->fill_last = NONE;
    write_call_header(s);
    s->rack_order = -1;
    s->quiet_from = 0;
    s->run_at = -INFINITY;
    s->run_first = 0.0;
    s->probe_from = now;
    s->probes = 0;
    s->bursting = 0;
    s->run_lost = -INFINITY;
    s->first_result = INFINITY;
    start_batch(s);
    memcpy(s->copy0, copies.buf, (size_t)s->slots);
    if (has_call) {
        memcpy(s->call_row, call_row.buf, 4 * (size_t)k * (size_t)s->parts);
        memcpy(s->expect, expect.buf, 4 * (size_t)k * (size_t)s->parts);
        memset(s->seen, 1, (size_t)s->parts);
    }
    s->unseen = s->parts;
    s->differs = s->mismatch = 0;
    if (s->floats && proposals == Py_True) {
        s->proposed = 0;  /* the stream proposes each chunk as it goes (proposal_of) */
    } else if (s->floats) {
        s->proposed = n_chunks;
        Py_buffer p;
        if (PyObject_GetBuffer(proposals, &p, PyBUF_SIMPLE) < 0)
            goto done;
        int fits = p.len == n_chunks;
        if (fits)
            memcpy(s->proposals, p.buf, (size_t)n_chunks);
        PyBuffer_Release(&p);
        if (!fits) {
            PyErr_SetString(PyExc_ValueError, "Stream: one proposed exponent (int8) per chunk");
            goto done;
        }
    }
    rc = fill(s, now);
    if (rc < 0)
        PyErr_NoMemory();
    s->ready = rc == 0;
done:
    PyBuffer_Release(&copies);
    PyBuffer_Release(&call_row);
    PyBuffer_Release(&expect);
    return rc;
}

static void Stream_dealloc(Stream *s) {
    Py_XDECREF(s->window);
    if (s->x.obj)
        PyBuffer_Release(&s->x);
    if (s->out.obj)
        PyBuffer_Release(&s->out);
    if (s->arena != NULL) {  /* the arrays stay in the arena for the next call; the outbox may have grown */
        s->arena->outbox = s->outbox;
        s->arena->out_cap = s->out_cap;
        s->arena->lent = 0;
        Py_DECREF(s->arena);
    }
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *get_done(Stream *s, void *c) { return PyBool_FromLong(s->n_done == s->total || s->mismatch); }
static PyObject *get_mismatch(Stream *s, void *c) {
    if (!s->mismatch)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)s->gathered, 4 * s->k * s->parts);
}
static PyObject *get_started(Stream *s, void *c) { return PyBool_FromLong(s->started); }
static PyObject *get_n_done(Stream *s, void *c) { return PyLong_FromSsize_t(s->n_done); }
static PyObject *get_total(Stream *s, void *c) { return PyLong_FromSsize_t(s->total); }
static PyObject *get_rounds(Stream *s, void *c) { return PyLong_FromSsize_t(s->rounds); }
static PyObject *get_retransmissions(Stream *s, void *c) { return PyLong_FromLong(s->retransmissions); }
static PyObject *get_queries(Stream *s, void *c) { return PyLong_FromLong(s->queries); }
static PyObject *get_protocol_errors(Stream *s, void *c) { return PyLong_FromLong(s->protocol_errors); }
static PyObject *get_foreign(Stream *s, void *c) { return PyLong_FromLong(s->foreign); }
/* Reduction.marked: some result carried EXP_NONFINITE, the exponent its slot's next chunk used */
static PyObject *get_marked(Stream *s, void *c) { return PyBool_FromLong(s->marked); }
static PyObject *get_last_progress(Stream *s, void *c) { return PyFloat_FromDouble(s->last_progress); }
static PyObject *get_prepared(Stream *s, void *c) { return PyLong_FromSsize_t(s->prepared); }
static PyObject *get_outbox_len(Stream *s, void *c) { return PyLong_FromSsize_t(s->out_len); }

static PyGetSetDef Stream_getset[] = {
    {"done", (getter)get_done, NULL, "every packet's result is in, or the call round ended the call", NULL},
    {"mismatch", (getter)get_mismatch, NULL, "the call round's sums (every part's, in order) where they showed other calls than this one, else None", NULL},
    {"started", (getter)get_started, NULL, "a result ever came back (this call or, as given, an earlier one)", NULL},
    {"n_done", (getter)get_n_done, NULL, NULL, NULL},
    {"total", (getter)get_total, NULL, "packets of the call: the call round and the data chunks", NULL},
    {"rounds", (getter)get_rounds, NULL, "packets of the call round", NULL},
    {"retransmissions", (getter)get_retransmissions, NULL, "contributions sent again", NULL},
    {"queries", (getter)get_queries, NULL, "QUERY packets sent", NULL},
    {"protocol_errors", (getter)get_protocol_errors, NULL,
     "results of this call's packets whose owner or count was not the packet's (ignored)", NULL},
    {"foreign", (getter)get_foreign, NULL,
     "datagrams no result or answer of this run's at all (too short, another type, lengths that disagree, another "
     "job's, worker's, session's or key): ignored and counted", NULL},
    {"marked", (getter)get_marked, NULL, "some data chunk of the call went marked (NaN or infinity on some rank)",
     NULL},
    {"last_progress", (getter)get_last_progress, NULL, NULL, NULL},
    {"prepared", (getter)get_prepared, NULL, "data chunks [0, prepared) have their values: all but a staged call's", NULL},
    {"due", (getter)get_outbox_len, NULL, "packets waiting for emit()", NULL},
    {NULL},
};

PyDoc_STRVAR(prepare_doc,
"prepare(upto, now)\n\n"
"A staged call's data chunks below ``upto`` have their rows: send what the schedule allows now.");

static PyObject *Stream_prepare(Stream *s, PyObject *args) {
    Py_ssize_t upto;
    double now;
    if (unready(s) || !PyArg_ParseTuple(args, "nd", &upto, &now))
        return NULL;
    if (upto > s->prepared)
        s->prepared = upto < s->n_chunks ? upto : s->n_chunks;
    if (fill(s, now) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Data chunk d's exponent is agreed once the entry before it on its slot is done (none: EXP_NONE).
 * Only entries the schedule reached (below next) hold anything (fill). */
static int agreed_yet(const Stream *s, Py_ssize_t d) {
    Py_ssize_t prev = prev_of(s, s->rounds + d);
    return prev < 0 || (prev < s->next && s->entries[prev].done);
}

static PyObject *Stream_agreed_upto(Stream *s, PyObject *Py_UNUSED(ignored)) {
    if (unready(s))
        return NULL;
    while (s->n_agreed < s->n_chunks && agreed_yet(s, s->n_agreed))
        s->n_agreed++;
    return PyLong_FromSsize_t(s->n_agreed);
}

static PyObject *Stream_exponents(Stream *s, PyObject *args) {
    Py_ssize_t start, stop;
    if (unready(s) || !PyArg_ParseTuple(args, "nn", &start, &stop))
        return NULL;
    if (start < 0 || start > stop || stop > s->n_agreed)
        return PyErr_Format(PyExc_ValueError, "exponents(%zd, %zd): only data chunks [0, %zd) are agreed yet",
                            start, stop, s->n_agreed);
    PyObject *out = PyBytes_FromStringAndSize(NULL, stop - start);
    if (out != NULL)
        for (Py_ssize_t d = start; d < stop; d++)
            PyBytes_AS_STRING(out)[d - start] = (char)(int8_t)exponent_used(s, s->rounds + d);
    return out;
}

static PyObject *Stream_summed_upto(Stream *s, PyObject *Py_UNUSED(ignored)) {
    if (unready(s))
        return NULL;
    while (s->n_summed < s->n_chunks && s->rounds + s->n_summed < s->next
           && s->entries[s->rounds + s->n_summed].done)
        s->n_summed++;
    return PyLong_FromSsize_t(s->n_summed);
}

PyDoc_STRVAR(hand_back_doc,
"hand_back()\n\n"
"Write what this call has taught the window into the Python Window now. The stream does so by\n"
"itself once the call is over or has stalled; during a call the Window holds what it held before.");

static PyObject *Stream_hand_back(Stream *s, PyObject *Py_UNUSED(ignored)) {
    if (unready(s) || hand_back(s) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Stream_methods[] = {
    {"emit", (PyCFunction)Stream_emit, METH_VARARGS, emit_doc},
    {"hand_back", (PyCFunction)Stream_hand_back, METH_NOARGS, hand_back_doc},
    {"prepare", (PyCFunction)Stream_prepare, METH_VARARGS, prepare_doc},
    {"agreed_upto", (PyCFunction)Stream_agreed_upto, METH_NOARGS,
     "Data chunks [0, m) whose exponents are agreed (the results before them on their slots are in): m."},
    {"exponents", (PyCFunction)Stream_exponents, METH_VARARGS,
     "exponents(start, stop) -> bytes: the agreed exponent (int8) of data chunks [start, stop), all agreed."},
    {"summed_upto", (PyCFunction)Stream_summed_upto, METH_NOARGS, "Data chunks [0, m) whose results are in: m."},
    {"receive_batch", (PyCFunction)Stream_receive_batch, METH_VARARGS, receive_batch_doc},
    {"next_deadline", (PyCFunction)Stream_next_deadline, METH_NOARGS,
     "When tick() has something to do: a retransmission or the progress timeout."},
    {"tick", (PyCFunction)Stream_tick, METH_O, tick_doc},
    {"pending", (PyCFunction)Stream_pending, METH_NOARGS, "(chunk id, slot, copy) of every outstanding packet, oldest first."},
    {NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchagg._native.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = PyDoc_STR("One allreduce or reduce-scatter call of numpy data, as protocol.Reduction does it "
                        "(see _stream.c)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Stream_init,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_methods = Stream_methods,
    .tp_getset = Stream_getset,
};

/* ---- the arena ------------------------------------------------------------------------------- */

static void Arena_dealloc(Arena *a) {
    free(a->block);
    free(a->outbox);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *get_lent(Arena *a, void *c) { return PyBool_FromLong(a->lent); }
static PyObject *get_allocations(Arena *a, void *c) { return PyLong_FromLong(a->allocations); }
static PyObject *get_size(Arena *a, void *c) { return PyLong_FromSize_t(a->size); }

static PyGetSetDef Arena_getset[] = {
    {"lent", (getter)get_lent, NULL, "a Stream holds it now", NULL},
    {"allocations", (getter)get_allocations, NULL,
     "blocks allocated for it: the first call's, and each call's that needed more than any before", NULL},
    {"size", (getter)get_size, NULL, "bytes of its block", NULL},
    {NULL},
};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchagg._native.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("The memory of a Stream's per-call arrays, lent to one Stream at a time (Stream(arena=...)) "
                        "and kept for the next: a client's calls reuse it (see _stream.c)."),
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_getset = Arena_getset,
};

int sa_add_stream_type(PyObject *module) {
    if (PyType_Ready(&StreamType) < 0 || PyModule_AddObjectRef(module, "Stream", (PyObject *)&StreamType) < 0
            || PyType_Ready(&ArenaType) < 0 || PyModule_AddObjectRef(module, "Arena", (PyObject *)&ArenaType) < 0)
        return -1;
    PyObject *layout = Py_BuildValue(
        "((sii)(sii)(sii)(sii)(sii)(sii)(sii)(sii)(sii)(sii)(sii)(sii))",
        "version", OFF_VERSION, 1, "type", OFF_TYPE, 1, "flags", OFF_FLAGS, 1, "worker", OFF_WORKER, 1,
        "job", OFF_JOB, 2, "slot", OFF_SLOT, 2, "chunk", OFF_CHUNK, 4, "generation", OFF_GENERATION, 4,
        "key", OFF_KEY, 4, "exponent", OFF_EXPONENT, 1, "owner", OFF_OWNER, 1, "count", OFF_COUNT, 2);
    PyObject *wire = Py_BuildValue("{sisisisisisisisisisisisisi}", "HEADER_SIZE", HEADER_SIZE, "VERSION", VERSION,
                                   "CONTRIB", TYPE_CONTRIB, "RESULT", TYPE_RESULT, "PROBE", TYPE_PROBE,
                                   "PROBE_REPLY", TYPE_PROBE_REPLY, "QUERY", TYPE_QUERY, "PENDING", TYPE_PENDING,
                                   "FLAG_COPY", FLAG_COPY, "FLAG_OWNER", FLAG_OWNER, "EXP_NONE", EXP_NONE, "EXP_NONFINITE", EXP_NONFINITE,
                                   "MAX_WORKERS", MAX_WORKERS);
    PyObject *window = Py_BuildValue("(ssssssssssssssssssssss)", WINDOW_FIELDS);
    PyObject *protocol = Py_BuildValue("{sdsdsdsisdsisdsisdsdsisisisisisi}", "LOSS_SHARE", LOSS_SHARE, "QUEUE_LIMIT", QUEUE_LIMIT,
                                       "LOSS_QUEUE", LOSS_QUEUE,
                                       "DELAY_SAMPLES", DELAY_SAMPLES, "DELAY_BETA", DELAY_BETA, "BACKOFF_CAP",
                                       BACKOFF_CAP, "MIN_RESEND", MIN_RESEND, "RESEND_DEVIATIONS", RESEND_DEVIATIONS,
                                       "MIN_PROBE", MIN_PROBE, "MIN_PROBE_LOSSY", MIN_PROBE_LOSSY, "LOSSY_RESULTS", LOSSY_RESULTS,
                                       "EARLY_PROBE", EARLY_PROBE, "TAIL_RTTS", TAIL_RTTS, "BURST_STEPS", BURST_STEPS,
                                       "RUN_CAP", RUN_CAP, "RUN_ASK", RUN_ASK);
    int rc = layout && wire && window && protocol && PyModule_AddObjectRef(module, "HEADER_LAYOUT", layout) == 0
             && PyModule_AddObjectRef(module, "WIRE", wire) == 0
             && PyModule_AddObjectRef(module, "WINDOW_FIELDS", window) == 0
             && PyModule_AddObjectRef(module, "PROTOCOL", protocol) == 0 ? 0 : -1;
    Py_XDECREF(layout);
    Py_XDECREF(wire);
    Py_XDECREF(window);
    Py_XDECREF(protocol);
    return rc;
}
