/* Parser, checksums and deparser (v1model). */

parser SaParser(packet_in pkt, out headers_t hdr, inout sa_metadata_t meta,
                inout standard_metadata_t std) {
    state start {
        pkt.extract(hdr.outer);  /* a frame of under 42 bytes is left with no valid header and dropped */
        /* IPv4 with a 20-byte header (ihl 5), not a fragment (neither more fragments nor an offset), UDP,
         * to the switchagg port. With options or in fragments it is ordinary traffic, whose frames to
         * the switch itself forwarding.p4 counts. */
        transition select(hdr.outer.head) {
            (bit<336>)0x0800 << 224 | (bit<336>)5 << 216 | (bit<336>)17 << 144 | (bit<336>)SA_UDP_PORT << 32
            &&& OUTER_ETHER_TYPE | OUTER_IHL | OUTER_FRAGMENT | OUTER_PROTOCOL | OUTER_UDP_DST: parse_sa;
            default: accept;
        }
    }
    state parse_sa {
        /* The header is read from the frame, which may end before it (parser_error is then set, and
         * validation counts the frame malformed) or go on past the datagram: validation checks that the
         * IPv4 and UDP lengths hold it before it looks at its version. */
        pkt.extract(hdr.sa);
        /* The values are parsed only for a well-formed contribution of K values (version, type,
         * flags, worker < 32, count and both lengths; an owner only with FLAG_OWNER): admission takes
         * a valid hdr.vals as that common case, with no further test but the owner's rank
         * (aggregation.p4). An allreduce's chunk (no owner) matches the first entry, a reduce-scatter's
         * the second; a parent's RESULT of K values (docs/protocol.md section 10) the last two, which
         * the common case never reaches. */
        transition select(hdr.sa.version_type_flags_worker, hdr.sa.owner_count, hdr.outer.head) {
            ((bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_CONTRIB << 16
             &&& SA_VERSION_BITS | SA_TYPE_BITS | (bit<32>)(bit<8>)~SA_FLAG_COPY << 8
                 | (bit<32>)~((bit<8>)SA_MAX_WORKERS - 1),
             (bit<24>)SA_VALUES,
             (bit<336>)SA_CONTRIB_IP_BYTES << 192 | (bit<336>)SA_CONTRIB_UDP_BYTES << 16
             &&& OUTER_IP_LENGTH | OUTER_UDP_LENGTH): parse_values;
            ((bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_CONTRIB << 16 | SA_OWNER_FLAG_BITS
             &&& SA_VERSION_BITS | SA_TYPE_BITS | (bit<32>)(bit<8>)~SA_FLAG_COPY << 8
                 | (bit<32>)~((bit<8>)SA_MAX_WORKERS - 1),
             (bit<24>)SA_VALUES &&& SA_COUNT_BITS,
             (bit<336>)SA_CONTRIB_IP_BYTES << 192 | (bit<336>)SA_CONTRIB_UDP_BYTES << 16
             &&& OUTER_IP_LENGTH | OUTER_UDP_LENGTH): parse_values;
            ((bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_RESULT << 16
             &&& SA_VERSION_BITS | SA_TYPE_BITS | (bit<32>)(bit<8>)~SA_FLAG_COPY << 8
                 | (bit<32>)~((bit<8>)SA_MAX_WORKERS - 1),
             (bit<24>)SA_VALUES,
             (bit<336>)SA_CONTRIB_IP_BYTES << 192 | (bit<336>)SA_CONTRIB_UDP_BYTES << 16
             &&& OUTER_IP_LENGTH | OUTER_UDP_LENGTH): parse_values;
            ((bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_RESULT << 16 | SA_OWNER_FLAG_BITS
             &&& SA_VERSION_BITS | SA_TYPE_BITS | (bit<32>)(bit<8>)~SA_FLAG_COPY << 8
                 | (bit<32>)~((bit<8>)SA_MAX_WORKERS - 1),
             (bit<24>)SA_VALUES &&& SA_COUNT_BITS,
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

/* Nothing to compute here: a reply's IPv4 checksum is worked out with the reply (aggregation.p4,
 * reply_to_sender), where only replies pay for it, and a multicast result gets a whole new IPv4
 * header from the control plane, checksum included (egress.p4). UDP checksums are 0 (none). Incoming
 * IPv4 checksums are not verified (docs/protocol.md, section 1). */
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
