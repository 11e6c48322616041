/* _udp: batches of UDP datagrams per system call on Linux, with the kernel's segmentation offload.
 *
 * sendmmsg/recvmmsg move one datagram per message; at the switch's packet size (K = 64, 280-byte
 * datagrams) the kernel's cost per datagram caps a core at a few hundred thousand a second. UDP
 * generic segmentation offload (UDP_SEGMENT, Linux 4.18) lets one message carry up to 64 (128 on
 * recent kernels) equal-sized datagrams that the kernel, or the NIC, cuts apart on the way out;
 * UDP_GRO (Linux 5.0) hands the receiver consecutive datagrams of one flow as one buffer with the
 * segment size in a cmsg. On loopback the super-datagram is never cut at all, so a worker and the
 * embedded switch move tens of times more small datagrams per core; on a veth or a NIC a BMv2 or a
 * Tofino still sees ordinary frames, one chunk each.
 *
 * send() groups the packets of a batch by destination (stable: each destination's packets leave in
 * the order given) into runs of equal-sized packets (a packet is one part, or two: a header and a body
 * that several packets may share, as the embedded switch's multicast of a large sum sends one copy to
 * every worker; each part an iovec, an empty body none) (the last of a run may be shorter, as the kernel
 * allows) and sends each run as one message; a kernel that refuses segmentation for this socket
 * (EIO from a device without checksum offload, EINVAL, ...) gets the rest of the batch as plain
 * datagrams and the caller is told, so it stops asking. recv() splits each message by the segment
 * size the kernel reports. Both are plain byte arrays in and out (the buffer protocol): no Python
 * object per datagram. drive() is a worker's whole loop over a connected socket (send what its state
 * machine has due, poll until its next deadline, receive, tick), calling the machine's methods by
 * name: at K = 64 a call takes hundreds of turns, each a dozen Python calls when the loop was Python's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef __linux__
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#ifndef POLLRDHUP
#define POLLRDHUP 0x2000  /* Linux's (poll.h defines it under _GNU_SOURCE) */
#endif
#include <sys/socket.h>
#include <time.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define NAME 16            /* sizeof(struct sockaddr_in) */
#define MAX_UDP 65507      /* the largest UDP payload of an IPv4 datagram */
#define MAX_VLEN 1024      /* messages per sendmmsg call (UIO_MAXIOV) */
#define RECV_VLEN 256      /* messages per recvmmsg call (its arrays live on the stack) */
#define DESTINATIONS 64    /* destinations grouped per batch; more share the last group, by runs */

/* An errno that means "this datagram is lost", not "this socket is broken": counted, not raised. */
static int transient(int err) {
    return err == ENOBUFS || err == EPERM || err == ECONNREFUSED || err == EHOSTUNREACH || err == ENETUNREACH
           || err == EAGAIN || err == EWOULDBLOCK || err == EMSGSIZE;
}

/* An errno from a message with UDP_SEGMENT that means "no segmentation here": send plainly instead. */
static int gso_refused(int err) {
    return err == EIO || err == EINVAL || err == EOPNOTSUPP || err == ENOPROTOOPT || err == EMSGSIZE;
}

typedef union {
    char buf[CMSG_SPACE(sizeof(uint16_t))];
    struct cmsghdr align;
} SegmentCmsg;

typedef struct {
    Py_ssize_t n;
    const unsigned char *buf, *names;  /* names: n sockaddr_in, or NULL on a connected socket */
    const uint32_t *offsets, *lengths;
    const uint32_t *body_offsets, *body_lengths;  /* each packet's second part, or NULL: one part a packet */
    Py_ssize_t *order;                  /* the packets grouped by destination */
    struct iovec *iov;                  /* iov[iov_at[k]..iov_at[k + 1]) is packet order[k]: 1 or 2 parts */
    Py_ssize_t *iov_at;
    struct iovec *msg_iov;              /* the messages' iovecs: their packets' parts, each run of parts that
                                         * lie one after another in memory as one (lay_out) */
    size_t bytes;                       /* the packets' bytes, parts together */
    unsigned char *staging;             /* room for them, where lay_out gathers a message of many small
                                         * parts: taken at its first such message (NULL: none yet) */
    struct mmsghdr *msgs;
    SegmentCmsg *cmsgs;
    Py_ssize_t *first;                  /* msgs[m] carries packets order[first[m]..first[m + 1]) */
} Batch;

/* Stable grouping of the packets by destination: a counting sort on a small table of the names seen. */
static void group(Batch *b) {
    if (b->names == NULL) {
        for (Py_ssize_t i = 0; i < b->n; i++)
            b->order[i] = i;
        return;
    }
    const unsigned char *seen[DESTINATIONS];
    Py_ssize_t counts[DESTINATIONS + 1] = {0};
    int n_seen = 0, last = 0;
    uint8_t *dest = malloc((size_t)b->n);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        const unsigned char *name = b->names + i * NAME;
        int d = last;
        if (d >= n_seen || memcmp(seen[d] + 2, name + 2, 6)) {  /* port and address */
            for (d = 0; d < n_seen && memcmp(seen[d] + 2, name + 2, 6); d++)
                ;
            if (d == n_seen && n_seen < DESTINATIONS)
                seen[n_seen++] = name;
            else if (d == n_seen)
                d = DESTINATIONS - 1;  /* the table is full: the last group, cut into runs below */
        }
        last = d;
        if (dest != NULL)
            dest[i] = (uint8_t)d;
        counts[d + 1]++;
    }
    if (dest == NULL) {  /* out of memory: the given order, which runs still group */
        for (Py_ssize_t i = 0; i < b->n; i++)
            b->order[i] = i;
        return;
    }
    for (int d = 0; d < DESTINATIONS; d++)
        counts[d + 1] += counts[d];
    for (Py_ssize_t i = 0; i < b->n; i++)
        b->order[counts[dest[i]]++] = i;
    free(dest);
}

/* A packet's bytes on the wire: its parts together. */
static size_t packet_size(const Batch *b, Py_ssize_t p) {
    return (size_t)b->lengths[p] + (b->body_lengths ? b->body_lengths[p] : 0);
}

static int same_destination(const Batch *b, Py_ssize_t i, Py_ssize_t j) {
    return b->names == NULL || !memcmp(b->names + i * NAME + 2, b->names + j * NAME + 2, 6);
}

/* Below this many bytes a part on average, a message's parts are gathered into one (lay_out). */
#define GATHER_BELOW 512

/* Lay out messages for packets order[from..n), each a run of at most max_segments; returns how many
 * messages, starting at msgs[at]. The kernel copies a message's bytes an iovec at a time, and one 18 KB
 * copy costs it a third less than 64 of 280 bytes (loopback, GSO): so a message's parts that lie one
 * after another (a worker's rows, written in place) go as one iovec, and the parts of a message of small
 * ones that do not (the embedded switch's results, a worker's between the others') are copied one after
 * another into b->staging first, which costs less than the iovecs it saves up to a few hundred bytes a
 * part. The messages before msgs[at] are sent by now, so their room is taken again. */
static Py_ssize_t lay_out(Batch *b, Py_ssize_t from, Py_ssize_t at, long max_segments) {
    Py_ssize_t m = at, used = 0, staged = 0;
    for (Py_ssize_t k = from; k < b->n; m++) {
        Py_ssize_t p = b->order[k];
        size_t segment = packet_size(b, p), total = segment;
        Py_ssize_t end = k + 1;
        while (end < b->n && end - k < max_segments && packet_size(b, b->order[end - 1]) == segment) {
            Py_ssize_t q = b->order[end];
            size_t size = packet_size(b, q);
            if (size > segment || size == 0 || total + size > MAX_UDP || !same_destination(b, p, q))
                break;
            total += size;
            end++;
        }
        struct msghdr *h = &b->msgs[m].msg_hdr;
        memset(h, 0, sizeof(*h));
        h->msg_iov = &b->msg_iov[used];  /* a message's packets' parts, one after another: GSO cuts by size */
        for (Py_ssize_t j = b->iov_at[k]; j < b->iov_at[end]; j++) {
            struct iovec *last = h->msg_iovlen ? &b->msg_iov[used - 1] : NULL;
            if (last && (const unsigned char *)last->iov_base + last->iov_len == b->iov[j].iov_base) {
                last->iov_len += b->iov[j].iov_len;
            } else {
                b->msg_iov[used++] = b->iov[j];
                h->msg_iovlen++;
            }
        }
        if (h->msg_iovlen > 1 && total < GATHER_BELOW * h->msg_iovlen
                && (b->staging != NULL || (b->staging = malloc(b->bytes)) != NULL)) {  /* else as they lie */
            unsigned char *into = b->staging + staged;
            for (size_t j = 0; j < h->msg_iovlen; j++) {
                memcpy(b->staging + staged, h->msg_iov[j].iov_base, h->msg_iov[j].iov_len);
                staged += (Py_ssize_t)h->msg_iov[j].iov_len;
            }
            used -= (Py_ssize_t)h->msg_iovlen - 1;
            h->msg_iov[0].iov_base = into;
            h->msg_iov[0].iov_len = total;
            h->msg_iovlen = 1;
        }
        if (b->names != NULL) {
            h->msg_name = (void *)(b->names + p * NAME);
            h->msg_namelen = NAME;
        }
        if (end - k > 1) {
            struct cmsghdr *c = (struct cmsghdr *)b->cmsgs[m].buf;
            h->msg_control = c;
            h->msg_controllen = sizeof(b->cmsgs[m].buf);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t size = (uint16_t)segment;
            memcpy(CMSG_DATA(c), &size, sizeof(size));
        }
        b->first[m] = k;
        k = end;
    }
    b->first[m] = b->n;
    return m - at;
}

/* A batch's four arrays as buffers: the bytes, the offsets, the lengths and, unless None, the names. */
static int get_batch(PyObject *const objs[4], Py_buffer views[4], int writable) {
    for (int i = 0; i < 4; i++)
        if ((i < 3 || objs[i] != Py_None)
                && PyObject_GetBuffer(objs[i], &views[i], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            return -1;
    return 0;
}

static void release_batch(Py_buffer views[4]) {
    for (int i = 0; i < 4; i++)
        PyBuffer_Release(&views[i]);  /* a no-op on a buffer never got */
}

static PyObject *os_error(int err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* The bytes of b's n packets, summed in the walk that checks that each lies within the buffer's len bytes
 * and is at most max_length long (0: no limit); -1 with a ValueError when one is not. */
static long long checked_bytes(const Batch *b, Py_ssize_t len, Py_ssize_t max_length) {
    long long nbytes = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        size_t size = packet_size(b, i), body = size - b->lengths[i];
        if ((size_t)b->offsets[i] + b->lengths[i] > (size_t)len
                || (b->body_offsets && (size_t)b->body_offsets[i] + body > (size_t)len)
                || (max_length > 0 && size > (size_t)max_length)) {
            PyErr_Format(PyExc_ValueError, "send: packet %zd (%u bytes at %u, body %zu at %u) lies outside the "
                         "buffer or is longer than %zd bytes", i, b->lengths[i], b->offsets[i], body,
                         b->body_offsets ? b->body_offsets[i] : 0, max_length);
            return -1;
        }
        nbytes += (long long)size;
    }
    return nbytes;
}

/* What sends did: datagrams sent, and refused (lost); system calls; the errno for which the kernel
 * refused segmentation (0: it did not). */
typedef struct {
    long long sent, refused, calls;
    int gso_errno;
} SendCounts;

/* Send b's packets (already checked against their buffer), grouped and segmented as send() describes,
 * adding to c; called with the GIL, which it releases around the system calls. Returns 0, the errno
 * that broke the socket, or -1 when out of memory (no exception set: the caller raises). */
static int send_batch(int fd, Batch *b, long max_segments, SendCounts *c) {
    Py_ssize_t n = b->n;
    int fatal = 0;
    b->order = malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    b->iov = malloc(sizeof(struct iovec) * 2 * (size_t)(n + 1));
    b->msg_iov = malloc(sizeof(struct iovec) * 2 * (size_t)(n + 1));
    b->iov_at = malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    b->msgs = malloc(sizeof(struct mmsghdr) * (size_t)(n + 1));
    b->cmsgs = malloc(sizeof(SegmentCmsg) * (size_t)(n + 1));
    b->first = malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    if (!b->order || !b->iov || !b->msg_iov || !b->iov_at || !b->msgs || !b->cmsgs || !b->first) {
        fatal = -1;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    group(b);
    Py_ssize_t parts = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t p = b->order[k];
        b->bytes += packet_size(b, p);
        b->iov_at[k] = parts;
        b->iov[parts].iov_base = (void *)(b->buf + b->offsets[p]);
        b->iov[parts++].iov_len = b->lengths[p];
        if (b->body_lengths && b->body_lengths[p]) {
            b->iov[parts].iov_base = (void *)(b->buf + b->body_offsets[p]);
            b->iov[parts++].iov_len = b->body_lengths[p];
        }
    }
    b->iov_at[n] = parts;
    Py_ssize_t count = lay_out(b, 0, 0, max_segments > 1 ? max_segments : 1), m = 0;
    while (m < count) {
        c->calls++;
        int vlen = count - m < MAX_VLEN ? (int)(count - m) : MAX_VLEN;
        int done = sendmmsg(fd, &b->msgs[m], (unsigned)vlen, 0);
        if (done > 0) {
            for (int j = 0; j < done; j++)
                c->sent += b->first[m + j + 1] - b->first[m + j];
            m += done;
            continue;
        }
        int err = done == 0 ? EAGAIN : errno;  /* nothing sent and no error: take it as a full queue */
        if (err == EINTR)
            continue;
        if (b->msgs[m].msg_hdr.msg_controllen && gso_refused(err)) {
            c->gso_errno = err;  /* from here on, one datagram a message */
            count = m + lay_out(b, b->first[m], m, 1);
        } else if (transient(err)) {
            c->refused += b->first[m + 1] - b->first[m];
            m++;
        } else {
            fatal = err;
            break;
        }
    }
    Py_END_ALLOW_THREADS
done:
    free(b->order);
    free(b->iov);
    free(b->msg_iov);
    free(b->staging);
    free(b->msgs);
    free(b->cmsgs);
    free(b->first);
    free(b->iov_at);
    return fatal;
}

PyDoc_STRVAR(send_doc,
"send(fd, buf, offsets, lengths, names, n, max_segments, body_offsets=None, body_lengths=None, max_length=0)\n"
"    -> (sent, refused, calls, gso_errno, nbytes)\n\n"
"Send packets 0..n-1: packet i is lengths[i] bytes at buf[offsets[i]:] (uint32 arrays), followed,\n"
"where body arrays are given, by body_lengths[i] bytes at buf[body_offsets[i]:] (a body several\n"
"packets may share: the kernel reads each part as an iovec, a packet's two parts in turn; a packet\n"
"with an empty body is one), to the sockaddr_in in row i of names (a uint8 array, 16 bytes a row), or\n"
"to the connected peer when names is None. With max_segments > 1 the packets go out grouped by\n"
"destination, each run of equal-sized packets as one segmented message. What the kernel refuses is\n"
"counted in refused, not raised; if it refuses segmentation, the rest goes out plainly and gso_errno\n"
"says why (else 0). nbytes: the n packets' bytes, parts together (refused ones too). A packet\n"
"longer than max_length (parts together; 0: no limit) is refused as one outside buf: nothing is sent.");

static PyObject *udp_send(PyObject *self, PyObject *args) {
    int fd;
    long max_segments;
    Py_ssize_t n, max_length = 0;
    PyObject *buf_obj, *off_obj, *len_obj, *names_obj, *body_off_obj = Py_None, *body_len_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOOnl|OOn", &fd, &buf_obj, &off_obj, &len_obj, &names_obj, &n, &max_segments,
                          &body_off_obj, &body_len_obj, &max_length))
        return NULL;
    PyObject *const objs[4] = {buf_obj, off_obj, len_obj, names_obj};
    Py_buffer v[4] = {{0}}, buf, off, len, names, body_off = {0}, body_len = {0};
    PyObject *result = NULL;
    Batch b = {0};
    if (get_batch(objs, v, 0) < 0)
        goto done;
    buf = v[0], off = v[1], len = v[2], names = v[3];
    if ((body_off_obj == Py_None) != (body_len_obj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "send: body_offsets and body_lengths go together");
        goto done;
    }
    if (body_off_obj != Py_None && (PyObject_GetBuffer(body_off_obj, &body_off, PyBUF_SIMPLE) < 0
                                    || PyObject_GetBuffer(body_len_obj, &body_len, PyBUF_SIMPLE) < 0))
        goto done;
    if (n < 0 || off.len < 4 * n || len.len < 4 * n || (names_obj != Py_None && names.len < NAME * n)
            || (body_off_obj != Py_None && (body_off.len < 4 * n || body_len.len < 4 * n))) {
        PyErr_SetString(PyExc_ValueError, "send: offsets and lengths (and bodies') need n uint32 each, names n "
                        "rows of 16 bytes");
        goto done;
    }
    b.n = n;
    b.buf = buf.buf;
    b.offsets = off.buf;
    b.lengths = len.buf;
    b.names = names_obj == Py_None ? NULL : names.buf;
    b.body_offsets = body_off_obj == Py_None ? NULL : body_off.buf;
    b.body_lengths = body_off_obj == Py_None ? NULL : body_len.buf;
    long long nbytes = checked_bytes(&b, buf.len, max_length);
    if (nbytes < 0)
        goto done;
    SendCounts c = {0};
    int fatal = send_batch(fd, &b, max_segments, &c);
    if (fatal < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = fatal ? os_error(fatal) : Py_BuildValue("LLLiL", c.sent, c.refused, c.calls, c.gso_errno, nbytes);
done:
    release_batch(v);
    PyBuffer_Release(&body_off);
    PyBuffer_Release(&body_len);
    return result;
}

typedef union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
} GroCmsg;

/* The segment size the kernel reported for a coalesced message, or 0. */
static int segment_size(struct msghdr *h) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof(size));
            return size;
        }
    return 0;
}

/* Whether vlen messages of stride bytes fit a buffer of len bytes, with room rows for their datagrams at least
 * (recv_batch's arrays live on the stack: RECV_VLEN messages at most). */
static int recv_fits(int vlen, Py_ssize_t stride, Py_ssize_t len, Py_ssize_t room) {
    return vlen >= 1 && vlen <= RECV_VLEN && stride >= 1 && (Py_ssize_t)vlen * stride <= len && room >= vlen;
}

/* What receives did: datagrams, messages, datagrams dropped for want of room, ICMP errors, bytes, and messages
 * longer than their stride (MSG_TRUNC), whose cut datagram was dropped. */
typedef struct {
    long long datagrams, messages, dropped, errors, nbytes, truncated;
} RecvCounts;

/* Receive up to vlen messages without waiting and split them, as recv() describes, into the room rows of
 * offsets, lengths and (unless NULL) names, counting into c (set, not added to); called with the GIL,
 * which it releases. Returns 0 or the errno that broke the socket. */
static int recv_batch(int fd, unsigned char *buf, Py_ssize_t stride, int vlen, uint32_t *offsets, uint32_t *lengths,
                      unsigned char *out_names, Py_ssize_t room, RecvCounts *c) {
    struct mmsghdr msgs[RECV_VLEN];
    struct iovec iov[RECV_VLEN];
    GroCmsg cmsgs[RECV_VLEN];
    unsigned char from[RECV_VLEN][NAME];
    long long datagrams = 0, dropped = 0, errors = 0, nbytes = 0, truncated = 0;
    int got = 0, fatal = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int j = 0; j < vlen; j++) {
        iov[j].iov_base = buf + j * stride;
        iov[j].iov_len = (size_t)stride;
        memset(&msgs[j].msg_hdr, 0, sizeof(struct msghdr));
        msgs[j].msg_hdr.msg_iov = &iov[j];
        msgs[j].msg_hdr.msg_iovlen = 1;
        msgs[j].msg_hdr.msg_name = from[j];
        msgs[j].msg_hdr.msg_namelen = NAME;
        msgs[j].msg_hdr.msg_control = cmsgs[j].buf;
        msgs[j].msg_hdr.msg_controllen = sizeof(cmsgs[j].buf);
    }
    for (;;) {
        got = recvmmsg(fd, msgs, (unsigned)vlen, MSG_DONTWAIT, NULL);
        if (got >= 0)
            break;
        int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) {
            got = 0;
            break;
        }
        if (err == EINTR)
            continue;
        if (!transient(err)) {
            fatal = err;
            break;
        }
        errors++;  /* an ICMP error reported late: a loss, and maybe data behind it */
    }
    for (int j = 0; j < got; j++) {
        Py_ssize_t size = msgs[j].msg_len, reported = segment_size(&msgs[j].msg_hdr), segment = reported;
        if (segment <= 0 || segment > size)
            segment = size;
        Py_ssize_t segments = size ? (size + segment - 1) / segment : 1;  /* an empty datagram is one too */
        if (msgs[j].msg_hdr.msg_flags & MSG_TRUNC) {  /* longer than the stride: what the cut fell in is lost */
            truncated++;  /* a datagram cut short (of a coalesced run: the one at the cut, those after it lost) */
            segments = reported > 0 && reported < size ? size / segment : 0;  /* a run's whole ones stand */
        }
        for (Py_ssize_t s = 0; s < segments; s++) {
            if (datagrams == room) {
                dropped += segments - s;
                break;
            }
            Py_ssize_t at = s * segment;
            offsets[datagrams] = (uint32_t)(j * stride + at);
            lengths[datagrams] = (uint32_t)(size - at < segment ? size - at : segment);
            nbytes += lengths[datagrams];
            if (out_names != NULL)
                memcpy(out_names + datagrams * NAME, from[j], NAME);
            datagrams++;
        }
    }
    Py_END_ALLOW_THREADS
    c->datagrams = datagrams;
    c->messages = got;
    c->dropped = dropped;
    c->errors = errors;
    c->nbytes = nbytes;
    c->truncated = truncated;
    return fatal;
}

PyDoc_STRVAR(recv_doc,
"recv(fd, buf, stride, messages, offsets, lengths, names) -> (datagrams, messages, dropped, errors, nbytes,\n"
"                                                             truncated)\n\n"
"Receive up to ``messages`` messages without waiting, message j into buf[j * stride:], and split each\n"
"by the segment size the kernel reports (UDP_GRO): datagram i is lengths[i] bytes at buf[offsets[i]:],\n"
"from the sockaddr_in in row i of names (None: not wanted). Datagrams beyond the room of offsets are\n"
"dropped and counted; errors counts ICMP errors the kernel reported instead of data. nbytes: the\n"
"datagrams' bytes (the caller's counters, without a pass of its own over lengths). truncated: messages\n"
"longer than stride (MSG_TRUNC), whose cut datagram is dropped, not handed on short.");

static PyObject *udp_recv(PyObject *self, PyObject *args) {
    int fd, vlen;
    Py_ssize_t stride;
    PyObject *buf_obj, *off_obj, *len_obj, *names_obj;
    if (!PyArg_ParseTuple(args, "iOniOOO", &fd, &buf_obj, &stride, &vlen, &off_obj, &len_obj, &names_obj))
        return NULL;
    PyObject *const objs[4] = {buf_obj, off_obj, len_obj, names_obj};
    Py_buffer v[4] = {{0}}, buf, off, len, names;
    PyObject *result = NULL;
    if (get_batch(objs, v, 1) < 0)
        goto done;
    buf = v[0], off = v[1], len = v[2], names = v[3];
    Py_ssize_t room = off.len / 4 < len.len / 4 ? off.len / 4 : len.len / 4;
    if (names_obj != Py_None && names.len / NAME < room)
        room = names.len / NAME;
    if (!recv_fits(vlen, stride, buf.len, room)) {
        PyErr_SetString(PyExc_ValueError, "recv: 1..256 messages of stride bytes must fit buf, and offsets, "
                        "lengths and names need a row per message at least");
        goto done;
    }
    RecvCounts c = {0};
    int fatal = recv_batch(fd, buf.buf, stride, vlen, off.buf, len.buf, names_obj == Py_None ? NULL : names.buf,
                           room, &c);
    result = fatal ? os_error(fatal) : Py_BuildValue("LiLLLL", c.datagrams, c.messages, c.dropped, c.errors, c.nbytes,
                                                 c.truncated);
done:
    release_batch(v);
    return result;
}

/* ---- the client's loop (client.Client._drive), for a connected socket ----------------------------- */

/* What drive() counts, in this order in its counts array (transport.UdpSocket.drive adds them to its stats). */
enum { C_SENT, C_SEND_CALLS, C_REFUSED, C_BYTES_SENT, C_RECV_CALLS, C_RECEIVED, C_BYTES_RECEIVED, C_DROPPED,
       C_GSO_ERRNO, C_TRUNCATED, N_COUNTS };
static const char *const count_names[N_COUNTS] = {"sent", "send_calls", "refused", "bytes_sent", "recv_calls",
                                                  "received", "bytes_received", "dropped", "gso_errno",
                                                  "truncated"};
static PyObject *s_emit, *s_done, *s_next_deadline, *s_receive_batch, *s_tick;  /* the stream's, interned */

static double monotonic(void) {  /* time.monotonic()'s clock */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* stream.name(args...) as a C value: a size (emit) or a float (next_deadline); -1 with an exception. */
static int call_size(PyObject *stream, PyObject *name, PyObject *a, PyObject *b, Py_ssize_t *n) {
    PyObject *r = PyObject_CallMethodObjArgs(stream, name, a, b, NULL);
    *n = r == NULL ? -1 : PyLong_AsSsize_t(r);
    Py_XDECREF(r);
    return *n == -1 && PyErr_Occurred() ? -1 : 0;
}

static int call_float(PyObject *stream, PyObject *name, double *x) {
    PyObject *r = PyObject_CallMethodObjArgs(stream, name, NULL);
    *x = r == NULL ? -1.0 : PyFloat_AsDouble(r);
    Py_XDECREF(r);
    return *x == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* n uint32 at items as a read-only memoryview of format "I": a numpy slice's stand-in (the Python
 * Reduction reads its tolist()). */
static PyObject *u32_view(uint32_t *items, Py_ssize_t n) {
    Py_buffer b;
    if (PyBuffer_FillInfo(&b, NULL, items, 4 * n, 1, PyBUF_FULL_RO) < 0)
        return NULL;
    Py_ssize_t shape = n, stride = 4;
    b.format = "I";
    b.itemsize = 4;
    b.ndim = 1;
    b.shape = &shape;  /* the memoryview copies shape and strides */
    b.strides = &stride;
    return PyMemoryView_FromBuffer(&b);
}

/* stream.receive_batch(buf, offsets[:got], lengths[:got], now) */
static int receive(PyObject *stream, PyObject *in, uint32_t *offsets, uint32_t *lengths, Py_ssize_t got,
                   PyObject *now) {
    PyObject *offs = u32_view(offsets, got);
    PyObject *lens = offs == NULL ? NULL : u32_view(lengths, got);
    PyObject *r = lens == NULL ? NULL : PyObject_CallMethodObjArgs(stream, s_receive_batch, in, offs, lens, now, NULL);
    Py_XDECREF(offs);
    Py_XDECREF(lens);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

PyDoc_STRVAR(drive_doc,
"drive(fd, stream, rows, offsets, lengths, max_segments, max_length, in_buf, stride, messages, in_offsets,\n"
"      in_lengths, wake, counts, advance=None) -> bool\n\n"
"The client's loop over a connected socket, in C: what ``stream`` has due goes out (``stream.emit(rows,\n"
"lengths)``, row i at ``offsets[i]`` of rows' bytes, sent as send() sends), then the socket is polled until\n"
"``stream.next_deadline()``, what came is received as recv() receives into ``in_buf`` and handed to\n"
"``stream.receive_batch(in_buf, offsets, lengths, now)`` (uint32 memoryviews), and ``stream.tick(now)`` and\n"
"``advance(stream, now)`` (unless None) run, turn after turn.\n"
"Returns True once ``stream.done``; False when ``wake`` seconds passed, a wait until then found nothing,\n"
"or the socket was shut for reading (``UdpSocket.interrupt``, at once), so that the caller can look\n"
"whether it is closing and call again. What the stream raises is\n"
"raised. ``counts`` (int64, one per name in DRIVE_COUNTS) is added to as the packets move, so it holds\n"
"what moved even when something raises; gso_errno is set where the kernel refused segmentation (the\n"
"rest of the call went out plainly).");

static PyObject *udp_drive(PyObject *self, PyObject *args) {
    int fd, messages;
    long max_segments;
    Py_ssize_t max_length, stride;
    double wake;
    PyObject *stream, *rows_obj, *off_obj, *len_obj, *in_obj, *in_off_obj, *in_len_obj, *counts_obj, *advance = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOOlnOniOOdO|O", &fd, &stream, &rows_obj, &off_obj, &len_obj, &max_segments,
                          &max_length, &in_obj, &stride, &messages, &in_off_obj, &in_len_obj, &wake, &counts_obj,
                          &advance))
        return NULL;
    Py_buffer rows = {0}, off = {0}, len = {0}, in = {0}, in_off = {0}, in_len = {0}, counts = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(off_obj, &off, PyBUF_SIMPLE) < 0
            || PyObject_GetBuffer(len_obj, &len, PyBUF_SIMPLE) < 0
            || PyObject_GetBuffer(in_obj, &in, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(in_off_obj, &in_off, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(in_len_obj, &in_len, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(counts_obj, &counts, PyBUF_WRITABLE) < 0)
        goto done;
    Py_ssize_t n_rows = off.len / 4 < len.len / 4 ? off.len / 4 : len.len / 4;
    Py_ssize_t room = in_off.len / 4 < in_len.len / 4 ? in_off.len / 4 : in_len.len / 4;
    if (!recv_fits(messages, stride, in.len, room) || counts.len < (Py_ssize_t)sizeof(long long) * N_COUNTS) {
        PyErr_SetString(PyExc_ValueError, "drive: 1..256 messages of stride bytes must fit in_buf, in_offsets and "
                        "in_lengths need a row per message at least, counts an int64 per DRIVE_COUNTS name");
        goto done;
    }
    long long *count = counts.buf;
    double end = monotonic() + wake;
    for (;;) {
        if (PyErr_CheckSignals() < 0)
            goto done;
        for (;;) {  /* what is due goes out */
            Py_ssize_t n;
            if (call_size(stream, s_emit, rows_obj, len_obj, &n) < 0)
                goto done;
            if (n == 0)
                break;
            if (n < 0 || n > n_rows) {
                PyErr_Format(PyExc_ValueError, "drive: emit gave %zd packets, the rows have offsets and lengths for "
                             "%zd", n, n_rows);
                goto done;
            }
            Batch b = {.n = n, .buf = rows.buf, .offsets = off.buf, .lengths = len.buf};
            long long nbytes = checked_bytes(&b, rows.len, max_length);
            if (nbytes < 0)
                goto done;
            SendCounts c = {0};
            int fatal = send_batch(fd, &b, max_segments, &c);
            count[C_SENT] += c.sent;
            count[C_SEND_CALLS] += c.calls;
            count[C_REFUSED] += c.refused;
            count[C_BYTES_SENT] += nbytes;
            if (c.gso_errno) {
                count[C_GSO_ERRNO] = c.gso_errno;
                max_segments = 1;
            }
            if (fatal) {
                if (fatal < 0)
                    PyErr_NoMemory();
                else
                    (void)os_error(fatal);
                goto done;
            }
        }
        PyObject *done_obj = PyObject_GetAttr(stream, s_done);
        int finished = done_obj == NULL ? -1 : PyObject_IsTrue(done_obj);
        Py_XDECREF(done_obj);
        if (finished < 0)
            goto done;
        if (finished) {
            result = Py_NewRef(Py_True);
            break;
        }
        double deadline, now = monotonic();
        if (now >= end) {
            result = Py_NewRef(Py_False);
            break;
        }
        if (call_float(stream, s_next_deadline, &deadline) < 0)
            goto done;
        now = monotonic();
        double wait = deadline - now < end - now ? deadline - now : end - now;
        int idle = 0;
        if (wait > 0) {  /* as UdpSocket.wait: whole milliseconds, rounded up (a day at most: an int) */
            struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
            int ready, err = 0, ms = wait < 86400.0 ? (int)(wait * 1000 + 0.999) : 86400000;
            Py_BEGIN_ALLOW_THREADS
            ready = poll(&p, 1, ms);
            err = errno;
            Py_END_ALLOW_THREADS
            if (ready < 0 && err != EINTR) {
                (void)os_error(err);
                goto done;
            }
            idle = ready == 0;
            if (ready > 0 && (p.revents & POLLRDHUP)) {  /* shut for reading (UdpSocket.interrupt): its */
                result = Py_NewRef(Py_False);               /* owner is closing, and looks at once */
                break;
            }
        }
        Py_ssize_t got = 0;
        if (!idle) {
            RecvCounts c;
            int fatal = recv_batch(fd, in.buf, stride, messages, in_off.buf, in_len.buf, NULL, room, &c);
            if (fatal) {
                (void)os_error(fatal);
                goto done;
            }
            count[C_RECV_CALLS]++;
            count[C_RECEIVED] += c.datagrams;
            count[C_BYTES_RECEIVED] += c.nbytes;
            count[C_DROPPED] += c.dropped;
            count[C_REFUSED] += c.errors;
            count[C_TRUNCATED] += c.truncated;
            got = (Py_ssize_t)c.datagrams;
        }
        PyObject *now_obj = PyFloat_FromDouble(monotonic());
        if (now_obj == NULL)
            goto done;
        int rc = got ? receive(stream, in_obj, in_off.buf, in_len.buf, got, now_obj) : 0;
        PyObject *r = rc < 0 ? NULL : PyObject_CallMethodObjArgs(stream, s_tick, now_obj, NULL);
        if (r != NULL && advance != Py_None) {
            Py_DECREF(r);
            r = PyObject_CallFunctionObjArgs(advance, stream, now_obj, NULL);
        }
        Py_DECREF(now_obj);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        if (idle) {
            result = Py_NewRef(Py_False);
            break;
        }
    }
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&off);
    PyBuffer_Release(&len);
    PyBuffer_Release(&in);
    PyBuffer_Release(&in_off);
    PyBuffer_Release(&in_len);
    PyBuffer_Release(&counts);
    return result;
}

static PyMethodDef methods[] = {
    {"send", udp_send, METH_VARARGS, send_doc},
    {"recv", udp_recv, METH_VARARGS, recv_doc},
    {"drive", udp_drive, METH_VARARGS, drive_doc},
    {NULL, NULL, 0, NULL},
};
#else
static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};  /* not Linux: transport.py's plain backend */
#endif

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "switchagg._udp",
    "Batched UDP sends and receives with segmentation offload (Linux); see _udp.c.", -1, methods,
};

#ifdef __linux__
/* drive()'s method names, interned once, and DRIVE_COUNTS: the names of its counts, in order. */
static int add_drive_names(PyObject *m) {
    PyObject **names[] = {&s_emit, &s_done, &s_next_deadline, &s_receive_batch, &s_tick};
    const char *texts[] = {"emit", "done", "next_deadline", "receive_batch", "tick"};
    for (int i = 0; i < 5; i++)
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return -1;
    PyObject *counted = PyTuple_New(N_COUNTS);
    for (int i = 0; counted != NULL && i < N_COUNTS; i++) {
        PyObject *name = PyUnicode_FromString(count_names[i]);
        if (name == NULL)
            Py_CLEAR(counted);
        else
            PyTuple_SET_ITEM(counted, i, name);
    }
    int rc = counted == NULL ? -1 : PyModule_AddObjectRef(m, "DRIVE_COUNTS", counted);
    Py_XDECREF(counted);
    return rc;
}
#endif

PyMODINIT_FUNC PyInit__udp(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef __linux__
    if (m != NULL && (PyModule_AddIntConstant(m, "UDP_SEGMENT", UDP_SEGMENT) < 0
                      || PyModule_AddIntConstant(m, "UDP_GRO", UDP_GRO) < 0
                      || PyModule_AddIntConstant(m, "SOL_UDP", SOL_UDP) < 0
                      || PyModule_AddIntConstant(m, "RECV_VLEN", RECV_VLEN) < 0 || add_drive_names(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
