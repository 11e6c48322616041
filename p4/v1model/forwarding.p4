/* Ordinary traffic between the hosts: an L2 table by destination MAC; broadcast floods (ARP). */

control Forwarding(inout headers_t hdr, inout standard_metadata_t std) {
    action to_port(bit<9> port) {
        std.egress_spec = port;
    }
    action flood() {
        std.mcast_grp = SA_FLOOD_GROUP;
    }
    action drop() {
        mark_to_drop(std);
    }

    table l2 {
        key = { hdr.outer.head & OUTER_ETH_DST: exact @name("eth_dst"); }
        actions = { to_port; flood; drop; }
        default_action = drop();
        size = 1024;
    }

    apply {
        l2.apply();
    }
}
