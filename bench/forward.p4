/* The baseline of bench/bmv2_vs_forwarding.py: the least a v1model program can do with a frame
 * (parse Ethernet, send it from port 0 to port 1), on the same BMv2 build as switchagg. */
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
    apply { std.egress_spec = std.ingress_port == 0 ? 9w1 : 9w0; }
}
control FwdEgress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t std) { apply { } }
control FwdCompute(inout headers_t hdr, inout meta_t meta) { apply { } }
control FwdDeparser(packet_out pkt, in headers_t hdr) { apply { pkt.emit(hdr.ethernet); } }

V1Switch(FwdParser(), FwdVerify(), FwdIngress(), FwdEgress(), FwdCompute(), FwdDeparser()) main;
