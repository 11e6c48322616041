/* Admission: the table the control plane fills, (job, worker, source IP, source UDP port, key) ->
 * the job's parameters, one entry per worker (a job reset rewrites the generation), and in a tree one
 * more for the parent's RESULTs (docs/protocol.md section 10). It is applied to every frame and
 * matches only a valid switchagg header (a key of the table), so the common case reaches its job's
 * aggregation with no condition tested; a switchagg packet it does not find is dropped and counted.
 *
 * The worker key holds bit 0 of the type too, which is 0 for a RESULT alone of the types validation
 * lets through (CONTRIB 1, PROBE 3, QUERY 5, RESULT 2): a worker's entry holds 1 there, a parent's 0,
 * so a RESULT never finds a worker's entry nor a contribution the parent's, with nothing tested. */

control Admission(inout headers_t hdr, inout standard_metadata_t std)(counter<bit<32>> drops) {
    Aggregation() aggregation;

    /* The job's parameters come packed as hdr.local.job holds them (metadata.p4), which the control
     * plane does: BMv2 pays per field written, and p4c's ++ costs as many operators as it has bits
     * to place. */
    action admit(bit<16> slot_base, bit<64> job, bit<24> owners) {
        hdr.local.job = job;
        hdr.local.owners = owners;
        /* the copy's register index, 2 * (slot_base + slot) + copy (used only once slot < slot_count) */
        hdr.local.idx = (((bit<32>)slot_base + (bit<32>)hdr.sa.slot) << 1)
                        | hdr.sa.version_type_flags_worker >> 8 & (bit<32>)SA_FLAG_COPY;
    }
    /* The parent's RESULT, which names the parent's job, this switch's index among its children and the
     * parent's key: from here on it is a RESULT of this switch's job (`job_id`, `key`), whose counters
     * count it and whose children it goes down to. No owner is below owners (0): it never takes the
     * contributions' path, and the owner limit is in job (LOCAL_OWNERS). */
    action admit_result(bit<16> slot_base, bit<64> job, bit<16> job_id, bit<32> key) {
        hdr.local.job = job;
        hdr.local.owners = 0;
        hdr.local.idx = (((bit<32>)slot_base + (bit<32>)hdr.sa.slot) << 1)
                        | hdr.sa.version_type_flags_worker >> 8 & (bit<32>)SA_FLAG_COPY;
        hdr.sa.job = job_id;
        hdr.sa.key = key;
    }
    action drop_not_admitted() {
        drops.count(SA_DROP_NOT_ADMITTED);
        mark_to_drop(std);
    }
    /* A RESULT from anyone but a parent of one of the jobs (as on a switch with no tree) */
    action drop_malformed() {
        drops.count(SA_DROP_MALFORMED);
        mark_to_drop(std);
    }

    table admission {
        key = {
            hdr.sa.isValid(): exact @name("sa_valid");
            hdr.sa.job: exact;
            hdr.sa.version_type_flags_worker & (SA_TYPE_BIT_0 | SA_WORKER_BITS): exact @name("worker");
            hdr.outer.head & (OUTER_IP_SRC | OUTER_UDP_SRC): exact @name("source");  /* IPv4 address, UDP port */
            hdr.sa.key: exact;
        }
        actions = { admit; admit_result; NoAction; }
        default_action = NoAction();
        size = SA_ADMISSION_SIZE;
    }

    apply {
        if (admission.apply().hit) {
            aggregation.apply(hdr, std);
        } else if (hdr.sa.isValid()) {
            if (hdr.sa.version_type_flags_worker & SA_TYPE_BITS == (bit<32>)SA_TYPE_RESULT << 16) {
                drop_malformed();
            } else {
                drop_not_admitted();
            }
        }
    }
}
