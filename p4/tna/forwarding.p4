/* Ordinary traffic between the hosts: an L2 table by destination MAC; broadcast floods (ARP).
 *
 * A frame the table has no port for is dropped: the switch's own address has none, so that is where
 * frames sent to the switch itself that are not switchagg packets end. Of these, an IPv4 UDP datagram
 * with options, or a fragment of one, is counted by reason: the switch takes neither (the parser only
 * takes a 20-byte IPv4 header, unfragmented), and a later fragment carries no UDP port that could
 * tell a switchagg datagram's from another's (the switch serves no other UDP). */

control Forwarding(inout sa_headers_t hdr, inout sa_ingress_metadata_t md,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    action to_port(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
    }
    /* Every host port but the one it came in on (egress.p4 prunes that one) */
    action flood() {
        ig_tm_md.mcast_grp_a = SA_FLOOD_GROUP;
        hdr.bridge.kind = SA_BRIDGE_FLOOD;
    }
    action drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

    table l2 {
        key = { hdr.ethernet.dst_addr: exact @name("eth_dst"); }
        actions = { to_port; flood; drop; }
        default_action = drop();
        size = SA_L2_SIZE;
    }

    action count_ip_options() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_IP_OPTIONS;
    }
    action count_fragment() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_FRAGMENT;
    }

    apply {
        if (!l2.apply().hit) {
            if (hdr.ipv4.isValid() && hdr.ipv4.protocol == SA_IP_PROTOCOL_UDP) {
                if (hdr.ipv4.ihl != 5) {
                    count_ip_options();
                } else if (hdr.ipv4.flags[0:0] != 0 || hdr.ipv4.frag_offset != 0) {
                    count_fragment();
                }
            }
        }
    }
}
