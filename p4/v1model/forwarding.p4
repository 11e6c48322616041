/* Ordinary traffic between the hosts: an L2 table by destination MAC; broadcast floods (ARP).
 *
 * A frame the table has no port for is dropped: the switch's own address has none, so that is where
 * frames sent to the switch itself that are not switchagg packets end. Of these, an IPv4 UDP datagram
 * with options, or a fragment of one, is counted by reason: the switch takes neither (the parser only
 * takes a 20-byte IPv4 header, unfragmented), and a later fragment carries no UDP port that could
 * tell a switchagg datagram's from another's (the switch serves no other UDP). */

control Forwarding(inout headers_t hdr, inout standard_metadata_t std)(counter<bit<32>> drops) {
    action to_port(bit<9> port) {
        std.egress_spec = port;
    }
    action flood() {
        std.mcast_grp = SA_FLOOD_GROUP;
    }
    action drop() {
        mark_to_drop(std);
    }

    /* Counting what drop() dropped, one action per reason (a constant index: see validation.p4) */
    action count_ip_options() {
        drops.count(SA_DROP_IP_OPTIONS);
    }
    action count_fragment() {
        drops.count(SA_DROP_FRAGMENT);
    }

    table l2 {
        key = { hdr.outer.head & OUTER_ETH_DST: exact @name("eth_dst"); }
        actions = { to_port; flood; drop; }
        default_action = drop();
        size = SA_L2_SIZE;
    }

    apply {
        if (!l2.apply().hit) {
            if (hdr.outer.head & (OUTER_ETHER_TYPE | OUTER_PROTOCOL) == (bit<336>)0x0800 << 224 | (bit<336>)17 << 144) {
                if (hdr.outer.head & OUTER_IHL != (bit<336>)5 << 216) {
                    count_ip_options();
                } else if (hdr.outer.head & OUTER_FRAGMENT != 0) {
                    count_fragment();
                }
            }
        }
    }
}
