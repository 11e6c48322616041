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

header ipv4_h {
    bit<4>      version;
    bit<4>      ihl;
    bit<8>      diffserv;
    bit<16>     total_len;
    bit<16>     identification;
    bit<3>      flags;
    bit<13>     frag_offset;
    bit<8>      ttl;
    bit<8>      protocol;
    bit<16>     hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
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

/* K = 64 int32 values (two's complement, summed modulo 2^32), eight to a 256-bit lane: value
 * 8*i+j is bits [255-32j : 224-32j] of lane i, which is the wire order. BMv2 pays per field and per
 * primitive, not per bit, so eight lanes cost an eighth of 64 fields; on Tofino each lane is eight
 * 32-bit registers again. */
header switchagg_values_h {
    bit<256> lane0;
    bit<256> lane1;
    bit<256> lane2;
    bit<256> lane3;
    bit<256> lane4;
    bit<256> lane5;
    bit<256> lane6;
    bit<256> lane7;
}

struct headers_t {
    ethernet_h         ethernet;
    ipv4_h             ipv4;
    udp_h              udp;
    switchagg_h        sa;
    switchagg_values_h vals;
}

#endif
