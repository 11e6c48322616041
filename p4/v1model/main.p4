/* switchagg for v1model (BMv2 simple_switch_grpc): in-network sums of int32 gradient chunks.
 * docs/protocol.md is the specification; switchagg/switch/model.py is the reference model that
 * tests/test_bmv2.py compares this program against, packet for packet. */

#include <core.p4>
#define V1MODEL_VERSION 20200408  /* counters and registers typed by their index */
#include <v1model.p4>

#include "../include/constants.p4"  /* and ../include/size.p4 */
#include "../include/headers.p4"    /* the wire's headers; this program reads them through include/headers.p4 */
#include "include/metadata.p4"
#include "include/headers.p4"
#include "parser.p4"
#include "validation.p4"
#include "branch.p4"
#include "aggregation.p4"
#include "admission.p4"
#include "forwarding.p4"
#include "egress.p4"

control SaIngress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    /* Drops before a packet is tied to a job, by reason (switchagg.jobs.GlobalDrop). */
    counter<bit<32>>(SA_NUM_GLOBAL_DROPS, CounterType.packets) global_drops;
    Validation(global_drops) validation;
    Admission(global_drops) admission;
    Forwarding(global_drops) forwarding;

    /* A frame too short for the outer header (under 42 bytes). */
    action drop_runt() {
        mark_to_drop(std);
    }

    /* The same checks, with the same outcome for every packet, as SwitchModel.process. The common
     * case, a contribution of K values the parser found well formed (hdr.vals valid), passes one
     * condition and the admission table; the other frames are told apart off that path. BMv2 pays
     * per condition, per operator (it evaluates all of a condition's) and per table applied. */
    apply {
        if (!hdr.vals.isValid()) {
            /* A switchagg packet: its header is valid, or the parser ran out of bytes in it (a
             * frame too short for the outer header has no valid header at all). */
            if (hdr.sa.isValid() || std.parser_error == error.PacketTooShort && hdr.outer.isValid()) {
                validation.apply(hdr, std);  /* what it drops, it counts and strips of hdr.sa */
            } else if (hdr.outer.isValid()) {
                forwarding.apply(hdr, std);
            } else {
                drop_runt();
            }
        }
        admission.apply(hdr, std);  /* a valid hdr.sa: its job's aggregation, or dropped as not admitted */
    }
}

V1Switch(SaParser(), SaVerifyChecksum(), SaIngress(), SaEgress(), SaComputeChecksum(), SaDeparser()) main;
