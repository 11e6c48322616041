/* Admission: the table the control plane fills, (job, worker, source IP, source UDP port, key) ->
 * the job's parameters, one entry per worker (a job reset rewrites the generation). It is applied
 * to every frame and matches only a valid switchagg header (a key of the table), so the common
 * case reaches its job's aggregation with no condition tested; a switchagg packet it does not
 * find is dropped and counted. */

control Admission(inout headers_t hdr, inout standard_metadata_t std)(counter<bit<32>> drops) {
    Aggregation() aggregation;

    /* The job's parameters come packed as hdr.local.job holds them (metadata.p4), which the control
     * plane does: BMv2 pays per field written, and p4c's ++ costs as many operators as it has bits
     * to place. */
    action admit(bit<16> slot_base, bit<64> job) {
        hdr.local.job = job;
        /* the copy's register index, 2 * (slot_base + slot) + copy (used only once slot < slot_count) */
        hdr.local.idx = (((bit<32>)slot_base + (bit<32>)hdr.sa.slot) << 1)
                        | hdr.sa.version_type_flags_worker >> 8 & (bit<32>)SA_FLAG_COPY;
    }
    action drop_not_admitted() {
        drops.count(SA_DROP_NOT_ADMITTED);
        mark_to_drop(std);
    }

    table admission {
        key = {
            hdr.sa.isValid(): exact @name("sa_valid");
            hdr.sa.job: exact;
            hdr.sa.version_type_flags_worker & SA_WORKER_BITS: exact @name("worker");
            hdr.outer.head & (OUTER_IP_SRC | OUTER_UDP_SRC): exact @name("source");  /* IPv4 address, UDP port */
            hdr.sa.key: exact;
        }
        actions = { admit; NoAction; }
        default_action = NoAction();
        size = SA_ADMISSION_SIZE;
    }

    apply {
        if (admission.apply().hit) {
            aggregation.apply(hdr, std);
        } else if (hdr.sa.isValid()) {
            drop_not_admitted();
        }
    }
}
