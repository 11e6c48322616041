/* Parser, checksums and deparser (v1model). */

parser SaParser(packet_in pkt, out headers_t hdr, inout sa_metadata_t meta,
                inout standard_metadata_t std) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            0x0800: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        /* ihl 5, fragment offset 0, protocol UDP; masks rather than slices, which p4c would copy
         * into temporaries first */
        transition select(hdr.ipv4.version_ihl_diffserv, hdr.ipv4.id_flags_frag, hdr.ipv4.ttl_protocol) {
            (0x0500 &&& 0x0f00, 0 &&& 0x1fff, 17 &&& 0xff): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            SA_UDP_PORT: parse_sa;
            default: accept;
        }
    }
    state parse_sa {
        pkt.extract(hdr.sa);  /* too short: parser_error is set and admission counts it malformed */
        /* The values are parsed only for a well-formed contribution of K values (version, type,
         * flags, reserved bits, worker < 32, count and both lengths): admission takes a valid
         * hdr.vals as that common case, with no further test. */
        transition select(hdr.sa.version, hdr.sa.type, hdr.sa.flags, hdr.sa.reserved, hdr.sa.worker, hdr.sa.count,
                          hdr.udp.length, hdr.ipv4.total_len) {
            (SA_VERSION, SA_TYPE_CONTRIB, 0 &&& (bit<8>)~SA_FLAG_COPY, 0, 0 &&& (bit<8>)~(SA_MAX_WORKERS - 1),
             SA_VALUES, SA_CONTRIB_UDP_BYTES, SA_CONTRIB_IP_BYTES): parse_values;
            default: accept;
        }
    }
    state parse_values {
        pkt.extract(hdr.vals);
        transition accept;
    }
}

control SaVerifyChecksum(inout headers_t hdr, inout sa_metadata_t meta) {
    apply { }
}

control SaComputeChecksum(inout headers_t hdr, inout sa_metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version_ihl_diffserv, hdr.ipv4.total_len, hdr.ipv4.id_flags_frag,
              hdr.ipv4.ttl_protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

control SaDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.sa);
        pkt.emit(hdr.vals);
    }
}
