/* Parser, checksums and deparser (v1model). */

parser SaParser(packet_in pkt, out headers_t hdr, inout sa_metadata_t meta,
                inout standard_metadata_t std) {
    state start {
        pkt.extract(hdr.outer);  /* a frame of under 42 bytes is left with no valid header and dropped */
        /* IPv4 with ihl 5 and fragment offset 0, UDP, to the switchagg port */
        transition select(hdr.outer.ether_type, hdr.outer.ver_ihl_tos_len, hdr.outer.id_frag_ttl_proto,
                          hdr.outer.udp) {
            (0x0800, 0x05000000 &&& 0x0f000000, 17 &&& 0x00001fff00ff,
             (bit<64>)SA_UDP_PORT << 32 &&& 0x0000ffff00000000): parse_sa;
            default: accept;
        }
    }
    state parse_sa {
        pkt.extract(hdr.sa);  /* too short: parser_error is set and admission counts it malformed */
        /* The values are parsed only for a well-formed contribution of K values (version, type,
         * flags, reserved bits, worker < 32, count and both lengths): admission takes a valid
         * hdr.vals as that common case, with no further test. */
        transition select(hdr.sa.version, hdr.sa.type, hdr.sa.flags, hdr.sa.reserved, hdr.sa.worker, hdr.sa.count,
                          hdr.outer.udp, hdr.outer.ver_ihl_tos_len) {
            (SA_VERSION, SA_TYPE_CONTRIB, 0 &&& (bit<8>)~SA_FLAG_COPY, 0, 0 &&& (bit<8>)~(SA_MAX_WORKERS - 1),
             SA_VALUES, (bit<64>)SA_CONTRIB_UDP_BYTES << 16 &&& 0xffff0000,
             (bit<32>)SA_CONTRIB_IP_BYTES &&& 0xffff): parse_values;
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
        /* only a switchagg packet is rewritten; other frames leave as they came */
        update_checksum(hdr.sa.isValid(),
            { hdr.outer.ver_ihl_tos_len, hdr.outer.id_frag_ttl_proto, hdr.outer.ip_addrs },
            hdr.outer.ip_checksum, HashAlgorithm.csum16);
    }
}

control SaDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.outer);
        pkt.emit(hdr.sa);
        pkt.emit(hdr.vals);
    }
}
