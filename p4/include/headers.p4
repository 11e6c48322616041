/* Headers: Ethernet, IPv4 and UDP as one, and the switchagg header of switchagg/wire.py (FIELDS order). */
#ifndef SWITCHAGG_HEADERS_P4
#define SWITCHAGG_HEADERS_P4

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;

/* Ethernet, IPv4 and UDP as one 42-byte header, extracted from every frame: BMv2 pays per header
 * (its valid bit set, cleared, and each header emitted and copied) as well as per field, and
 * switchagg reads the three together. The fields are the ones switchagg writes, the rest grouped and
 * read through masks. In a frame that is not IPv4 and UDP, the bytes past the Ethernet header are
 * not IPv4 and UDP: only eth_dst is read there, and the frame leaves unchanged. */
header outer_h {
    bit<96>     eth_addrs;            /* destination [95:48], source [47:0] */
    bit<16>     ether_type;
    bit<32>     ver_ihl_tos_len;      /* version [31:28], ihl [27:24], DSCP/ECN [23:16], total length [15:0] */
    bit<48>     id_frag_ttl_proto;    /* identification [47:32], flags [31:29], fragment offset [28:16],
                                       * TTL [15:8], protocol [7:0] */
    bit<16>     ip_checksum;
    bit<64>     ip_addrs;             /* source [63:32], destination [31:0] */
    bit<64>     udp;                  /* source port [63:48], destination port [47:32], length [31:16],
                                       * checksum [15:0] */
}

/* The switchagg header: 24 bytes, big-endian, fields as in switchagg/wire.py. */
header switchagg_h {
    bit<8>  version;
    bit<8>  type;
    bit<8>  flags;
    bit<8>  worker;
    bit<16> job;
    bit<16> slot;
    bit<32> chunk;
    bit<32> generation;
    bit<32> key;
    bit<8>  exponent;   /* int8 on the wire; compared as signed in the exponent stage */
    bit<8>  reserved;
    bit<16> count;
}

/* K = 64 int32 values (two's complement, summed modulo 2^32) as one 2048-bit field: value j is
 * bits [2047-32j : 2016-32j], which is the wire order. BMv2 pays per field and per primitive, not
 * per bit, so one wide field costs a sixty-fourth of 64 narrow ones; on Tofino it is 64 32-bit
 * registers again, one stateful ALU each. */
header switchagg_values_h {
    bit<2048> values;
}

struct headers_t {
    outer_h            outer;
    switchagg_h        sa;
    switchagg_values_h vals;
    sa_local_h         local;  /* working state: never valid, never emitted (metadata.p4) */
}

#endif
