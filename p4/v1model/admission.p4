/* Admission: the checks before a packet is tied to a job, and the table the control plane fills,
 * (job, worker, source IP, source UDP port, key) -> the job's parameters, one entry per worker (a
 * job reset rewrites the generation). What is dropped here is counted by reason in global_drops.
 *
 * The common case is one condition: hdr.vals is valid only for a contribution of K values that the
 * parser found well formed (version, type, flags, reserved bits, worker, count and lengths). The
 * other packets to the switchagg port are told apart off that path; BMv2 evaluates every operator
 * of a condition (no short circuit), so the common path must not carry their tests. */

control Admission(inout headers_t hdr, inout standard_metadata_t std) {
    counter(SA_NUM_GLOBAL_DROPS, CounterType.packets) global_drops;

    /* What admission drops loses its switchagg header, so that a valid one after admission means
     * admitted (a flag in metadata would cost a reset on every packet). */
    action drop() {
        mark_to_drop(std);
        hdr.sa.setInvalid();
    }

    /* One action per reason, each counting a constant: a parameter chosen per call site would cost
     * a temporary of the program, which BMv2 resets on every packet. */
    action drop_malformed() {
        global_drops.count(SA_DROP_MALFORMED);
        drop();
    }
    action drop_bad_version() {
        global_drops.count(SA_DROP_BAD_VERSION);
        drop();
    }
    action drop_not_admitted() {
        global_drops.count(SA_DROP_NOT_ADMITTED);
        drop();
    }

    action admit(bit<32> job_index, bit<8> n_workers, bit<16> slot_base, bit<16> slot_count,
                 bit<32> generation) {
        hdr.local.job_index = job_index;
        hdr.local.n_workers = n_workers;
        hdr.local.slot_count = slot_count;
        hdr.local.generation = generation;
        /* the copy's register index, 2 * (slot_base + slot) + copy (used only once slot < slot_count) */
        hdr.local.idx = (((bit<32>)slot_base + (bit<32>)hdr.sa.slot) << 1) | (bit<32>)(hdr.sa.flags & SA_FLAG_COPY);
    }

    table admission {
        key = {
            hdr.sa.job: exact;
            hdr.sa.worker: exact;
            hdr.outer.ip_src: exact;
            hdr.outer.udp_src: exact;
            hdr.sa.key: exact;
        }
        actions = { admit; drop_not_admitted; }
        default_action = drop_not_admitted();
        size = 2048;
    }

    /* The same checks, in the same order, as SwitchModel.process. */
    apply {
        if (hdr.vals.isValid()) {
            admission.apply();
        } else if (!hdr.sa.isValid()) {
            drop_malformed();
        } else if (hdr.sa.version != SA_VERSION) {
            drop_bad_version();
        } else if (std.parser_error != error.NoError
                || hdr.outer.udp_length_checksum[31:16] != 8 + SA_HEADER_BYTES + (hdr.sa.count << 2)
                || hdr.outer.ver_ihl_tos_len[15:0] != 20 + hdr.outer.udp_length_checksum[31:16]
                || (hdr.sa.type != SA_TYPE_CONTRIB && hdr.sa.type != SA_TYPE_PROBE)
                || (hdr.sa.flags & ~SA_FLAG_COPY) != 0 || hdr.sa.reserved != 0
                || hdr.sa.worker >= SA_MAX_WORKERS
                || (hdr.sa.type == SA_TYPE_PROBE && hdr.sa.count != 0)) {
            drop_malformed();
        } else {
            admission.apply();  /* a probe, or a contribution of another K */
        }
    }
}
