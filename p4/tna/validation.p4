/* Validation: the checks on a packet to the switchagg port that is not a contribution of K values
 * the parser found well formed (a probe, a contribution of another K, or a malformed packet), in
 * SwitchModel.process_frame's order: the datagram's lengths first (IPv4 against UDP, the header
 * within them), then the header's version, then its other fields. md.count_global is set for a packet
 * that fails; one that passes goes on to admission's verdict (main.p4).
 *
 * The lengths are worked out in 16 bits, and the checks make that exact (as v1model's 32-bit ones):
 * IPv4 length - UDP length = 20 only wraps for an IPv4 length under 20, which is malformed first; a
 * count of 16384 or more makes 4 * count wrap, and no datagram is that long, so it is malformed
 * first; below that, UDP length - 4 * count = 32 only wraps for a UDP length under 32, which is
 * malformed first.
 *
 * Tofino's ingress does not know a frame's length, so one check of v1model's is left to the parser:
 * a frame that ends before its datagram does. The parser reads a contribution of K values and a
 * probe to their last byte, so a frame cut short of them is malformed here as on BMv2 (the parser
 * error); a datagram of another length is not read to its end, and a frame cut short of it is
 * counted by the header's other faults instead (docs/tofino.md). */

control Validation(in sa_headers_t hdr, inout sa_ingress_metadata_t md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {
    action malformed() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_MALFORMED;
    }
    action bad_version() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_BAD_VERSION;
    }

    action lengths() {
        md.ip_minus_udp = hdr.ipv4.total_len - hdr.udp.length;
        md.count_bytes = hdr.sa.count << 2;
    }
    action count_length() {
        md.udp_minus_count = hdr.udp.length - md.count_bytes;
    }

    apply {
        lengths();
        count_length();
        if (!hdr.sa.isValid() || ig_prsr_md.parser_err != 0
                || hdr.ipv4.total_len < 20 || md.ip_minus_udp != 20
                || hdr.udp.length < 8 + SA_HEADER_BYTES) {
            malformed();
        } else if (hdr.sa.version != SA_VERSION) {
            bad_version();
        } else if (hdr.sa.count[15:14] != 0 || md.udp_minus_count != 8 + SA_HEADER_BYTES
                || (hdr.sa.type != SA_TYPE_CONTRIB && hdr.sa.type != SA_TYPE_PROBE)
                || hdr.sa.flags & ~SA_FLAG_COPY != 0
                || hdr.sa.reserved != 0
                || hdr.sa.worker >= SA_MAX_WORKERS
                || (hdr.sa.type == SA_TYPE_PROBE && hdr.sa.count != 0)) {
            malformed();
        }
    }
}
