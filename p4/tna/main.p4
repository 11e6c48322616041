/* switchagg for Tofino (TNA, tofino; T2NA, tofino2): in-network sums of int32 gradient chunks, with the
 * wire format and semantics of the embedded switch and the v1model program (docs/protocol.md). The
 * stage and pass layout is in docs/tofino.md.
 *
 * A contribution of K values goes through the ingress pipeline twice. The first pass checks and
 * admits it, runs the tag and workers stages, decides what to do with the copy's values (write, add,
 * read) and does it to the first half; it then recirculates the packet with what it decided. The
 * second pass does the same to the second half and to the exponent, and then counts the packet into
 * the sum, multicasts the finished sum or sends a stored one back. Everything else is decided in one
 * pass: probes, queries (which read the first half's tag and workers and answer with a PENDING),
 * drops by reason, and ordinary L2 forwarding. */

#include <core.p4>
#if __TARGET_TOFINO__ == 2
#include <t2na.p4>
#else
#include <tna.p4>
#endif

#include "../include/constants.p4"  /* and ../include/size.p4 */
#include "../include/headers.p4"
#include "include/types.p4"
#include "parser.p4"
#include "validation.p4"
#include "admission.p4"
#include "aggregation.p4"
#include "values.p4"
#include "forwarding.p4"
#include "egress.p4"

control SaIngress(inout sa_headers_t hdr, inout sa_ingress_metadata_t md,
                  in ingress_intrinsic_metadata_t ig_intr_md,
                  in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                  inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                  inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* Drops before a packet is tied to a job, by reason (SA_DROP_*, switchagg.jobs.GlobalDrop). */
    Counter<bit<32>, bit<8>>(SA_NUM_GLOBAL_DROPS, CounterType_t.PACKETS) global_drops;
    /* Per job, by event (SA_JOB_*, switchagg.jobs.JobCounter): index job index ++ event. */
    Counter<bit<32>, job_counter_index_t>(SA_MAX_JOBS * SA_JOB_COUNTER_STRIDE, CounterType_t.PACKETS) job_counters;

    Admission() admission;
    Validation() validation;
    CopyState(false) first_half;
    CopyState(true) second_half;
    ExponentStage() exponent;
    Values() values;
    Forwarding() forwarding;

    /* Every packet that leaves ingress starts with the bridge header (egress strips it). */
    action start() {
        hdr.bridge.setValid();
        hdr.bridge.kind = SA_BRIDGE_NONE;
        hdr.bridge.ingress_port = ig_intr_md.ingress_port;
    }
    /* The second pass takes up what admission found in the first. */
    action second_pass() {
        md.cell = hdr.recirc.cell;
        md.job_index = hdr.recirc.job_index;
        md.worker_bit = hdr.recirc.worker_bit;
        md.other_workers = hdr.recirc.other_workers;
        md.all_workers = hdr.recirc.all_workers;
#ifdef SA_TREES
        md.parent_bit = hdr.recirc.parent_bit;
#endif
    }

    action drop() {
        ig_dprsr_md.drop_ctl = 1;
    }
    action drop_not_admitted() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_NOT_ADMITTED;
        drop();
    }
#ifdef SA_TREES
    /* A RESULT from anyone but a parent of one of the jobs (as on a switch with no tree) */
    action drop_malformed() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_MALFORMED;
        drop();
    }
#endif
    /* A per-job event: counted at the end of the pass (one counter access per pass). */
    action job_event(bit<8> event) {
        md.count_job = 1;
        md.job_event = (job_event_t)event;
    }
    action drop_job(bit<8> event) {
        job_event(event);
        drop();
    }

    /* Back to the sender, from the switch's own addresses (the ones the packet was sent to) and its
     * switchagg port: the addresses swapped, the rest of the IPv4 header kept and its checksum worked
     * out afresh by the deparser, the UDP checksum 0 (none). */
    action reply_to(PortId_t port) {
        bit<48> mac = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        bit<32> ip = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
        hdr.ipv4.src_addr = ip;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = SA_UDP_PORT;
        hdr.udp.checksum = 0;
        md.reply = 1;
        ig_tm_md.ucast_egress_port = port;
    }
    /* A probe from an admitted worker: the job's generation, back to it. */
    action probe_reply() {
        job_event(SA_JOB_PROBES);
        hdr.sa.type = SA_TYPE_PROBE_REPLY;
        hdr.sa.generation = md.generation;
        reply_to(ig_intr_md.ingress_port);
    }
    /* A query the first half is not stale for: a PENDING back to it, the same header but the type, with
     * the half's workers in the key where it holds the chunk, else 0. */
    action pending() {
        job_event(SA_JOB_QUERIES);
        hdr.sa.type = SA_TYPE_PENDING;
        reply_to(ig_intr_md.ingress_port);
    }
    action pending_held() {
        pending();
#ifdef SA_TREES
        hdr.sa.key = md.workers_before & ~md.parent_bit;  /* the children's, as the model's bitmap */
#else
        hdr.sa.key = md.workers_before;
#endif
    }
    action pending_unheld() {
        pending();
        hdr.sa.key = 0;
    }

    /* The end of the first pass of a contribution that reached the values: round again through the
     * recirculation port of the job's pipe, to the second half. A new worker's contribution (or a
     * fresh chunk) is counted here, once. */
    action recirculate() {
        hdr.recirc.setValid();
        hdr.recirc.cell = md.cell;
        hdr.recirc.job_index = md.job_index;
        hdr.recirc.ingress_port = (bit<16>)ig_intr_md.ingress_port;
        hdr.recirc.worker_bit = md.worker_bit;
        hdr.recirc.other_workers = md.other_workers;
        hdr.recirc.all_workers = md.all_workers;
#ifdef SA_TREES
        hdr.recirc.parent_bit = md.parent_bit;
#endif
        ig_tm_md.ucast_egress_port = md.recirc_port;
    }
    action counted_recirculate() {
        job_event(SA_JOB_CONTRIBUTIONS);
        recirculate();
    }

    /* The end of the second pass. The last contribution: the sum to every worker of the job through
     * its multicast group (job index + 1), from the address the contribution was sent to; egress
     * makes each replica a RESULT to its worker. */
    action result_to_all() {
        job_event(SA_JOB_RESULTS_MULTICAST);
        ig_tm_md.mcast_grp_a = md.job_index + 1;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.bridge.kind = SA_BRIDGE_RESULT;
        hdr.recirc.setInvalid();
    }
#ifdef SA_TREES
    /* As result_to_all, to a group of the job's (its own, or its uplink group) */
    action to_group(bit<16> group) {
        ig_tm_md.mcast_grp_a = group;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.bridge.kind = SA_BRIDGE_RESULT;
        hdr.recirc.setInvalid();
    }
    /* A level of a tree (docs/tofino.md, "Trees"). The children's sum complete, only the parent's bit
     * missing: the partial up through the job's uplink group, whose one replica egress makes a CONTRIB
     * of the parent's job. Child 0's repeat while it is awaited sends the stored partial up again (one
     * child's, not every child's); the parent's RESULT, taken, goes down as a finished sum. */
    action partial_up() {
        job_event(SA_JOB_PARTIALS_UP);
        to_group(md.job_index + (1 + SA_UPLINK_GROUPS));
    }
    action partial_resent() {
        job_event(SA_JOB_PARTIALS_RESENT);
        to_group(md.job_index + (1 + SA_UPLINK_GROUPS));
    }
    action result_from_parent() {
        job_event(SA_JOB_RESULTS_FROM_PARENT);
        to_group(md.job_index + 1);
    }
#endif
    /* A repeat of a finished round: the stored sum back to the worker that sent it again. */
    action result_to_sender() {
        job_event(SA_JOB_RESULTS_UNICAST);
        hdr.sa.type = SA_TYPE_RESULT;
        reply_to((PortId_t)hdr.recirc.ingress_port);
        hdr.recirc.setInvalid();
    }

    action count_global_drop() {
        global_drops.count(md.global_drop);
    }
    action count_job_event() {
        job_counters.count((job_index_t)md.job_index ++ md.job_event);
    }

    /* The same checks, with the same outcome for every packet, as SwitchModel.process_frame
     * (docs/protocol.md section 7), and the state in the order of section 8. */
    apply {
        start();
        if (md.half == 0 && hdr.sa.isValid()) {
            admission.apply(hdr, md);  /* the first stage, for every switchagg header of a first pass */
        }

        /* Which packet, and the stages before the values */
        if (md.half == 1) {
            /* The second pass: the second half's tag and workers (from stage 0, by hdr.recirc.cell),
             * its decision and the exponent. */
            second_pass();
            second_half.apply(hdr, md, ig_dprsr_md);
            exponent.apply(hdr, md);
        } else if (hdr.vals_tail.isValid() && hdr.ipv4.total_len == SA_CONTRIB_IP_BYTES
                   || md.query == 1 && hdr.ipv4.total_len == SA_HEADER_IP_BYTES) {
            /* The common case: a contribution of K values, well formed (the parser checked the rest):
             * admission's verdict, then the first half's tag and workers. A well-formed query takes the
             * same path (its checks are a contribution's but the count's) and only reads them. */
            first_half.apply(hdr, md, ig_dprsr_md);
#ifdef SA_TREES
            if (md.tag == SA_TAG_STALE && md.result == 0) {  /* a RESULT's is unexpected_result, below */
#else
            if (md.tag == SA_TAG_STALE) {
#endif
                drop_job(SA_JOB_STALE);
            }
        } else if (hdr.udp.isValid() && hdr.udp.dst_port == SA_UDP_PORT) {
            /* Any other packet to the switchagg port */
            validation.apply(hdr, md, ig_prsr_md);
            if (md.count_global == 1) {
                drop();
#ifdef SA_TREES
            } else if (md.admitted == 0 && hdr.sa.type == SA_TYPE_RESULT) {
                drop_malformed();
#endif
            } else if (md.admitted == 0) {
                drop_not_admitted();
            } else if (hdr.sa.type == SA_TYPE_PROBE) {
                probe_reply();
            } else if (hdr.sa.generation == 0) {  /* what every tag powers up holding */
                drop_job(SA_JOB_WRONG_GENERATION);
            } else if (md.slot_room == 0) {
                drop_job(SA_JOB_SLOT_OUT_OF_RANGE);
            } else {
                drop_job(SA_JOB_BAD_COUNT);
            }
        } else {
            forwarding.apply(hdr, md, ig_intr_md, ig_dprsr_md, ig_tm_md);
        }

        /* This pass's half of the values, by md.op */
        values.apply(hdr, md);

        /* What becomes of a contribution */
        if (md.half == 1) {
            if (md.op == SA_OP_READ) {
                if (md.workers_missing == 0) {
                    result_to_sender();
#ifdef SA_TREES
                } else if (md.workers_missing == md.parent_bit && hdr.sa.worker == 0) {
                    partial_resent();  /* a flat job's parent_bit is 0: never here */
#endif
                } else {
                    drop_job(SA_JOB_DUPLICATE_PENDING);
                }
#ifdef SA_TREES
            } else if (md.op == SA_OP_NONE && md.result == 1) {
                drop_job(SA_JOB_UNEXPECTED_RESULT);
#endif
            } else if (md.op == SA_OP_NONE) {
                drop_job(SA_JOB_STALE);
#ifdef SA_TREES
            } else if (md.workers_missing == 0 && md.result == 1) {
                result_from_parent();
#endif
            } else if (md.workers_missing == 0) {
                result_to_all();
#ifdef SA_TREES
            } else if (md.workers_missing == md.parent_bit) {
                partial_up();
#endif
            } else {
                drop();  /* counted into a sum that is not finished yet */
            }
        } else if (md.op == SA_OP_READ) {
            recirculate();
#ifdef SA_TREES
        } else if (md.op != SA_OP_NONE && md.result == 1) {
            recirculate();  /* a parent's RESULT taken: counted once, in the second pass */
        } else if (md.result == 1 && md.tag != SA_TAG_NONE) {  /* admitted: its tag was read */
            drop_job(SA_JOB_UNEXPECTED_RESULT);  /* no copy awaited it */
#endif
        } else if (md.op != SA_OP_NONE) {
            counted_recirculate();
        } else if (md.tag == SA_TAG_HELD) {  /* a query (its tags match no decision: op NONE) */
            pending_held();
        } else if (md.tag == SA_TAG_UNHELD) {
            pending_unheld();
        }

        /* One access to each counter per pass */
        if (md.count_global == 1) {
            count_global_drop();
        }
        if (md.count_job == 1) {
            count_job_event();
        }
    }
}

Pipeline(SaIngressParser(), SaIngress(), SaIngressDeparser(), SaEgressParser(), SaEgress(), SaEgressDeparser()) pipe;
Switch(pipe) main;
