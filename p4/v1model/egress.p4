/* Egress: each replica of a finished sum is addressed to its worker, a leaf's partial sum to its
 * parent; a flooded frame is not sent back out of the port it came in on. A replica is written two
 * fields (BMv2 pays per field written), the headers that differ between workers and what they share
 * alike. A reduce-scatter's sum (FLAG_OWNER) goes whole to its owner alone: every other worker's
 * replica loses its values (docs/protocol.md section 4b).
 *
 * A job's multicast group holds one replica per worker, told apart by (egress port, instance): the
 * instance counts the job's workers before it on the same port, so workers on distinct ports all
 * share instance 0. BMv2's PRE keeps one node per instance and scans every port of each node per
 * packet, so the usual job (one worker per port) costs one node, not one per worker. */

const bit<32> PKT_INSTANCE_TYPE_REPLICATION = 5;

control SaEgress(inout headers_t hdr, inout sa_metadata_t meta, inout standard_metadata_t std) {
    Branch() branch;

    /* The replica's Ethernet, IPv4 and UDP headers, all but the Ethernet source, come whole from the
     * control plane (a result's IPv4 header is the same for every sum to the worker: the switch's
     * and the worker's addresses, the length of K values, its checksum; UDP checksum 0); the
     * source is the switch's address the contribution was sent to. So do the switchagg header's
     * version, type (RESULT) and worker; its flags stay. */
    action to_worker(bit<336> head, bit<32> version_type_worker) {
        hdr.outer.head = head | hdr.outer.head >> 48 & OUTER_ETH_SRC;
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker & SA_FLAGS_BITS | version_type_worker;
    }

    /* A replica of a reduce-scatter's sum to a worker that does not own the chunk: its header alone,
     * count 0, K values' bytes fewer in the IPv4 and UDP lengths, and the control plane's IPv4
     * checksum as many more (the complement of a sum that lost them: RFC 1624), its carry out of
     * 16 bits added back in (hdr.local, metadata.p4, holds it on the way). */
    action header_only() {
        hdr.local.checksum = (hdr.outer.head & OUTER_IP_CHECKSUM) + ((bit<336>)(4 * SA_VALUES) << 128);
        hdr.outer.head = (hdr.outer.head & ~OUTER_IP_CHECKSUM) - OUTER_VALUES_IN_LENGTHS
                         | (hdr.local.checksum + (hdr.local.checksum >> 16)) & OUTER_IP_CHECKSUM;
        hdr.sa.owner_count = hdr.sa.owner_count & SA_OWNER_BITS;
        hdr.vals.setInvalid();
    }

    /* A leaf's partial sum, or child 0's repeat of it, to its parent (docs/protocol.md section 10): the
     * one replica of the job's uplink group, a CONTRIB of the parent's job (`job`, `key`) from this
     * switch's index among the parent's children (`version_type_worker`), its flags kept, its headers
     * from the control plane as a result's are. */
    action to_parent(bit<336> head, bit<32> version_type_worker, bit<16> job, bit<32> key) {
        hdr.outer.head = head | hdr.outer.head >> 48 & OUTER_ETH_SRC;
        hdr.sa.version_type_flags_worker = hdr.sa.version_type_flags_worker & SA_FLAGS_BITS | version_type_worker;
        hdr.sa.job = job;
        hdr.sa.key = key;
    }

    table replica {
        key = {
            std.mcast_grp: exact;
            std.egress_port: exact;
            std.egress_rid: exact;
        }
        actions = { to_worker; to_parent; NoAction; }
        default_action = NoAction();
        size = SA_REPLICA_SIZE;
    }

    /* Only a replica of a finished sum (its job's group, its worker's port and instance) or of a
     * partial sum going up (its uplink group) is in the table, and it is all that egress rewrites.
     * Any other replica is a flooded frame, which does not go back out of the port it came in on, or
     * one of a sum with no entry, dropped. An allreduce's replica tests one condition more, the flag;
     * a reduce-scatter's goes whole only down the branch that holds its owner (a parent's header alone
     * stays one: docs/protocol.md section 10). */
    apply {
        switch (replica.apply().action_run) {
            to_worker: {
                if (hdr.sa.version_type_flags_worker & SA_OWNER_FLAG_BITS != 0) {
                    branch.apply(hdr);
                    if (hdr.local.whole == 0 || !hdr.vals.isValid()) {
                        header_only();
                    }
                }
            }
            to_parent: { }
            default: {
                if (std.instance_type == PKT_INSTANCE_TYPE_REPLICATION
                        && (hdr.sa.isValid() || std.egress_port == std.ingress_port)) {
                    mark_to_drop(std);
                }
            }
        }
    }
}
