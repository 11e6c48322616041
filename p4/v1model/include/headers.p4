/* The v1model program's headers: the bytes of p4/include/headers.p4, held the way BMv2 processes
 * them cheaply. BMv2 pays per header (its valid bit set and cleared, the emit, the copy into a
 * replica) and per field (extracted, emitted, copied, and re-encoded whenever written), not per bit
 * (docs/protocol.md, section 8). So Ethernet, IPv4 and UDP are one field, the switchagg header is 7,
 * and the K values are one. */
#ifndef SWITCHAGG_V1MODEL_HEADERS_P4
#define SWITCHAGG_V1MODEL_HEADERS_P4

/* Ethernet, IPv4 and UDP as one 42-byte field, extracted from every frame. The program reads it
 * through the masks below and writes it whole. In a frame that is not IPv4 and UDP, the bytes past
 * the Ethernet header are not IPv4 and UDP: only the Ethernet destination is read there, and the
 * frame leaves unchanged. */
header outer_h {
    bit<336> head;
}

/* Where each field sits in outer_h.head: Ethernet destination and source, EtherType; IPv4 version and
 * IHL, DSCP/ECN, total length, identification, flags and fragment offset, TTL, protocol, checksum,
 * source and destination; UDP source port, destination port, length and checksum. */
#define OUTER_ETH_DST     ((bit<336>)0xffffffffffff << 288)
#define OUTER_ETH_SRC     ((bit<336>)0xffffffffffff << 240)
#define OUTER_ETHER_TYPE  ((bit<336>)0xffff << 224)
#define OUTER_IHL         ((bit<336>)0x0f << 216)
#define OUTER_IP_LENGTH   ((bit<336>)0xffff << 192)
#define OUTER_FRAGMENT    ((bit<336>)0x3fff << 160)  /* more fragments, fragment offset */
#define OUTER_PROTOCOL    ((bit<336>)0xff << 144)
#define OUTER_IP_CHECKSUM ((bit<336>)0xffff << 128)
#define OUTER_IP_SRC      ((bit<336>)0xffffffff << 96)
#define OUTER_IP_DST      ((bit<336>)0xffffffff << 64)
#define OUTER_UDP_SRC     ((bit<336>)0xffff << 48)
#define OUTER_UDP_DST     ((bit<336>)0xffff << 32)
#define OUTER_UDP_LENGTH  ((bit<336>)0xffff << 16)
/* What a RESULT of the header alone (a reduce-scatter's, to a worker that does not own the chunk) has
 * less than one of K values, in the IPv4 and the UDP length: 4 * SA_VALUES bytes each */
#define OUTER_VALUES_IN_LENGTHS ((bit<336>)(4 * SA_VALUES) << 192 | (bit<336>)(4 * SA_VALUES) << 16)
/* From the EtherType to the IPv4 protocol: what a reply keeps */
#define OUTER_ETHER_TYPE_TO_IP_PROTOCOL ((bit<336>)0xffffffffffffffffffffffff << 144)
/* Five 32-bit lanes (at bits 0, 32, .., 128) of 16 bits each, for the IPv4 checksum of a reply
 * (aggregation.p4, reply_to_sender): head >> 80 masked by the first holds the IPv4 header's words
 * 1, 3, .., 9 (counting from 1), head >> 64 masked by the second its words 2, 4, .., 10 less the
 * checksum (word 6). Their sum holds the header's sum in five parts, which a product by the third
 * adds up in its lane at bit 128. */
#define IP_WORD_LANES              ((bit<336>)0x0000ffff0000ffff0000ffff0000ffff0000ffff)
#define IP_WORD_LANES_BUT_CHECKSUM ((bit<336>)0x0000ffff0000ffff000000000000ffff0000ffff)
#define IP_WORD_LANE_ONES          ((bit<336>)0x0000000100000001000000010000000100000001)

/* The switchagg header (p4/include/headers.p4's switchagg_h) in 7 fields: the ones the program
 * writes or counts by stand alone; neighbours it only reads, or writes together, share one P4 field
 * named after them (tests/test_p4_source.py checks the names and widths against wire.py). */
header switchagg_packed_h {
    bit<32> version_type_flags_worker;
    bit<16> job;
    bit<16> slot;
    bit<64> chunk_generation;
    bit<32> key;
    bit<8>  exponent;   /* int8 on the wire; compared as signed in the exponent stage */
    bit<24> owner_count;
}

/* Where each field sits in the shared ones */
#define SA_VERSION_BITS    32w0xff000000
#define SA_TYPE_BITS       32w0x00ff0000
#define SA_FLAGS_BITS      32w0x0000ff00
#define SA_WORKER_BITS     32w0x000000ff
#define SA_TYPE_BIT_0      32w0x00010000  /* 0 for a RESULT alone of the types admission sees (admission.p4) */
#define SA_GENERATION_BITS 64w0x00000000ffffffff
#define SA_OWNER_BITS      24w0xff0000  /* in owner_count */
#define SA_COUNT_BITS      24w0x00ffff
/* FLAG_OWNER where version_type_flags_worker holds it */
const bit<32> SA_OWNER_FLAG_BITS = (bit<32>)SA_FLAG_OWNER << 8;

/* What turns a contribution's type into a result's, a probe's into a reply's and a query's into a
 * PENDING, in place (xor on version_type_flags_worker) */
const bit<32> SA_CONTRIB_TO_RESULT = (bit<32>)(SA_TYPE_CONTRIB ^ SA_TYPE_RESULT) << 16;
const bit<32> SA_PROBE_TO_REPLY = (bit<32>)(SA_TYPE_PROBE ^ SA_TYPE_PROBE_REPLY) << 16;
const bit<32> SA_QUERY_TO_PENDING = (bit<32>)(SA_TYPE_QUERY ^ SA_TYPE_PENDING) << 16;

/* K = SA_VALUES int32 values (two's complement, summed modulo 2^32) as one field of 32 * SA_VALUES
 * bits: value j is bits [32K-1-32j : 32K-32-32j], which is the wire order. BMv2 pays per field and
 * per primitive, not per bit, so one wide field costs a K-th of K narrow ones. */
header switchagg_values_h {
    bit<2048> values;  /* 32 * SA_VALUES */
}

/* Bit 31 of each of the K 32-bit values in the values field (aggregation.p4's carry-less add). */
#define SA_VALUE_TOPS 2048w0x80000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000

struct headers_t {
    outer_h            outer;
    switchagg_packed_h sa;
    switchagg_values_h vals;
    sa_local_h         local;  /* working state: never valid, never emitted (metadata.p4) */
}

#endif
