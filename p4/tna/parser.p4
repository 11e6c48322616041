/* Parsers and deparsers (TNA). docs/tofino.md, "Passes", says what each pass holds. */

parser SaIngressParser(packet_in pkt, out sa_headers_t hdr, out sa_ingress_metadata_t md,
                       out ingress_intrinsic_metadata_t ig_intr_md) {
    /* The recirculation port of each pipe that holds jobs (the control plane adds them): a packet
     * that comes in there is a contribution on its second pass. */
    value_set<PortId_t>(4) recirculation_ports;

    state start {
        pkt.extract(ig_intr_md);
        md.op = SA_OP_NONE;
        md.second_op = SA_OP_NONE;
        md.new_generation = SA_NOT_CHECKED;
        md.tag = SA_TAG_NONE;
        md.count_global = 0;
        md.count_job = 0;
        md.reply = 0;
        md.admitted = 0;
        md.query = 0;
#ifdef SA_TREES
        md.result = 0;
#endif
        transition select(ig_intr_md.ingress_port) {
            recirculation_ports: second_pass;
            default: first_pass;
        }
    }

    /* First pass: a frame from a host. */
    state first_pass {
        pkt.advance(PORT_METADATA_SIZE);
        md.half = 0;
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            SA_ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    /* IPv4 with a 20-byte header, not a fragment (neither more fragments nor an offset), UDP. With
     * options or in fragments it is ordinary traffic (forwarding.p4 counts it where it is sent to
     * the switch itself). */
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.flags[0:0], hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, 0, SA_IP_PROTOCOL_UDP): parse_udp;
            default: accept;
        }
    }
    /* To the switchagg port: a contribution of K values is SA_CONTRIB_UDP_BYTES long, a query (a header)
     * SA_HEADER_UDP_BYTES. */
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port, hdr.udp.length) {
            (SA_UDP_PORT, SA_CONTRIB_UDP_BYTES): parse_contribution;
            (SA_UDP_PORT, SA_HEADER_UDP_BYTES): parse_query;
            (SA_UDP_PORT, _): parse_switchagg;
            default: accept;
        }
    }
    /* Any other packet to the switchagg port: validation.p4 checks it. A frame that ends within the
     * header stops the parser with the header invalid and an error, which validation counts as
     * malformed. */
    state parse_switchagg {
        pkt.extract(hdr.sa);
        transition accept;
    }
    /* The values are parsed only for a well-formed contribution of K values, checked a few fields
     * at a time (a parser state matches at most 32 bits): version 1, CONTRIB, no flag but the copy,
     * worker < 32; then no reserved bits and a count of K. Aggregation takes these as given, and
     * checks the one field left, the IPv4 length, with its first condition. */
    state parse_contribution {
        transition select(pkt.lookahead<bit<32>>()) {
            (bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_CONTRIB << 16
            &&& 32w0xffff0000 | (bit<32>)(~SA_FLAG_COPY) << 8 | (bit<32>)(~((bit<8>)SA_MAX_WORKERS - 1)):
                parse_contribution_header;
#ifdef SA_TREES
            /* a parent's RESULT of K values: as a contribution, and told apart by md.result */
            (bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_RESULT << 16
            &&& 32w0xffff0000 | (bit<32>)(~SA_FLAG_COPY) << 8 | (bit<32>)(~((bit<8>)SA_MAX_WORKERS - 1)):
                parse_result_header;
#endif
            default: parse_switchagg;
        }
    }
    state parse_contribution_header {
        pkt.extract(hdr.sa);
        transition select(hdr.sa.owner, hdr.sa.count) {
            (0, SA_VALUES): parse_values;
            default: accept;
        }
    }
#ifdef SA_TREES
    state parse_result_header {
        pkt.extract(hdr.sa);
        transition select(hdr.sa.owner, hdr.sa.count) {
            (0, SA_VALUES): parse_result_values;
            default: accept;
        }
    }
    state parse_result_values {
        md.result = 1;
        transition parse_values;
    }
#endif
    /* A well-formed query is told in the parser too, as a contribution is: version 1, QUERY, no flag but
     * the copy, worker < 32; no reserved bits and a count of 0 (no values). It then takes the
     * contribution's path through admission and the first half's tag and workers, which it only
     * reads (main.p4). Any other header of this length (a probe among them) is validation's. */
    state parse_query {
        transition select(pkt.lookahead<bit<32>>()) {
            (bit<32>)SA_VERSION << 24 | (bit<32>)SA_TYPE_QUERY << 16
            &&& 32w0xffff0000 | (bit<32>)(~SA_FLAG_COPY) << 8 | (bit<32>)(~((bit<8>)SA_MAX_WORKERS - 1)):
                parse_query_header;
            default: parse_switchagg;
        }
    }
    state parse_query_header {
        pkt.extract(hdr.sa);
        transition select(hdr.sa.owner, hdr.sa.count) {
            (0, 0): well_formed_query;
            default: accept;
        }
    }
    state well_formed_query {
        md.query = 1;
        transition accept;
    }

    /* The first half is summed in this pass, the second carried to the next. A frame that ends before
     * the datagram does leaves vals_tail invalid (and the parser error set): malformed. */
    state parse_values {
        pkt.extract(hdr.vals_active);
        pkt.extract(hdr.vals_tail);
        transition accept;
    }

    /* Second pass: the first pass checked and admitted the contribution, and sent it round with what
     * it found (hdr.recirc); this pass sums the second half. */
    state second_pass {
        pkt.advance(PORT_METADATA_SIZE);
        md.half = 1;
        pkt.extract(hdr.recirc);
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.sa);
        pkt.extract(hdr.vals_head);
        pkt.extract(hdr.vals_active);
#ifdef SA_TREES
        transition select(hdr.sa.type) {
            SA_TYPE_RESULT: second_pass_result;
            default: accept;
        }
    }
    state second_pass_result {
        md.result = 1;
        transition accept;
#else
        transition accept;
#endif
    }
}

/* A reply to the sender (probe_reply, result_to_sender, a query's PENDING) gets its IPv4 checksum
 * here, worked out afresh from the header as it leaves (incoming checksums are not verified, docs/protocol.md
 * section 1); every other packet keeps the one it has. */
control SaIngressDeparser(packet_out pkt, inout sa_headers_t hdr, in sa_ingress_metadata_t md,
                          in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (md.reply == 1) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.recirc);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.sa);
        pkt.emit(hdr.vals_head);
        pkt.emit(hdr.vals_active);
        pkt.emit(hdr.vals_tail);
    }
}

/* Egress parses a packet only as far as it rewrites it: a replica of a finished sum up to the
 * switchagg header. The values, and everything of any other packet, pass through as payload. */
parser SaEgressParser(packet_in pkt, out sa_egress_headers_t hdr, out sa_egress_metadata_t md,
                      out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        transition select(hdr.bridge.kind) {
            SA_BRIDGE_RESULT: parse_result;
            default: accept;
        }
    }
    state parse_result {
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.sa);
        transition accept;
    }
}

/* The bridge header is not emitted. A replica's IPv4 header is the control plane's (egress.p4) but
 * for its checksum, worked out here. */
control SaEgressDeparser(packet_out pkt, inout sa_egress_headers_t hdr, in sa_egress_metadata_t md,
                         in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.sa);
    }
}
