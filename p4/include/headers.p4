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

/* K = 64 int32 values (two's complement, summed modulo 2^32). */
header switchagg_values_h {
    bit<32> v00;
    bit<32> v01;
    bit<32> v02;
    bit<32> v03;
    bit<32> v04;
    bit<32> v05;
    bit<32> v06;
    bit<32> v07;
    bit<32> v08;
    bit<32> v09;
    bit<32> v10;
    bit<32> v11;
    bit<32> v12;
    bit<32> v13;
    bit<32> v14;
    bit<32> v15;
    bit<32> v16;
    bit<32> v17;
    bit<32> v18;
    bit<32> v19;
    bit<32> v20;
    bit<32> v21;
    bit<32> v22;
    bit<32> v23;
    bit<32> v24;
    bit<32> v25;
    bit<32> v26;
    bit<32> v27;
    bit<32> v28;
    bit<32> v29;
    bit<32> v30;
    bit<32> v31;
    bit<32> v32;
    bit<32> v33;
    bit<32> v34;
    bit<32> v35;
    bit<32> v36;
    bit<32> v37;
    bit<32> v38;
    bit<32> v39;
    bit<32> v40;
    bit<32> v41;
    bit<32> v42;
    bit<32> v43;
    bit<32> v44;
    bit<32> v45;
    bit<32> v46;
    bit<32> v47;
    bit<32> v48;
    bit<32> v49;
    bit<32> v50;
    bit<32> v51;
    bit<32> v52;
    bit<32> v53;
    bit<32> v54;
    bit<32> v55;
    bit<32> v56;
    bit<32> v57;
    bit<32> v58;
    bit<32> v59;
    bit<32> v60;
    bit<32> v61;
    bit<32> v62;
    bit<32> v63;
}

struct headers_t {
    ethernet_h         ethernet;
    ipv4_h             ipv4;
    udp_h              udp;
    switchagg_h        sa;
    switchagg_values_h vals;
}

#endif
