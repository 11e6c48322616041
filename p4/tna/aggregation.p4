/* The state of a slot copy other than its values, in the order one packet touches it (docs/protocol.md
 * section 8, docs/tofino.md): the tag (a generation register, then a chunk register), the workers
 * counted, and the exponent. Each register has one stateful ALU, is read-modify-written at most once
 * per pass, in a stage after every stage it depends on. A packet carries its run's session generation
 * (any but 0: every register powers up as 0, so a packet of generation 0 is dropped), and a copy that
 * holds another generation's tag is empty to it.
 *
 * Each half of a copy's values has its own tag and workers (CopyState, once per pass), and each pass
 * runs the model's state machine on its half. Without a loss both halves go through the same
 * sequence, so they decide alike; if a recirculated packet is lost, the second half lacks that
 * worker until its retransmission, which the first half takes as a repeat and the second as the
 * contribution it missed. The second pass decides what becomes of the packet, and the exponent
 * follows its half.
 *
 * The count of workers is not kept apart from the bitmap: a half is complete when its bitmap holds
 * the job's workers (all_workers), and that needs no second read-modify-write. */

/* A half's copy index, (slot_base + slot) ++ copy: the first pass has the cell from admission (stage
 * 0), the second from the parser, so that its state starts in stage 0. */
#define SA_HALF_COPY_INDEX \
    (second_half ? hdr.recirc.cell[9:0] ++ hdr.sa.flags[0:0] : md.cell[9:0] ++ hdr.sa.flags[0:0])

control CopyState(in sa_headers_t hdr, inout sa_ingress_metadata_t md,
                  inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md)(bool second_half) {
    /* The generation the half holds. Another generation (another run's, another job's, power-up
     * zeros) means the half is empty: the packet's (its run's) is written and the chunk stage starts
     * the half afresh. */
    Register<bit<32>, copy_index_t>(SA_NUM_COPIES, 0) tag_generation;
    RegisterAction<bit<32>, copy_index_t, bit<8>>(tag_generation) tag_generation_update = {
        void apply(inout bit<32> value, out bit<8> changed) {
            changed = 0;
            if (value != hdr.sa.generation) {
                value = hdr.sa.generation;
                changed = 1;
            }
        }
    };
    /* A query's (the first half's): the same test, nothing written. Another generation: the half does
     * not hold the chunk; the packet's: the chunk stage tells. */
    RegisterAction<bit<32>, copy_index_t, bit<8>>(tag_generation) tag_generation_peek = {
        void apply(inout bit<32> value, out bit<8> tag) {
            if (value != hdr.sa.generation) {
                tag = SA_TAG_UNHELD;
            } else {
                tag = SA_TAG_PEEK;
            }
        }
    };

    /* The chunk the half holds. A chunk newer in serial-number order (chunk - held, as a signed
     * 32-bit number, above 0: the sign of the wrapped difference, which the stateful ALU compares as
     * such) is fresh and replaces it; the same chunk counts the worker; an older one is stale and
     * changes nothing. */
    Register<bit<32>, copy_index_t>(SA_NUM_COPIES, 0) tag_chunk;
    RegisterAction<bit<32>, copy_index_t, bit<8>>(tag_chunk) tag_chunk_start = {
        void apply(inout bit<32> value) {
            value = hdr.sa.chunk;
        }
    };
    RegisterAction<bit<32>, copy_index_t, bit<8>>(tag_chunk) tag_chunk_compare = {
        void apply(inout bit<32> value, out bit<8> tag) {
            if ((int<32>)hdr.sa.chunk - (int<32>)value > 0) {
                value = hdr.sa.chunk;
                tag = SA_TAG_FRESH;
            } else if (value == hdr.sa.chunk) {
                tag = SA_TAG_SAME;
            } else {
                tag = SA_TAG_STALE;
            }
        }
    };
    /* A query's: the same comparison, nothing written. A newer chunk has not arrived (the half does
     * not hold it); the same one is held; an older one is stale. */
    RegisterAction<bit<32>, copy_index_t, bit<8>>(tag_chunk) tag_chunk_peek = {
        void apply(inout bit<32> value, out bit<8> tag) {
            if ((int<32>)hdr.sa.chunk - (int<32>)value > 0) {
                tag = SA_TAG_UNHELD;
            } else if (value == hdr.sa.chunk) {
                tag = SA_TAG_HELD;
            } else {
                tag = SA_TAG_STALE;
            }
        }
    };

    /* The workers counted, one bit per rank. A fresh chunk starts the bitmap with the worker's bit
     * alone (nobody counted before); the chunk the half holds adds it, and returns the bitmap as it
     * was, from which the next stage tells a new worker from a repeat. */
    Register<bit<32>, copy_index_t>(SA_NUM_COPIES, 0) workers;
    RegisterAction<bit<32>, copy_index_t, bit<32>>(workers) workers_start = {
        void apply(inout bit<32> value) {
            value = md.worker_bit;
        }
    };
    RegisterAction<bit<32>, copy_index_t, bit<32>>(workers) workers_add = {
        void apply(inout bit<32> value, out bit<32> before) {
            before = value;
            value = value | md.worker_bit;
        }
    };
    /* A query's, where the half holds its chunk: the bitmap, as it is. */
    RegisterAction<bit<32>, copy_index_t, bit<32>>(workers) workers_read = {
        void apply(inout bit<32> value, out bit<32> held) {
            held = value;
        }
    };
#ifdef SA_TREES
    /* A parent's RESULT, where the half holds its chunk: taken (1, the parent's bit set: nothing is
     * missing from here on) where the half holds exactly the children's sum; else 0, and nothing
     * written (a copy not complete here, or one that took its result already). */
    RegisterAction<bit<32>, copy_index_t, bit<32>>(workers) workers_take = {
        void apply(inout bit<32> value, out bit<32> taken) {
            if (value == md.other_workers) {
                value = value | md.worker_bit;  /* the parent's: a stateful ALU takes two PHV inputs */
                taken = 1;
            } else {
                taken = 0;
            }
        }
    };
#endif

    action check_generation() {
        md.new_generation = tag_generation_update.execute(SA_HALF_COPY_INDEX);
    }
    action peek_generation() {
        md.tag = tag_generation_peek.execute(SA_HALF_COPY_INDEX);
    }

    /* The first half's first stage: admission's verdict on a contribution of K values or a query, in
     * the model's order (not admitted; generation 0, which every tag powers up holding; a slot the
     * job does not have), as a table that runs the generation stage itself (a query's reads it), so
     * that the tag starts in the stage after admission. (The second pass was admitted in the first.)
     * Its entries are tried in order: an admitted packet of generation 0 is wrong_generation first,
     * then any generation goes on to the slot check and the generation stage; a packet admission did
     * not find matches none. */
    action drop_not_admitted() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_NOT_ADMITTED;
        ig_dprsr_md.drop_ctl = 1;
    }
#ifdef SA_TREES
    /* A RESULT from anyone but a parent of one of the jobs (as on a switch with no tree) */
    action drop_malformed() {
        md.count_global = 1;
        md.global_drop = (bit<8>)SA_DROP_MALFORMED;
        ig_dprsr_md.drop_ctl = 1;
    }
#endif
    action drop_job(bit<8> event) {
        md.count_job = 1;
        md.job_event = (job_event_t)event;
        ig_dprsr_md.drop_ctl = 1;
    }
    action wrong_generation() {
        drop_job(SA_JOB_WRONG_GENERATION);
    }
    action slot_out_of_range() {
        drop_job(SA_JOB_SLOT_OUT_OF_RANGE);
    }

#ifdef SA_TREES
    /* With trees, a parent's RESULT takes a query's read-only generation stage, and one that admission
     * did not find is malformed, as the model has it. */
    table admitted {
        key = {
            md.admitted: ternary;
            hdr.sa.generation: ternary;
            md.slot_room: ternary;
            md.query: ternary;
            md.result: ternary;
        }
        actions = {
            check_generation; peek_generation; drop_not_admitted; drop_malformed; wrong_generation;
            slot_out_of_range;
        }
        const entries = {
            (1, 0, _, _, _): wrong_generation();
            (1, _, 0, _, _): slot_out_of_range();
            (1, _, _, 0, 0): check_generation();
            (1, _, _, _, _): peek_generation();
            (0, _, _, _, 1): drop_malformed();
        }
        const default_action = drop_not_admitted();
        size = 8;
    }
#else
    table admitted {
        key = {
            md.admitted: ternary;
            hdr.sa.generation: ternary;
            md.slot_room: ternary;
            md.query: ternary;
        }
        actions = {
            check_generation; peek_generation; drop_not_admitted; wrong_generation; slot_out_of_range;
        }
        const entries = {
            (1, 0, _, _): wrong_generation();
            (1, _, 0, _): slot_out_of_range();
            (1, _, _, 0): check_generation();
            (1, _, _, 1): peek_generation();
        }
        const default_action = drop_not_admitted();
        size = 4;
    }
#endif
    action start_chunk() {
        tag_chunk_start.execute(SA_HALF_COPY_INDEX);
        md.tag = SA_TAG_FRESH;
    }
    action compare_chunk() {
        md.tag = tag_chunk_compare.execute(SA_HALF_COPY_INDEX);
    }
    action start_workers() {
        workers_start.execute(SA_HALF_COPY_INDEX);
        md.workers_before = 0;
    }
    action add_worker() {
        md.workers_before = workers_add.execute(SA_HALF_COPY_INDEX);
    }
    action peek_chunk() {
        md.tag = tag_chunk_peek.execute(SA_HALF_COPY_INDEX);
    }
    action read_workers() {
        md.workers_before = workers_read.execute(SA_HALF_COPY_INDEX);
    }
#ifdef SA_TREES
    action take_workers() {
        md.workers_before = workers_take.execute(SA_HALF_COPY_INDEX);
        md.tag = SA_TAG_TAKE;
    }
#endif

    /* Tag, then workers: three stages. A stale chunk stops after the tag. md.new_generation is
     * SA_NOT_CHECKED (the parser's) where the generation stage did not run, as for a query, which
     * runs the same three stages on the first half with the read-only actions, keeping its verdict in
     * md.tag from the generation stage on (SA_TAG_PEEK, then SA_TAG_UNHELD, SA_TAG_HELD or
     * SA_TAG_STALE), and reads the workers where the half holds its chunk. */
    apply {
#ifdef SA_TREES
        if (!second_half) {
            admitted.apply();
        } else if (md.result == 1) {  /* a parent's RESULT reads the tag in both halves */
            peek_generation();
        } else {
            check_generation();
        }
#else
        if (second_half) {
            check_generation();
        } else {
            admitted.apply();
        }
#endif
        if (md.new_generation == 1) {
            start_chunk();
        } else if (md.new_generation == 0) {
            compare_chunk();
#ifdef SA_TREES
        } else if (md.tag == SA_TAG_PEEK) {  /* a query's (first half) or a parent's RESULT's (both) */
#else
        } else if (!second_half && md.tag == SA_TAG_PEEK) {
#endif
            peek_chunk();
        }
        if (md.tag == SA_TAG_FRESH) {
            start_workers();
        } else if (md.tag == SA_TAG_SAME) {
            add_worker();
#ifdef SA_TREES
        } else if (md.tag == SA_TAG_HELD && md.result == 1) {  /* taken where the half holds exactly the children */
            take_workers();
#endif
        } else if (!second_half && md.tag == SA_TAG_HELD) {
            read_workers();
        }
    }
}

/* The second pass's decision, in the stage after its workers stage: the op on its half (a fresh
 * chunk: WRITE; the chunk the half holds, from a worker whose bit was set: READ, a repeat; else ADD),
 * the job's workers the half still lacks with this packet's (none: complete), and the exponent, the
 * signed maximum of the proposals (int8): written by a fresh chunk, raised by a new worker (the
 * packet carries the maximum on, to the result), read into the packet by a repeat. */
control ExponentStage(inout sa_headers_t hdr, inout sa_ingress_metadata_t md) {
    Register<int<8>, copy_index_t>(SA_NUM_COPIES, 0) exponent;
    RegisterAction<int<8>, copy_index_t, int<8>>(exponent) exponent_write = {
        void apply(inout int<8> value) {
            value = hdr.sa.exponent;
        }
    };
    RegisterAction<int<8>, copy_index_t, int<8>>(exponent) exponent_max = {
        void apply(inout int<8> value, out int<8> kept) {
            value = max(value, hdr.sa.exponent);
            kept = value;
        }
    };
    RegisterAction<int<8>, copy_index_t, int<8>>(exponent) exponent_read = {
        void apply(inout int<8> value, out int<8> kept) {
            kept = value;
        }
    };

    action write() {
        md.op = SA_OP_WRITE;
        md.second_op = SA_OP_WRITE;
        md.workers_missing = md.other_workers;
        exponent_write.execute(md.cell[9:0] ++ hdr.sa.flags[0:0]);
    }
    action add() {
        md.op = SA_OP_ADD;
        md.second_op = SA_OP_ADD;
        md.workers_missing = md.workers_before ^ md.other_workers;
        hdr.sa.exponent = exponent_max.execute(md.cell[9:0] ++ hdr.sa.flags[0:0]);
    }
    action read() {
        md.op = SA_OP_READ;
        md.second_op = SA_OP_READ;
        md.workers_missing = md.workers_before ^ md.all_workers;
        hdr.sa.exponent = exponent_read.execute(md.cell[9:0] ++ hdr.sa.flags[0:0]);
    }

#ifdef SA_TREES
    /* A parent's RESULT taken: its values and exponent written, nothing missing (the parent's bit set). */
    action replace() {
        md.op = SA_OP_WRITE;
        md.second_op = SA_OP_WRITE;
        md.workers_missing = 0;
        exponent_write.execute(md.cell[9:0] ++ hdr.sa.flags[0:0]);
    }
#endif

    table exponent_op {
        key = {
            md.tag: ternary;
            md.workers_before: ternary;
            hdr.sa.worker: ternary;
        }
#ifdef SA_TREES
        actions = { write; add; read; replace; @defaultonly NoAction; }
#else
        actions = { write; add; read; @defaultonly NoAction; }
#endif
        const entries = {
#ifdef SA_TREES
            (SA_TAG_TAKE, 1, _): replace();
#endif
            (SA_TAG_FRESH, _, _): write();
            (SA_TAG_SAME, 32w1 << 0 &&& 32w1 << 0, 0): read();
            (SA_TAG_SAME, 32w1 << 1 &&& 32w1 << 1, 1): read();
            (SA_TAG_SAME, 32w1 << 2 &&& 32w1 << 2, 2): read();
            (SA_TAG_SAME, 32w1 << 3 &&& 32w1 << 3, 3): read();
            (SA_TAG_SAME, 32w1 << 4 &&& 32w1 << 4, 4): read();
            (SA_TAG_SAME, 32w1 << 5 &&& 32w1 << 5, 5): read();
            (SA_TAG_SAME, 32w1 << 6 &&& 32w1 << 6, 6): read();
            (SA_TAG_SAME, 32w1 << 7 &&& 32w1 << 7, 7): read();
            (SA_TAG_SAME, 32w1 << 8 &&& 32w1 << 8, 8): read();
            (SA_TAG_SAME, 32w1 << 9 &&& 32w1 << 9, 9): read();
            (SA_TAG_SAME, 32w1 << 10 &&& 32w1 << 10, 10): read();
            (SA_TAG_SAME, 32w1 << 11 &&& 32w1 << 11, 11): read();
            (SA_TAG_SAME, 32w1 << 12 &&& 32w1 << 12, 12): read();
            (SA_TAG_SAME, 32w1 << 13 &&& 32w1 << 13, 13): read();
            (SA_TAG_SAME, 32w1 << 14 &&& 32w1 << 14, 14): read();
            (SA_TAG_SAME, 32w1 << 15 &&& 32w1 << 15, 15): read();
            (SA_TAG_SAME, 32w1 << 16 &&& 32w1 << 16, 16): read();
            (SA_TAG_SAME, 32w1 << 17 &&& 32w1 << 17, 17): read();
            (SA_TAG_SAME, 32w1 << 18 &&& 32w1 << 18, 18): read();
            (SA_TAG_SAME, 32w1 << 19 &&& 32w1 << 19, 19): read();
            (SA_TAG_SAME, 32w1 << 20 &&& 32w1 << 20, 20): read();
            (SA_TAG_SAME, 32w1 << 21 &&& 32w1 << 21, 21): read();
            (SA_TAG_SAME, 32w1 << 22 &&& 32w1 << 22, 22): read();
            (SA_TAG_SAME, 32w1 << 23 &&& 32w1 << 23, 23): read();
            (SA_TAG_SAME, 32w1 << 24 &&& 32w1 << 24, 24): read();
            (SA_TAG_SAME, 32w1 << 25 &&& 32w1 << 25, 25): read();
            (SA_TAG_SAME, 32w1 << 26 &&& 32w1 << 26, 26): read();
            (SA_TAG_SAME, 32w1 << 27 &&& 32w1 << 27, 27): read();
            (SA_TAG_SAME, 32w1 << 28 &&& 32w1 << 28, 28): read();
            (SA_TAG_SAME, 32w1 << 29 &&& 32w1 << 29, 29): read();
            (SA_TAG_SAME, 32w1 << 30 &&& 32w1 << 30, 30): read();
            (SA_TAG_SAME, 32w1 << 31 &&& 32w1 << 31, 31): read();
            (SA_TAG_SAME, _, _): add();
        }
        const default_action = NoAction();
        size = 64;
    }

    apply {
        exponent_op.apply();
    }
}
