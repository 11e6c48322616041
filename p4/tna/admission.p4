/* Admission: the table the control plane fills, (job, worker, source IP, source UDP port, key) -> the
 * job's parameters, one entry per worker (a job reset rewrites the generation of its entries). It is
 * looked up for every switchagg header in the first stage, whether or not the packet later proves
 * well formed, so that a contribution reaches the tag stage one stage later; what validation drops
 * never uses what it found. */

control Admission(inout sa_headers_t hdr, inout sa_ingress_metadata_t md) {
    /* The job's parameters, and what the next stage tests them by: the copy's slot in the pool, the
     * job's slot count less the packet's slot, saturating at 0 (0 when the job has no such slot). The
     * packet's generation is its run's (the session the workers agreed on), not compared with the
     * job's: the next stage takes any but 0 straight from the header, and the job's installed
     * generation is only what a probe's reply carries. The workers as bitmaps, so that no stage shifts: worker_bit
     * is 1 << worker, all_workers (1 << n) - 1, other_workers all_workers without worker_bit.
     * recirc_port is the recirculation port of the pipe the job's workers are on. */
    action admit(bit<16> job_index, bit<16> slot_base, bit<16> slot_count, bit<32> generation,
#ifdef SA_TREES
                 bit<32> worker_bit, bit<32> other_workers, bit<32> all_workers, PortId_t recirc_port,
                 bit<32> parent_bit) {
#else
                 bit<32> worker_bit, bit<32> other_workers, bit<32> all_workers, PortId_t recirc_port) {
#endif
#ifdef SA_TREES
        md.parent_bit = parent_bit;
#endif
        md.admitted = 1;
        md.job_index = job_index;
        md.cell = slot_base + hdr.sa.slot;
        md.generation = generation;
        md.slot_room = slot_count |-| hdr.sa.slot;
        md.worker_bit = worker_bit;
        md.other_workers = other_workers;
        md.all_workers = all_workers;
        md.recirc_port = recirc_port;
    }

#ifdef SA_TREES
    /* A level of a tree: its parent's RESULT, which names the parent's job, this switch's index among the
     * parent's children and the parent's key. From here on it is a RESULT of this switch's job (`job`,
     * `key`), the parent's bit its worker bit, the children the other workers: it takes the parent's
     * result where a copy holds exactly the children's sum (aggregation.p4). */
    action admit_result(bit<16> job_index, bit<16> slot_base, bit<16> slot_count, bit<32> other_workers,
                        bit<32> all_workers, PortId_t recirc_port, bit<32> parent_bit, bit<16> job, bit<32> key) {
        md.admitted = 1;
        md.job_index = job_index;
        md.cell = slot_base + hdr.sa.slot;
        md.slot_room = slot_count |-| hdr.sa.slot;
        md.worker_bit = parent_bit;
        md.other_workers = other_workers;
        md.all_workers = all_workers;
        md.recirc_port = recirc_port;
        md.parent_bit = parent_bit;
        hdr.sa.job = job;
        hdr.sa.key = key;
    }
#endif

    table admission {
        key = {
            hdr.sa.job: exact @name("job");
            hdr.sa.worker: exact @name("worker");
            hdr.ipv4.src_addr: exact @name("src_addr");
            hdr.udp.src_port: exact @name("src_port");
            hdr.sa.key: exact @name("key");
#ifdef SA_TREES
            /* bit 0 of the type, as v1model's key: 0 for a RESULT alone of the types that reach admission
             * (CONTRIB 1, PROBE 3, QUERY 5, RESULT 2), so a worker's entry (1) never takes a RESULT, nor
             * the parent's (0) a worker's packet */
            hdr.sa.type[0:0]: exact @name("type_bit");
#endif
        }
#ifdef SA_TREES
        actions = { admit; admit_result; @defaultonly NoAction; }
#else
        actions = { admit; @defaultonly NoAction; }
#endif
        const default_action = NoAction();
        size = SA_ADMISSION_SIZE;
    }

    apply {
        admission.apply();
    }
}
