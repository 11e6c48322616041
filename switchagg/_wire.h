/* The switchagg header as switchagg/wire.py defines it (FIELDS), for the C that writes and parses
 * packets (_stream.c, _switch.c): offsets, constants, big-endian access. _native exposes them as
 * HEADER_LAYOUT and WIRE, and tests/test_wire.py holds those to wire.py. */
#ifndef SWITCHAGG_WIRE_H
#define SWITCHAGG_WIRE_H

#include <stdint.h>

#define HEADER_SIZE 24
#define VERSION 1
#define TYPE_CONTRIB 1
#define TYPE_RESULT 2
#define TYPE_PROBE 3
#define TYPE_PROBE_REPLY 4
#define TYPE_QUERY 5
#define TYPE_PENDING 6
#define FLAG_COPY 1
#define FLAG_OWNER 2 /* a reduce-scatter's chunk: the sum goes whole only to `owner` (wire.py) */
#define EXP_NONE (-128)
#define EXP_NONFINITE 127  /* wire.EXP_NONFINITE: a chunk that held NaN or infinity on some rank */
#define MAX_WORKERS 32

/* Byte offsets of the fields (version, type, flags, worker, exponent and owner are one byte;
 * job, slot and count two; chunk, generation and key four). */
#define OFF_VERSION 0
#define OFF_TYPE 1
#define OFF_FLAGS 2
#define OFF_WORKER 3
#define OFF_JOB 4
#define OFF_SLOT 6
#define OFF_CHUNK 8
#define OFF_GENERATION 12
#define OFF_KEY 16
#define OFF_EXPONENT 20
#define OFF_OWNER 21
#define OFF_COUNT 22

static inline uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void put16(unsigned char *p, uint16_t v) { p[0] = v >> 8; p[1] = (unsigned char)v; }
static inline void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = (unsigned char)(v >> 16); p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}

#endif
