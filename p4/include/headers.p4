/* Headers: Ethernet, IPv4, UDP, and the switchagg header of switchagg/wire.py (FIELDS order). */
#ifndef SWITCHAGG_HEADERS_P4
#define SWITCHAGG_HEADERS_P4

typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;

header ethernet_h {
    mac_addr_t dst_addr;
    mac_addr_t src_addr;
    bit<16>    ether_type;
}

/* IPv4 and UDP in the fields switchagg writes (the addresses, ports and UDP checksum), the rest
 * grouped: BMv2 pays per field on every extract, emit, replica and checksum, not per bit, and
 * reads the grouped ones only through masks. The bytes are the usual 20-byte and 8-byte headers. */
header ipv4_h {
    bit<32>     ver_ihl_tos_len;    /* version [31:28], ihl [27:24], DSCP/ECN [23:16], total length [15:0] */
    bit<48>     id_frag_ttl_proto;  /* identification [47:32], flags [31:29], fragment offset [28:16],
                                     * TTL [15:8], protocol [7:0] */
    bit<16>     hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<32> length_checksum;  /* length [31:16], checksum [15:0] */
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
    ethernet_h         ethernet;
    ipv4_h             ipv4;
    udp_h              udp;
    switchagg_h        sa;
    switchagg_values_h vals;
    sa_local_h         local;  /* working state: never valid, never emitted (metadata.p4) */
}

#endif
