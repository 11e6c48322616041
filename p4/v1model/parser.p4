/* Parser, checksums and deparser (v1model). */

parser SaParser(packet_in pkt, out headers_t hdr, inout sa_metadata_t meta,
                inout standard_metadata_t std) {
    state start {
        pkt.extract(hdr.outer);  /* a frame of under 42 bytes is left with no valid header and dropped */
        /* IPv4 with ihl 5 and fragment offset 0, UDP, to the switchagg port */
        transition select(hdr.outer.head) {
            (bit<336>)0x0800 << 224 | (bit<336>)5 << 216 | (bit<336>)17 << 144 | (bit<336>)SA_UDP_PORT << 32
            &&& OUTER_ETHER_TYPE | OUTER_IHL | OUTER_FRAG_OFFSET | OUTER_PROTOCOL | OUTER_UDP_DST: parse_sa;
            default: accept;
        }
    }
    state parse_sa {
        pkt.extract(hdr.sa);  /* too short: parser_error is set and admission counts it malformed */
        /* The values are parsed only for a well-formed contribution of K values (version, type,
         * flags, reserved bits, worker < 32, count and both lengths): admission takes a valid
         * hdr.vals as that common case, with no further test. */
        transition select(hdr.sa.version_type_flags_worker, hdr.sa.reserved_count, hdr.outer.head) {
            ((bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_CONTRIB << 16
             &&& SA_VERSION_BITS | SA_TYPE_BITS | (bit<32>)(bit<8>)~SA_FLAG_COPY << 8
                 | (bit<32>)(bit<8>)~(SA_MAX_WORKERS - 1),
             (bit<24>)SA_VALUES,
             (bit<336>)SA_CONTRIB_IP_BYTES << 192 | (bit<336>)SA_CONTRIB_UDP_BYTES << 16
             &&& OUTER_IP_LENGTH | OUTER_UDP_LENGTH): parse_values;
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

/* Nothing to compute: a reply swaps the IPv4 addresses, which leaves the checksum as it was, and
 * a multicast result gets a whole new IPv4 header from the control plane, checksum included
 * (egress.p4). UDP checksums are 0 (none). */
control SaComputeChecksum(inout headers_t hdr, inout sa_metadata_t meta) {
    apply { }
}

control SaDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.outer);
        pkt.emit(hdr.sa);
        pkt.emit(hdr.vals);
    }
}
