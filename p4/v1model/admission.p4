/* Admission: (job, worker, source IP, source UDP port, key) -> the job's parameters.
 * The control plane installs one entry per worker; a job reset rewrites the generation. */

control Admission(inout headers_t hdr, inout sa_metadata_t meta) {
    action admit(bit<16> job_index, bit<8> n_workers, bit<16> slot_base, bit<16> slot_count,
                 bit<16> mcast_grp, bit<32> generation) {
        meta.admitted = 1;
        meta.job_index = job_index;
        meta.n_workers = n_workers;
        meta.slot_base = slot_base;
        meta.slot_count = slot_count;
        meta.mcast_grp = mcast_grp;
        meta.generation = generation;
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
