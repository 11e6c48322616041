/* Egress: each replica of a finished sum is rewritten to its worker (egress_rid = the worker's rank);
 * a flooded frame is not sent back out of the port it came in on. */

const bit<32> PKT_INSTANCE_TYPE_REPLICATION = 5;

control SaEgress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    action to_worker(mac_addr_t mac, ipv4_addr_t ip, bit<16> port) {
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = port;
        hdr.sa.worker = (bit<8>)std.egress_rid;
    }

    table replica {
        key = {
            hdr.sa.job: exact;
            std.egress_rid: exact;
        }
        actions = { to_worker; NoAction; }
        default_action = NoAction();
        size = 2048;
    }

    apply {
        if (std.instance_type == PKT_INSTANCE_TYPE_REPLICATION) {
            if (hdr.sa.isValid()) {  /* only a finished sum is a replicated switchagg packet */
                if (!replica.apply().hit) {
                    mark_to_drop(std);
                }
            } else if (std.egress_port == std.ingress_port) {
                mark_to_drop(std);
            }
        }
    }
}
