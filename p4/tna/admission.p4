/* Admission: the table the control plane fills, (job, worker, source IP, source UDP port, key) -> the
 * job's parameters, one entry per worker (a job reset rewrites the generation of its entries). It is
 * looked up for every switchagg header in the first stage, whether or not the packet later proves
 * well formed, so that a contribution reaches the tag stage one stage later; what validation drops
 * never uses what it found. */

control Admission(in sa_headers_t hdr, inout sa_ingress_metadata_t md) {
    /* The job's parameters, and what the next stage tests them by: the copy's slot in the pool, the
     * job's slot count less the packet's slot, saturating at 0 (0 when the job has no such slot). The
     * packet's generation is its run's (the session the workers agreed on), not compared with the
     * job's: the next stage takes any but 0 straight from the header, and the job's installed
     * generation is only what a probe's reply carries. The workers as bitmaps, so that no stage shifts: worker_bit
     * is 1 << worker, all_workers (1 << n) - 1, other_workers all_workers without worker_bit.
     * recirc_port is the recirculation port of the pipe the job's workers are on. */
    action admit(bit<16> job_index, bit<16> slot_base, bit<16> slot_count, bit<32> generation,
                 bit<32> worker_bit, bit<32> other_workers, bit<32> all_workers, PortId_t recirc_port) {
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

    table admission {
        key = {
            hdr.sa.job: exact @name("job");
            hdr.sa.worker: exact @name("worker");
            hdr.ipv4.src_addr: exact @name("src_addr");
            hdr.udp.src_port: exact @name("src_port");
            hdr.sa.key: exact @name("key");
        }
        actions = { admit; @defaultonly NoAction; }
        const default_action = NoAction();
        size = SA_ADMISSION_SIZE;
    }

    apply {
        admission.apply();
    }
}
