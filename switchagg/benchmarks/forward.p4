/* The baseline of bench/bmv2_vs_forwarding.py: plain forwarding, one exact-match lookup of the
 * destination MAC that picks the output port, on the same BMv2 build as switchagg. */
#include <core.p4>
#include <v1model.p4>

header ethernet_h { bit<48> dst; bit<48> src; bit<16> ether_type; }
struct headers_t { ethernet_h ethernet; }
struct meta_t { }

parser FwdParser(packet_in pkt, out headers_t hdr, inout meta_t meta, inout standard_metadata_t std) {
    state start { pkt.extract(hdr.ethernet); transition accept; }
}
control FwdVerify(inout headers_t hdr, inout meta_t meta) { apply { } }
control FwdIngress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t std) {
    action to_port(bit<9> port) { std.egress_spec = port; }
    action drop() { mark_to_drop(std); }
    table l2 {
        key = { hdr.ethernet.dst: exact; }
        actions = { to_port; drop; }
        default_action = drop();
    }
    apply { l2.apply(); }
}
control FwdEgress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t std) { apply { } }
control FwdCompute(inout headers_t hdr, inout meta_t meta) { apply { } }
control FwdDeparser(packet_out pkt, in headers_t hdr) { apply { pkt.emit(hdr.ethernet); } }

V1Switch(FwdParser(), FwdVerify(), FwdIngress(), FwdEgress(), FwdCompute(), FwdDeparser()) main;
