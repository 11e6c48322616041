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
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, 17): parse_udp;
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
        meta.is_sa = 1;
        pkt.extract(hdr.sa);  /* too short: parser_error is set and ingress counts it malformed */
        transition select(hdr.sa.count) {
            SA_VALUES: parse_values;
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
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
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
