/* Admission: (job, worker, source IP, source UDP port, key) -> the job's parameters.
 * The control plane installs one entry per worker; a job reset rewrites the generation. */

control Admission(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    action admit(bit<16> job_index, bit<8> n_workers, bit<16> slot_base, bit<16> slot_count,
                 bit<16> mcast_grp, bit<32> generation) {
        meta.job_index = (bit<32>)job_index;
        meta.n_workers = n_workers;
        meta.slot_count = slot_count;
        meta.generation = generation;
        /* the copy's register index, 2 * (slot_base + slot) + copy (used only once slot < slot_count) */
        meta.idx = (((bit<32>)slot_base + (bit<32>)hdr.sa.slot) << 1) | (bit<32>)(hdr.sa.flags & SA_FLAG_COPY);
        /* where a finished sum goes; every other outcome drops (mark_to_drop clears it) or replies
         * to the sender (which clears it) */
        std.mcast_grp = mcast_grp;
    }

    table admission {
        key = {
            hdr.sa.job: exact;
            hdr.sa.worker: exact;
            hdr.ipv4.src_addr: exact;
            hdr.udp.src_port: exact;
            hdr.sa.key: exact;
        }
        actions = { admit; NoAction; }
        default_action = NoAction();
        size = 2048;
    }

    apply {
        admission.apply();
    }
}
