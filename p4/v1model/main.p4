/* switchagg for v1model (BMv2 simple_switch_grpc): in-network sums of int32 gradient chunks.
 * docs/protocol.md is the specification; switchagg/switch/model.py is the reference model that
 * tests/test_bmv2.py compares this program against, packet for packet. */

#include <core.p4>
#include <v1model.p4>

#include "../include/constants.p4"
#include "../include/metadata.p4"
#include "../include/headers.p4"
#include "parser.p4"
#include "admission.p4"
#include "aggregation.p4"
#include "forwarding.p4"
#include "egress.p4"

control SaIngress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    /* Per job: one array per event of switchagg.switch.counters.JobCounter, named after it and indexed
     * by the job's index, so that counting needs no index arithmetic. */
    counter(SA_MAX_JOBS, CounterType.packets) job_contributions;
    counter(SA_MAX_JOBS, CounterType.packets) job_results_multicast;
    counter(SA_MAX_JOBS, CounterType.packets) job_results_unicast;
    counter(SA_MAX_JOBS, CounterType.packets) job_probes;
    counter(SA_MAX_JOBS, CounterType.packets) job_wrong_generation;
    counter(SA_MAX_JOBS, CounterType.packets) job_slot_out_of_range;
    counter(SA_MAX_JOBS, CounterType.packets) job_bad_count;
    counter(SA_MAX_JOBS, CounterType.packets) job_stale;
    counter(SA_MAX_JOBS, CounterType.packets) job_duplicate_pending;
    Admission() admission;
    Aggregation() aggregation;
    Forwarding() forwarding;

    /* A frame too short for the outer header (under 42 bytes). */
    action drop_runt() {
        mark_to_drop(std);
    }
    /* A contribution counted into a sum that is not finished yet: nothing to send. */
    action counted() {
        job_contributions.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    action drop_duplicate_pending() {
        job_duplicate_pending.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    action drop_stale() {
        job_stale.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    action drop_wrong_generation() {
        job_wrong_generation.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    action drop_slot_out_of_range() {
        job_slot_out_of_range.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    action drop_bad_count() {
        job_bad_count.count(hdr.local.job_index);
        mark_to_drop(std);
    }
    /* A packet the switch sends: from the switchagg port, with UDP checksum 0 (the addresses change,
     * and 0 means no checksum). */
    action from_switch_port() {
        hdr.outer.udp_src = SA_UDP_PORT;
        hdr.outer.udp_length_checksum = hdr.outer.udp_length_checksum & 0xffff0000;  /* UDP checksum 0 */
    }
    /* Back to the sender, from the switch's own addresses (the ones the packet was sent to). The
     * addresses are swapped in place (xor) rather than through temporaries, which BMv2 would reset
     * on every packet. */
    action reply_to_sender() {
        hdr.outer.eth_dst = hdr.outer.eth_dst ^ hdr.outer.eth_src;
        hdr.outer.eth_src = hdr.outer.eth_dst ^ hdr.outer.eth_src;
        hdr.outer.eth_dst = hdr.outer.eth_dst ^ hdr.outer.eth_src;
        hdr.outer.ip_dst = hdr.outer.ip_dst ^ hdr.outer.ip_src;
        hdr.outer.ip_src = hdr.outer.ip_dst ^ hdr.outer.ip_src;
        hdr.outer.ip_dst = hdr.outer.ip_dst ^ hdr.outer.ip_src;
        hdr.outer.udp_dst = hdr.outer.udp_src;
        from_switch_port();
        std.egress_spec = std.ingress_port;
    }

    /* A finished sum to every worker of the job, through the job's multicast group (job index + 1),
     * from the switch's own addresses: what all replicas share is written here once, and egress
     * writes each replica's destination. */
    action result_to_all() {
        job_contributions.count(hdr.local.job_index);
        job_results_multicast.count(hdr.local.job_index);
        std.mcast_grp = (bit<16>)hdr.local.job_index + 1;
        hdr.sa.type = SA_TYPE_RESULT;
        hdr.outer.eth_src = hdr.outer.eth_dst;
        hdr.outer.ip_src = hdr.outer.ip_dst;
        from_switch_port();
    }
    /* The stored sum back to a worker that sent its contribution again. */
    action result_to_sender() {
        job_results_unicast.count(hdr.local.job_index);
        hdr.sa.type = SA_TYPE_RESULT;
        reply_to_sender();
    }
    action probe_reply() {
        job_probes.count(hdr.local.job_index);
        hdr.sa.type = SA_TYPE_PROBE_REPLY;
        hdr.sa.generation = hdr.local.generation;
        reply_to_sender();
    }

    /* The same checks, with the same outcome for every packet, as SwitchModel.process: admission
     * (admission.p4) checks the packet and finds its job, then the common case (an admitted
     * contribution of K values of the current generation) is tested first, and the drop reasons are
     * told apart only off that path. BMv2 pays per operator, condition and table applied, and an
     * early `return` would add a flag test after every step. */
    apply {
        /* A switchagg packet: its header is valid, or the parser ran out of bytes in it (a frame too
         * short for the outer header has no valid header at all). */
        if (hdr.sa.isValid() || std.parser_error == error.PacketTooShort && hdr.outer.isValid()) {
            admission.apply(hdr, std);  /* what it does not admit, it drops, counts and strips of hdr.sa */
            if (!hdr.sa.isValid()) {
            } else if (hdr.vals.isValid() && hdr.sa.generation == hdr.local.generation
                       && hdr.sa.slot < hdr.local.slot_count) {
                aggregation.apply(hdr);
                if (hdr.local.stale == 1) {
                    drop_stale();
                } else if (hdr.local.count == hdr.local.n_workers) {
                    if (hdr.local.seen == 1) {
                        result_to_sender();
                    } else {
                        result_to_all();
                    }
                } else if (hdr.local.seen == 1) {
                    drop_duplicate_pending();
                } else {
                    counted();
                }
            } else if (hdr.sa.type == SA_TYPE_PROBE) {
                probe_reply();
            } else if (hdr.sa.generation != hdr.local.generation) {
                drop_wrong_generation();
            } else if (hdr.sa.slot >= hdr.local.slot_count) {
                drop_slot_out_of_range();
            } else {
                drop_bad_count();
            }
        } else if (hdr.outer.isValid()) {
            forwarding.apply(hdr, std);
        } else {
            drop_runt();
        }
    }
}

V1Switch(SaParser(), SaVerifyChecksum(), SaIngress(), SaEgress(), SaComputeChecksum(), SaDeparser()) main;
