/* Egress: each replica of a finished sum is addressed to its worker; a flooded frame is not sent back
 * out of the port it came in on. Everything else leaves as ingress sent it.
 *
 * A job's multicast group (its index + 1) has one node per worker, each with its own replication id
 * (rid) and the worker's port; the replica table gives, by rid, what differs between the workers. */

control SaEgress(inout sa_egress_headers_t hdr, inout sa_egress_metadata_t md,
                 in egress_intrinsic_metadata_t eg_intr_md,
                 in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                 inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                 inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    /* A RESULT from the switch's address and port to the worker's, as the v1model program's control
     * plane writes it (switchagg.frames.udp_headers): IPv4 without options, not fragmented (don't
     * fragment set), TTL 64, the length of K values, UDP checksum 0; the IPv4 checksum is worked out
     * by the deparser. The Ethernet source is the address the contribution was sent to (ingress put
     * it there); the switchagg header's version stays 1 and its flags stay. */
    action to_worker(bit<48> eth_dst, bit<32> ip_src, bit<32> ip_dst, bit<16> udp_dst, bit<8> worker) {
        hdr.ethernet.dst_addr = eth_dst;
        hdr.ipv4.version = 4;
        hdr.ipv4.ihl = 5;
        hdr.ipv4.diffserv = 0;
        hdr.ipv4.total_len = SA_CONTRIB_IP_BYTES;
        hdr.ipv4.identification = 0;
        hdr.ipv4.flags = 2;
        hdr.ipv4.frag_offset = 0;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.protocol = SA_IP_PROTOCOL_UDP;
        hdr.ipv4.src_addr = ip_src;
        hdr.ipv4.dst_addr = ip_dst;
        hdr.udp.src_port = SA_UDP_PORT;
        hdr.udp.dst_port = udp_dst;
        hdr.udp.length = SA_CONTRIB_UDP_BYTES;
        hdr.udp.checksum = 0;
        hdr.sa.type = SA_TYPE_RESULT;
        hdr.sa.worker = worker;
    }
#ifdef SA_TREES
    /* A level of a tree: the one replica of its uplink group, the finished partial sum to the parent as a
     * CONTRIB of the parent's job (`job`, `key`) from this switch's index among its children (`worker`),
     * the headers as to_worker writes them. */
    action to_parent(bit<48> eth_dst, bit<32> ip_src, bit<32> ip_dst, bit<16> udp_dst, bit<8> worker,
                     bit<16> job, bit<32> key) {
        to_worker(eth_dst, ip_src, ip_dst, udp_dst, worker);
        hdr.sa.type = SA_TYPE_CONTRIB;
        hdr.sa.job = job;
        hdr.sa.key = key;
    }
#endif
    action drop() {
        eg_dprsr_md.drop_ctl = 1;
    }

    table replica {
        key = { eg_intr_md.egress_rid: exact @name("rid"); }
#ifdef SA_TREES
        actions = { to_worker; to_parent; drop; }
#else
        actions = { to_worker; drop; }
#endif
        const default_action = drop();
        size = SA_REPLICA_SIZE;
    }

    apply {
        if (hdr.bridge.kind == SA_BRIDGE_RESULT) {
            replica.apply();  /* a replica with no entry is dropped */
        } else if (hdr.bridge.kind == SA_BRIDGE_FLOOD && eg_intr_md.egress_port == hdr.bridge.ingress_port) {
            drop();
        }
    }
}
