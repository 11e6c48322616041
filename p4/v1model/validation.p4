/* Validation: the checks on a packet to the switchagg port that is not a contribution of K values
 * the parser found well formed (a probe, a query, a contribution of another K, a parent's RESULT of
 * its header alone or of another K, or a malformed packet), in SwitchModel.process_frame's order.
 * What it drops, it counts by reason and strips of its switchagg header, so that admission skips it;
 * a probe, a query, a RESULT or another K keeps it and goes on to admission (which takes a RESULT
 * only from a parent, docs/protocol.md section 10). */

control Validation(inout headers_t hdr, inout standard_metadata_t std)(counter<bit<32>> drops) {
    action drop() {
        mark_to_drop(std);
        hdr.sa.setInvalid();
    }

    /* One action per reason, each counting a constant: a parameter chosen per call site would cost
     * a temporary of the program, which BMv2 resets on every packet. */
    action drop_malformed() {
        drops.count(SA_DROP_MALFORMED);
        drop();
    }
    action drop_bad_version() {
        drops.count(SA_DROP_BAD_VERSION);
        drop();
    }

    /* The datagram is what the IPv4 and UDP lengths say, not what the frame holds (which may go on
     * past it): the two lengths must agree, the frame must hold the whole datagram, and the datagram
     * the whole header, before the header's version counts. Lengths are compared in 32 bits, where
     * neither 20 + the UDP length nor 4 * count wraps around (in 16 bits, a count 16384 higher would
     * give the same length). */
    apply {
        if (!hdr.sa.isValid()
                || (bit<32>)hdr.outer.head[207:192] != 20 + (bit<32>)hdr.outer.head[31:16]   /* IPv4 length */
                || hdr.outer.head[31:16] < 8 + SA_HEADER_BYTES                              /* UDP length */
                || std.packet_length < 14 + (bit<32>)hdr.outer.head[207:192]) {
            drop_malformed();
        } else if (hdr.sa.version_type_flags_worker[31:24] != SA_VERSION) {
            drop_bad_version();
        } else if ((bit<32>)hdr.outer.head[31:16]
                       != 8 + (bit<32>)SA_HEADER_BYTES + ((bit<32>)hdr.sa.owner_count[15:0] << 2)  /* count */
                || (hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_CONTRIB
                    && hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_PROBE
                    && hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_QUERY
                    && hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_RESULT)
                || hdr.sa.version_type_flags_worker[15:8] & ~(SA_FLAG_COPY | SA_FLAG_OWNER) != 0
                /* an owner without FLAG_OWNER */
                || (hdr.sa.owner_count[23:16] != 0 && hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS == 0)
                || hdr.sa.version_type_flags_worker[7:0] >= SA_MAX_WORKERS
                /* a probe or a query with values */
                || (hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_CONTRIB
                    && hdr.sa.version_type_flags_worker[23:16] != SA_TYPE_RESULT && hdr.sa.owner_count[15:0] != 0)) {
            drop_malformed();
        }
    }
}
