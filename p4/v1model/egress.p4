/* Egress: each replica of a finished sum is addressed to its worker; a flooded frame is not sent
 * back out of the port it came in on. Ingress made the sum a RESULT from the switch once, so a
 * replica pays only for what differs between workers (BMv2 pays per field assignment).
 *
 * A job's multicast group holds one replica per worker, told apart by (egress port, instance): the
 * instance counts the job's workers before it on the same port, so workers on distinct ports all
 * share instance 0. BMv2's PRE keeps one node per instance and scans every port of each node per
 * packet, so the usual job (one worker per port) costs one node, not one per worker. */

const bit<32> PKT_INSTANCE_TYPE_REPLICATION = 5;

control SaEgress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    action to_worker(mac_addr_t mac, ipv4_addr_t ip, bit<16> port, bit<8> worker) {
        hdr.outer.eth_dst = mac;
        hdr.outer.ip_dst = ip;
        hdr.outer.udp_dst = port;
        hdr.sa.worker = worker;
    }

    table replica {
        key = {
            hdr.sa.job: exact;
            std.egress_port: exact;
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
