/* Validation: the checks on a packet to the switchagg port that is not a contribution of K values or
 * a query the parser found well formed (a probe, a contribution of another K, or a malformed packet), in
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
 * a frame that ends before its datagram does. The parser reads a contribution of K values, a
 * probe and a query to their last byte, so a frame cut short of them is malformed here as on BMv2
 * (the parser error); a datagram of another length is not read to its end, and a frame cut short of
 * it is counted by the header's other faults instead (docs/tofino.md). */

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

    /* The lengths, then the header, in the model's order, as one ternary match (the entries are
     * tried in order). The IPv4 length under 20 (two entries: 0-15, 16-19) or the UDP length under
     * the header's: malformed. Then the two well-formed kinds: version 1, a CONTRIB or a PROBE (the
     * latter of no values), no flag but the copy, worker < 32, no reserved bits, the IPv4 length 20
     * more than the UDP length, and the UDP length 32 + 4 * count (a count under 16384, see above).
     * With the lengths right, any other version 1 header is malformed, and any other version
     * bad_version; with them wrong, malformed (the default). A QUERY is malformed here too: a
     * well-formed one took the contribution's path (main.p4), so this one has values, reserved bits,
     * a flag, a worker or an IPv4 length that is wrong. */
    action well_formed() { }

    table checks {
        key = {
            hdr.ipv4.total_len: ternary;
            hdr.udp.length: ternary;
            md.ip_minus_udp: ternary;
            hdr.sa.version: ternary;
            hdr.sa.type: ternary;
            hdr.sa.flags: ternary;
            hdr.sa.worker: ternary;
            hdr.sa.owner: ternary;
            hdr.sa.count: ternary;
            md.udp_minus_count: ternary;
        }
        actions = { well_formed; malformed; bad_version; }
        const entries = {
            (0 &&& 0xfff0, _, _, _, _, _, _, _, _, _): malformed();
            (16 &&& 0xfffc, _, _, _, _, _, _, _, _, _): malformed();
            (_, 0 &&& 0xffe0, _, _, _, _, _, _, _, _): malformed();
            (_, _, 20, SA_VERSION, SA_TYPE_CONTRIB, 0 &&& ~SA_FLAG_COPY, 0 &&& ~((bit<8>)SA_MAX_WORKERS - 1), 0,
             0 &&& 0xc000, 8 + SA_HEADER_BYTES): well_formed();
            (_, _, 20, SA_VERSION, SA_TYPE_PROBE, 0 &&& ~SA_FLAG_COPY, 0 &&& ~((bit<8>)SA_MAX_WORKERS - 1), 0,
             0, 8 + SA_HEADER_BYTES): well_formed();
#ifdef SA_TREES
            /* a parent's RESULT of another count: admission's verdict, then bad_count, as a contribution's */
            (_, _, 20, SA_VERSION, SA_TYPE_RESULT, 0 &&& ~SA_FLAG_COPY, 0 &&& ~((bit<8>)SA_MAX_WORKERS - 1), 0,
             0 &&& 0xc000, 8 + SA_HEADER_BYTES): well_formed();
#endif
            (_, _, 20, SA_VERSION, _, _, _, _, _, _): malformed();
            (_, _, 20, _, _, _, _, _, _, _): bad_version();
        }
        const default_action = malformed();
        size = 8;
    }

    /* A header the frame does not hold (the parser stopped in it or in the values) is malformed. */
    apply {
        lengths();
        count_length();
        if (!hdr.sa.isValid() || ig_prsr_md.parser_err != 0) {
            malformed();
        } else {
            checks.apply();
        }
    }
}
