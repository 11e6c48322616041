/* Branch: whether a reduce-scatter's owner (a rank of the job's tree) is under a child of the job, which
 * decides whether that child gets the chunk's sum whole or its header alone (docs/protocol.md sections
 * 4b and 10). A host child holds one rank, a switch child the ranks of its subtree: child c of a job
 * holds `span` ranks from `base` on, one entry per child. Applied only to a chunk with FLAG_OWNER, once
 * in ingress (a repeat answered from the stored sum) and once in egress (each replica of a finished
 * one), where the header's job and worker name the job and the child. */

control Branch(inout headers_t hdr) {
    /* owner - base < span in 16 bits: below base wraps around to past every span */
    action ranks(bit<16> base, bit<16> span) {
        hdr.local.whole = (bit<8>)(bit<1>)((bit<16>)hdr.sa.owner_count[23:16] - base < span);
    }
    action no_ranks() {
        hdr.local.whole = 0;
    }

    table branch {
        key = {
            hdr.sa.job: exact;
            hdr.sa.version_type_flags_worker & SA_WORKER_BITS: exact @name("worker");
        }
        actions = { ranks; no_ranks; }
        default_action = no_ranks();
        size = SA_ADMISSION_SIZE;
    }

    apply {
        branch.apply();
    }
}
