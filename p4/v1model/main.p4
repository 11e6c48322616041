/* switchagg for v1model (BMv2 simple_switch_grpc): in-network sums of int32 gradient chunks.
 * docs/protocol.md is the specification; switchagg/switch/model.py is the reference model that
 * tests/test_bmv2.py compares this program against, packet for packet. */

#include <core.p4>
#include <v1model.p4>

#include "../include/constants.p4"
#include "../include/headers.p4"
#include "../include/metadata.p4"
#include "parser.p4"
#include "admission.p4"
#include "aggregation.p4"
#include "forwarding.p4"
#include "egress.p4"

control SaIngress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    counter(SA_NUM_GLOBAL_DROPS, CounterType.packets) global_drops;
    counter(SA_MAX_JOBS * SA_NUM_JOB_COUNTERS, CounterType.packets) job_counters;
    Admission() admission;
    Aggregation() aggregation;
    Forwarding() forwarding;

    action drop_global(bit<32> reason) {
        global_drops.count(reason);
        mark_to_drop(std);
    }
    action job_count(bit<32> what) {
        job_counters.count((bit<32>)meta.job_index * SA_NUM_JOB_COUNTERS + what);
    }
    action drop_job(bit<32> what) {
        job_count(what);
        mark_to_drop(std);
    }
    /* Back to the sender, from the switch's own addresses (the ones the packet was sent to). */
    action reply_to_sender() {
        mac_addr_t mac = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        ipv4_addr_t ip = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
        hdr.ipv4.src_addr = ip;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = SA_UDP_PORT;
        hdr.udp.checksum = 0;
        std.egress_spec = std.ingress_port;
    }
    /* To every worker of the job: egress fills in each replica's destination. */
    action result_to_all() {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = SA_UDP_PORT;
        hdr.udp.checksum = 0;
        std.mcast_grp = meta.mcast_grp;
        meta.multicast = 1;
    }

    apply {
        if (meta.is_sa == 0) {
            forwarding.apply(hdr, std);
            return;
        }
        /* The same checks, in the same order, as SwitchModel.process. */
        if (!hdr.sa.isValid()) {
            drop_global(SA_DROP_MALFORMED);
            return;
        }
        if (hdr.sa.version != SA_VERSION) {
            drop_global(SA_DROP_BAD_VERSION);
            return;
        }
        bool length_ok = hdr.udp.length == 8 + SA_HEADER_BYTES + (hdr.sa.count << 2)
                         && hdr.ipv4.total_len == 20 + hdr.udp.length;
        if (std.parser_error != error.NoError || !length_ok
                || (hdr.sa.type != SA_TYPE_CONTRIB && hdr.sa.type != SA_TYPE_PROBE)
                || (hdr.sa.flags & ~SA_FLAG_COPY) != 0 || hdr.sa.reserved != 0
                || hdr.sa.worker >= SA_MAX_WORKERS
                || (hdr.sa.type == SA_TYPE_PROBE && hdr.sa.count != 0)) {
            drop_global(SA_DROP_MALFORMED);
            return;
        }
        admission.apply(hdr, meta);
        if (meta.admitted == 0) {
            drop_global(SA_DROP_NOT_ADMITTED);
            return;
        }
        if (hdr.sa.type == SA_TYPE_PROBE) {
            job_count(SA_JOB_PROBES);
            hdr.sa.type = SA_TYPE_PROBE_REPLY;
            hdr.sa.generation = meta.generation;
            reply_to_sender();
            return;
        }
        if (hdr.sa.generation != meta.generation) {
            drop_job(SA_JOB_WRONG_GENERATION);
            return;
        }
        if (hdr.sa.slot >= meta.slot_count) {
            drop_job(SA_JOB_SLOT_OUT_OF_RANGE);
            return;
        }
        if (hdr.sa.count != SA_VALUES) {
            drop_job(SA_JOB_BAD_COUNT);
            return;
        }
        aggregation.apply(hdr, meta);
        if (meta.tag == SA_TAG_STALE) {
            drop_job(SA_JOB_STALE);
            return;
        }
        if (meta.seen == 1 && meta.count != meta.n_workers) {
            drop_job(SA_JOB_DUPLICATE_PENDING);
            return;
        }
        if (meta.count != meta.n_workers) {
            drop_job(SA_JOB_CONTRIBUTIONS);  /* counted into the sum; nothing to send yet */
            return;
        }
        hdr.sa.type = SA_TYPE_RESULT;
        hdr.sa.exponent = meta.exponent;
        if (meta.seen == 1) {
            job_count(SA_JOB_RESULTS_UNICAST);
            reply_to_sender();
        } else {
            job_count(SA_JOB_CONTRIBUTIONS);
            job_count(SA_JOB_RESULTS_MULTICAST);
            result_to_all();
        }
    }
}

V1Switch(SaParser(), SaVerifyChecksum(), SaIngress(), SaEgress(), SaComputeChecksum(), SaDeparser()) main;
