/* What happens to an admitted packet: the aggregation state, the order one packet touches it
 * (docs/protocol.md, section 8): tag -> bitmap and count (one register) -> exponent -> values, each
 * register read-modify-written at most once and each stage deciding only from the packet and
 * earlier stages -- what a Tofino stateful ALU can do, so the TNA port is a translation: there each
 * step below is a RegisterAction of its register (bitmap and count a register pair). Registers are
 * indexed by 2 * (slot_base + slot) + copy. A packet carries its run's session generation, which the
 * tag keeps apart from every other run's (another generation's state reads as empty); any generation
 * but 0 is taken, and power-up zeros read as empty because a packet of generation 0 is dropped. Then
 * the outcome: counted, multicast, unicast back, or dropped, each counted per job.
 *
 * The tag stage decides whether the chunk is new to the copy (fresh), the one it holds, or older
 * (stale), and the control flow picks the outcome as soon as the stages before it allow, running
 * it as one action with the stages it needs: BMv2 pays about 800 instructions per action called,
 * besides its primitives. What is left to choose within an action is a mask (-(bit<N>)flag is all
 * ones when the flag is 1), with no ?: in an action: BMv2 pays per field assignment and per
 * operator, and p4c (run without LocalCopyPropagation, switchagg/control/build.py) spills a ternary
 * into two temporaries (docs/protocol.md, section 8). */

control Aggregation(inout headers_t hdr, inout standard_metadata_t std) {
    Branch() branch;
    register<bit<64>, bit<32>>(SA_NUM_COPIES) tag;      /* chunk id ++ generation held by the copy */
    register<bit<64>, bit<32>>(SA_NUM_COPIES) workers;  /* workers counted: how many [39:32], which [31:0] */
    register<bit<8>, bit<32>>(SA_NUM_COPIES) exponent;  /* max proposed exponent (int8) */
    register<bit<2048>, bit<32>>(SA_NUM_COPIES) values;  /* the K sums, 32 bits each */

    /* Per job: one array per event of switchagg.jobs.JobCounter, named after it and indexed
     * by the job's id, so that counting needs neither index arithmetic nor a field from admission. */
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_contributions;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_results_multicast;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_results_unicast;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_probes;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_wrong_generation;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_slot_out_of_range;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_bad_count;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_stale;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_duplicate_pending;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_queries;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_results_to_owner;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_bad_owner;
    /* A tree's events (docs/protocol.md section 10) */
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_partials_up;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_partials_resent;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_results_from_parent;
    counter<bit<16>>(SA_NUM_JOB_IDS, CounterType.packets) job_unexpected_result;

    /* Stage 1: is the chunk new to the copy (other generation, or newer in serial-number order on
     * 32-bit ids: chunk - held in 1 .. 2^31 - 1), the one it holds, or older (stale)? Only a new
     * chunk changes the tag. Tag and packet both hold chunk ++ generation: with the generations
     * equal (the low halves), packet - tag is (chunk - held) << 32, so the serial-number test is one
     * 64-bit comparison. A query reads the tag and decides alike (read_tag), and writes nothing. */
    action read_tag() {
        tag.read(hdr.local.tag, hdr.local.idx);
        hdr.local.fresh = (bit<64>)(bit<1>)((hdr.local.tag ^ hdr.sa.chunk_generation) & SA_GENERATION_BITS != 0
                                   || hdr.sa.chunk_generation - hdr.local.tag - 0x100000000 < 0x7fffffff00000000);
    }
    action tag_stage() {
        read_tag();
        hdr.local.tag = hdr.local.tag ^ ((hdr.local.tag ^ hdr.sa.chunk_generation) & (0 - hdr.local.fresh));
        tag.write(hdr.local.idx, hdr.local.tag);
    }

    /* A fresh chunk starts the copy afresh, reading none of it: the worker's bit alone, a count of
     * 1, its exponent proposal, its values. */
    action start_copy() {
        hdr.local.workers = LOCAL_COUNT_ONE | 64w1 << hdr.sa.version_type_flags_worker[7:0];
        workers.write(hdr.local.idx, hdr.local.workers);
        exponent.write(hdr.local.idx, hdr.sa.exponent);
        values.write(hdr.local.idx, hdr.vals.values);
    }

    /* The chunk the copy holds, stages 2 and 3 (one register): the worker's bit (already set: a
     * repeat), and the count, which a repeat leaves as it is. */
    action count_worker() {
        workers.read(hdr.local.workers, hdr.local.idx);
        hdr.local.seen = hdr.local.workers >> hdr.sa.version_type_flags_worker[7:0] & 1;
        hdr.local.workers = (hdr.local.workers | 64w1 << hdr.sa.version_type_flags_worker[7:0])
                            + ((hdr.local.seen ^ 1) << 32);  /* one more when not seen */
        workers.write(hdr.local.idx, hdr.local.workers);
    }

    /* A new worker's contribution, stages 4 and 5. The exponent: the signed max, b ^ ((a ^ b) &
     * -(a > b)) written out, a > b compared in offset binary (int8 + 128, where the unsigned order
     * is the signed order). The values: 64 independent 32-bit adds (modulo 2^32, no carry between
     * values): add the low 31 bits of each value, then put each value's bit 31 back as the xor of
     * both inputs' bit 31 and the carry into it. The packet carries both on, into the registers and
     * on to the result. */
    action add_contribution() {
        exponent.read(hdr.local.exponent, hdr.local.idx);
        hdr.sa.exponent = hdr.local.exponent ^ ((hdr.sa.exponent ^ hdr.local.exponent)
                          & (0 - (bit<8>)(bit<1>)((hdr.sa.exponent ^ 0x80) > (hdr.local.exponent ^ 0x80))));
        exponent.write(hdr.local.idx, hdr.sa.exponent);
        values.read(hdr.local.held, hdr.local.idx);
        hdr.vals.values = ((hdr.local.held & ~SA_VALUE_TOPS) + (hdr.vals.values & ~SA_VALUE_TOPS))
                          ^ ((hdr.local.held ^ hdr.vals.values) & SA_VALUE_TOPS);
        values.write(hdr.local.idx, hdr.vals.values);
    }

    /* A repeat of a finished round, stages 4 and 5: the result it missed, read into the packet. */
    action read_result() {
        exponent.read(hdr.sa.exponent, hdr.local.idx);
        values.read(hdr.vals.values, hdr.local.idx);
    }

    /* The outcomes. A contribution counted into a sum that is not finished yet: nothing to send. */
    action counted() {
        job_contributions.count(hdr.sa.job);
        mark_to_drop(std);
    }
    /* The last contribution: the sum to every worker of the job, through the job's multicast group
     * (job index + 1). Egress makes each replica a RESULT to its worker, from the switch. */
    action result_to_all() {
        job_contributions.count(hdr.sa.job);
        job_results_multicast.count(hdr.sa.job);
        std.mcast_grp = (bit<16>)hdr.local.job[47:40];
    }
    /* The last contribution to a reduce-scatter's chunk (FLAG_OWNER): through the same group, whose
     * replicas egress strips of the values but the owner's (docs/protocol.md section 4b). */
    action result_to_owner() {
        job_contributions.count(hdr.sa.job);
        job_results_to_owner.count(hdr.sa.job);
        std.mcast_grp = (bit<16>)hdr.local.job[47:40];
    }
    /* Back to the sender, from the switch's own addresses (the ones the packet was sent to) and
     * its switchagg port: the addresses swapped, the rest of the IPv4 header kept but its checksum,
     * which is worked out afresh (the packet's own may be wrong: it is not verified), the UDP
     * checksum 0 (none). The checksum is the complement of the one's-complement sum of the header's
     * 16-bit words but itself, which the swap leaves as it is: the words, added in five 32-bit lanes
     * (IP_WORD_LANES), summed by a product into one lane (under 2^20), folded into 16 bits twice. */
    action reply_to_sender() {
        hdr.local.checksum = ((hdr.outer.head >> 80 & IP_WORD_LANES)
                              + (hdr.outer.head >> 64 & IP_WORD_LANES_BUT_CHECKSUM)) * IP_WORD_LANE_ONES >> 128
                             & 0xffffffff;
        hdr.local.checksum = (hdr.local.checksum >> 16) + (hdr.local.checksum & 0xffff);  /* at most 0xffff + 15 */
        hdr.outer.head = hdr.outer.head & (OUTER_ETHER_TYPE_TO_IP_PROTOCOL | OUTER_UDP_LENGTH)
                         | ~(hdr.local.checksum + (hdr.local.checksum >> 16)) << 128 & OUTER_IP_CHECKSUM
                         | hdr.outer.head << 48 & OUTER_ETH_DST | hdr.outer.head >> 48 & OUTER_ETH_SRC
                         | hdr.outer.head << 32 & OUTER_IP_SRC | hdr.outer.head >> 32 & OUTER_IP_DST
                         | (bit<336>)SA_UDP_PORT << 48 | hdr.outer.head >> 16 & OUTER_UDP_DST;
        std.egress_spec = std.ingress_port;
    }
    /* The stored sum back to a worker that sent its contribution again. */
    action result_to_sender() {
        job_results_unicast.count(hdr.sa.job);
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker ^ SA_CONTRIB_TO_RESULT;
        reply_to_sender();
    }
    /* A tree's (docs/protocol.md section 10). The copy's sum goes up as one contribution of the parent's
     * job through the uplink group (job [47:40], 128 + the job's group), whose one replica egress
     * addresses to the parent (egress.p4, to_parent); the copy keeps it, count n (AWAITING). */
    action partial_up() {
        job_contributions.count(hdr.sa.job);
        job_partials_up.count(hdr.sa.job);
        std.mcast_grp = (bit<16>)hdr.local.job[47:40];
    }
    /* Child 0's repeat while the parent's sum is awaited: the stored partial up again. */
    action resend_up() {
        read_result();
        job_partials_resent.count(hdr.sa.job);
        std.mcast_grp = (bit<16>)hdr.local.job[47:40];
    }
    /* The parent's RESULT for a copy that awaits it: stored (count n + 1, HELD; the values where it
     * has them, else the partial stays, which no child gets whole) and sent down to every child through
     * the job's group (job [46:40]), as a finished sum is. */
    action take_header() {
        hdr.local.workers = hdr.local.workers + LOCAL_COUNT_ONE;
        workers.write(hdr.local.idx, hdr.local.workers);
        exponent.write(hdr.local.idx, hdr.sa.exponent);
        job_results_from_parent.count(hdr.sa.job);
        std.mcast_grp = (bit<16>)hdr.local.job[46:40];
    }
    action take_result() {
        take_header();
        values.write(hdr.local.idx, hdr.vals.values);
    }
    action read_count() {
        workers.read(hdr.local.workers, hdr.local.idx);
    }
    action drop_unexpected_result() {
        job_unexpected_result.count(hdr.sa.job);
        mark_to_drop(std);
    }

    /* A reduce-scatter's chunk repeated by a worker that does not own it: the result's header alone, with
     * the exponent kept (count 0, no values, K values' bytes fewer in both lengths, before the reply's
     * checksum is worked out). */
    action header_to_sender() {
        job_results_unicast.count(hdr.sa.job);
        exponent.read(hdr.sa.exponent, hdr.local.idx);
        hdr.vals.setInvalid();
        hdr.sa.owner_count = hdr.sa.owner_count & SA_OWNER_BITS;
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker ^ SA_CONTRIB_TO_RESULT;
        hdr.outer.head = hdr.outer.head - OUTER_VALUES_IN_LENGTHS;
        reply_to_sender();
    }
    action probe_reply() {
        job_probes.count(hdr.sa.job);
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker ^ SA_PROBE_TO_REPLY;
        hdr.sa.chunk_generation = hdr.sa.chunk_generation & ~SA_GENERATION_BITS | hdr.local.job & SA_GENERATION_BITS;
        reply_to_sender();
    }
    /* A query the copy is not stale for (docs/protocol.md section 5): a PENDING back to the sender,
     * the same header but the type, with the copy's bitmap in the key where the copy holds the
     * chunk, else (a fresh chunk: not arrived yet, or the copy empty) 0. It reads the workers
     * register and writes nothing. */
    action pending_reply() {
        job_queries.count(hdr.sa.job);
        workers.read(hdr.local.workers, hdr.local.idx);
        hdr.sa.key = (bit<32>)(hdr.local.workers & (hdr.local.fresh - 1));
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker ^ SA_QUERY_TO_PENDING;
        reply_to_sender();
    }
    action drop_duplicate_pending() {
        job_duplicate_pending.count(hdr.sa.job);
        mark_to_drop(std);
    }
    action drop_stale() {
        job_stale.count(hdr.sa.job);
        mark_to_drop(std);
    }
    action drop_wrong_generation() {
        job_wrong_generation.count(hdr.sa.job);
        mark_to_drop(std);
    }
    action drop_slot_out_of_range() {
        job_slot_out_of_range.count(hdr.sa.job);
        mark_to_drop(std);
    }
    action drop_bad_count() {
        job_bad_count.count(hdr.sa.job);
        mark_to_drop(std);
    }
    action drop_bad_owner() {
        job_bad_owner.count(hdr.sa.job);
        mark_to_drop(std);
    }

    /* Each outcome's steps in one action where the outcome is known before them (BMv2 pays per
     * action called as well as per primitive). */
    action start_copy_counted() {
        start_copy();
        counted();
    }
    action add_contribution_counted() {
        add_contribution();
        counted();
    }
    action add_contribution_to_all() {
        add_contribution();
        result_to_all();
    }
    action add_contribution_to_owner() {
        add_contribution();
        result_to_owner();
    }
    action add_contribution_up() {
        add_contribution();
        partial_up();
    }
    action start_copy_up() {
        start_copy();
        partial_up();
    }

    /* An admitted packet, with the same outcome as SwitchModel.process: the common case (a
     * contribution of K values of a run's generation, any but 0, to a slot of the job, its owner one
     * of the tree's ranks: 0 without FLAG_OWNER, which the parser checked) is tested first, each
     * outcome is decided as soon as the stages before it allow, and the drop reasons are told apart
     * only off that path, as is a query (of a run's generation and the job's slots: its checks are a
     * contribution's but the count's), which reads the tag and the workers and writes nothing, and a
     * parent's RESULT. A stale chunk stops after the tag stage, and sets no other field of hdr.local.
     * The generation is not compared with the job's (hdr.local.job holds that for a probe's reply
     * only): a run's session generation is the workers' choice, and the tag keeps runs apart.
     *
     * In a tree (docs/protocol.md section 10) a copy's count says one more thing where the job has a
     * parent: n, its partial sum, sent up and awaited (a completing contribution sends it up instead
     * of down, and child 0's repeat sends it again); n + 1, the parent's result, which repeats are
     * answered from. A job with no parent holds at most n. */
    apply {
        if (hdr.vals.isValid() && hdr.sa.chunk_generation & SA_GENERATION_BITS != 0
                && hdr.sa.slot < hdr.local.job[63:48] && hdr.sa.owner_count < hdr.local.owners) {
            tag_stage();
            if (hdr.local.fresh == 1) {
                if (hdr.local.job & LOCAL_COUNT_BITS == LOCAL_COUNT_ONE) {  /* a job of one worker */
                    if (hdr.local.job & LOCAL_PARENT != 0) {
                        start_copy_up();
                    } else if (hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS == 0) {
                        start_copy();
                        result_to_all();
                    } else {
                        start_copy();
                        result_to_owner();
                    }
                } else {
                    start_copy_counted();
                }
            } else if (hdr.sa.chunk_generation != hdr.local.tag) {  /* the same generation: another chunk */
                drop_stale();
            } else {
                count_worker();
                if (hdr.local.seen == 1) {
                    if ((hdr.local.workers ^ hdr.local.job) & LOCAL_COUNT_BITS == 0
                            && hdr.local.job & LOCAL_PARENT != 0) {  /* the partial is up, awaited */
                        if (hdr.sa.version_type_flags_worker & SA_WORKER_BITS == 0) {
                            resend_up();
                        } else {
                            drop_duplicate_pending();
                        }
                    } else if ((hdr.local.workers ^ hdr.local.job) & LOCAL_COUNT_BITS != 0
                               && (hdr.local.workers - LOCAL_COUNT_ONE ^ hdr.local.job) & LOCAL_COUNT_BITS != 0) {
                        drop_duplicate_pending();  /* neither n nor n + 1 */
                    } else if (hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS != 0) {
                        branch.apply(hdr);
                        if (hdr.local.whole == 0) {
                            header_to_sender();  /* a reduce-scatter's chunk whose owner is not under this child */
                        } else {
                            read_result();
                            result_to_sender();
                        }
                    } else {
                        read_result();
                        result_to_sender();
                    }
                } else if ((hdr.local.workers ^ hdr.local.job) & LOCAL_COUNT_BITS == 0) {
                    if (hdr.local.job & LOCAL_PARENT != 0) {
                        add_contribution_up();
                    } else if (hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS == 0) {
                        add_contribution_to_all();
                    } else {
                        add_contribution_to_owner();
                    }
                } else {
                    add_contribution_counted();
                }
            }
        } else if (hdr.sa.version_type_flags_worker & SA_TYPE_BITS == (bit<32>)SA_TYPE_PROBE << 16) {
            probe_reply();
        } else if (hdr.sa.chunk_generation & SA_GENERATION_BITS == 0) {  /* what every tag powers up holding */
            drop_wrong_generation();
        } else if (hdr.sa.slot >= hdr.local.job[63:48]) {
            drop_slot_out_of_range();
        } else if (hdr.sa.version_type_flags_worker & SA_TYPE_BITS == (bit<32>)SA_TYPE_RESULT << 16) {
            /* the parent's (admission took it from no one else): the owner against the tree's ranks (the
             * limit its entry keeps in job), the count (K, or the header alone for an owner elsewhere),
             * then taken where the copy holds its chunk and awaits it (count n) */
            if ((bit<64>)hdr.sa.owner_count >= hdr.local.job & LOCAL_OWNERS) {
                drop_bad_owner();
            } else if (!hdr.vals.isValid()
                       && (hdr.sa.owner_count & SA_COUNT_BITS != 0
                           || hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS == 0)) {
                drop_bad_count();
            } else {
                read_tag();
                if (hdr.local.fresh == 0 && hdr.sa.chunk_generation == hdr.local.tag) {
                    read_count();
                    if ((hdr.local.workers ^ hdr.local.job) & LOCAL_COUNT_BITS == 0) {
                        if (hdr.vals.isValid()) {
                            take_result();
                        } else {
                            take_header();
                        }
                    } else {
                        drop_unexpected_result();
                    }
                } else {
                    drop_unexpected_result();
                }
            }
        } else if (hdr.sa.owner_count >= hdr.local.owners) {  /* not one of the tree's ranks */
            drop_bad_owner();
        } else if (hdr.sa.version_type_flags_worker & SA_TYPE_BITS == (bit<32>)SA_TYPE_QUERY << 16) {
            read_tag();
            if (hdr.local.fresh == 0 && hdr.sa.chunk_generation != hdr.local.tag) {  /* an older chunk */
                drop_stale();
            } else {
                pending_reply();
            }
        } else {
            drop_bad_count();
        }
    }
}
