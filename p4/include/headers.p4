/* The protocol's headers as they are on the wire, one P4 field per wire field: Ethernet, IPv4 (no
 * options: a switchagg packet has none), UDP and the 24-byte switchagg header of switchagg/wire.py
 * (FIELDS, in order and width; tests/test_p4_source.py checks them). The TNA program uses these as
 * they are. The v1model program reads the same bytes through wider fields (p4/v1model/include/headers.p4),
 * because BMv2 pays per field and not per bit. The values that follow the switchagg header are
 * declared by each program: how K = SA_VALUES int32 values are best held differs by target. */
#ifndef SWITCHAGG_HEADERS_P4
#define SWITCHAGG_HEADERS_P4

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;        /* reserved, don't fragment, more fragments */
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* The switchagg header: 24 bytes, big-endian, the fields of switchagg/wire.py in order. */
header switchagg_h {
    bit<8>  version;
    bit<8>  type;
    bit<8>  flags;       /* bit 0: the slot's shadow copy; bit 1: FLAG_OWNER (owner below); bits 2-7 must be 0 */
    bit<8>  worker;      /* rank 0..31; in a RESULT, the recipient */
    bit<16> job;
    bit<16> slot;        /* within the job's range */
    bit<32> chunk;       /* compared in serial-number order */
    bit<32> generation;
    bit<32> key;
    int<8>  exponent;    /* the proposal (CONTRIB) or the maximum kept (RESULT); -128: none */
    bit<8>  owner;       /* with FLAG_OWNER, the rank a reduce-scatter's sum goes to whole; else 0 */
    bit<16> count;       /* K, the int32 values that follow */
}

#endif
