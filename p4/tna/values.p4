/* The values: SA_VALUES_PER_PASS registers of 32-bit sums, one stateful ALU each, four to a stage, eight
 * stages. Each register holds, for every copy, the sum of one value of each half of the packet: value
 * j of the first half at (copy ++ 0), summed in the first pass, value j of the second half at
 * (copy ++ 1), summed in the second (docs/tofino.md). Each pass runs one RegisterAction on each
 * register, the same op on all of them: write the packet's value (a fresh chunk), add it and return
 * the sum (a new worker), or return the sum (a repeat), into the packet's value; nothing for a stale
 * chunk or a packet that is not a contribution.
 *
 * One table per register (bf-p4c takes one stateful ALU output per action). The first four, in the
 * stage after the first pass's workers stage, decide that pass's op themselves from the tag and the
 * workers counted before (a repeat has its bit already set: a ternary match, one entry per worker),
 * and decide_00 records it in md.op for the others; so the values take the eight stages after the
 * workers stage and the first pass fits Tofino's twelve. In the second pass they run the op
 * ExponentStage decided a stage before (md.second_op). value_04 .. value_31 run md.op. */

#define SA_VALUE_INDEX (md.cell[9:0] ++ hdr.sa.flags[0:0] ++ md.half)

/* Register n, its three RegisterActions and the actions that run them into the packet's value n */
#define SA_VALUE_REGISTER(n) \
    Register<bit<32>, value_index_t>(SA_VALUE_CELLS, 0) values_##n; \
    RegisterAction<bit<32>, value_index_t, bit<32>>(values_##n) values_##n##_write = { \
        void apply(inout bit<32> value) { \
            value = hdr.vals_active.v##n; \
        } \
    }; \
    RegisterAction<bit<32>, value_index_t, bit<32>>(values_##n) values_##n##_add = { \
        void apply(inout bit<32> value, out bit<32> sum) { \
            value = value + hdr.vals_active.v##n; \
            sum = value; \
        } \
    }; \
    RegisterAction<bit<32>, value_index_t, bit<32>>(values_##n) values_##n##_read = { \
        void apply(inout bit<32> value, out bit<32> sum) { \
            sum = value; \
        } \
    }; \
    action write_##n() { \
        values_##n##_write.execute(SA_VALUE_INDEX); \
    } \
    action add_##n() { \
        hdr.vals_active.v##n = values_##n##_add.execute(SA_VALUE_INDEX); \
    } \
    action read_##n() { \
        hdr.vals_active.v##n = values_##n##_read.execute(SA_VALUE_INDEX); \
    }

/* A register after the decision: md.op on it */
#define SA_VALUE_TABLE(n) \
    table value_##n { \
        key = { md.op: exact; } \
        actions = { write_##n; add_##n; read_##n; @defaultonly NoAction; } \
        const entries = { \
            SA_OP_WRITE: write_##n(); \
            SA_OP_ADD: add_##n(); \
            SA_OP_READ: read_##n(); \
        } \
        const default_action = NoAction(); \
        size = 4; \
    }

/* A register of the decision's stage: its entries. The second pass runs the op decided (md.op); the
 * first decides: a fresh chunk writes; the chunk the half holds, from a worker whose bit was already
 * set, reads (a repeat); from any other worker, adds. */
#ifdef SA_TREES
/* and a parent's RESULT that its half took is written, as a fresh chunk is */
#define SA_DECIDE_TAKEN(write) (0, _, SA_TAG_TAKE, 1, _): write;
#else
#define SA_DECIDE_TAKEN(write)
#endif
#define SA_DECIDE_ENTRIES(write, add, read) \
            (1, SA_OP_WRITE, _, _, _): write; \
            (1, SA_OP_ADD, _, _, _): add; \
            (1, SA_OP_READ, _, _, _): read; \
            (0, _, SA_TAG_FRESH, _, _): write; \
            SA_DECIDE_TAKEN(write) \
            (0, _, SA_TAG_SAME, 32w1 << 0 &&& 32w1 << 0, 0): read; \
            (0, _, SA_TAG_SAME, 32w1 << 1 &&& 32w1 << 1, 1): read; \
            (0, _, SA_TAG_SAME, 32w1 << 2 &&& 32w1 << 2, 2): read; \
            (0, _, SA_TAG_SAME, 32w1 << 3 &&& 32w1 << 3, 3): read; \
            (0, _, SA_TAG_SAME, 32w1 << 4 &&& 32w1 << 4, 4): read; \
            (0, _, SA_TAG_SAME, 32w1 << 5 &&& 32w1 << 5, 5): read; \
            (0, _, SA_TAG_SAME, 32w1 << 6 &&& 32w1 << 6, 6): read; \
            (0, _, SA_TAG_SAME, 32w1 << 7 &&& 32w1 << 7, 7): read; \
            (0, _, SA_TAG_SAME, 32w1 << 8 &&& 32w1 << 8, 8): read; \
            (0, _, SA_TAG_SAME, 32w1 << 9 &&& 32w1 << 9, 9): read; \
            (0, _, SA_TAG_SAME, 32w1 << 10 &&& 32w1 << 10, 10): read; \
            (0, _, SA_TAG_SAME, 32w1 << 11 &&& 32w1 << 11, 11): read; \
            (0, _, SA_TAG_SAME, 32w1 << 12 &&& 32w1 << 12, 12): read; \
            (0, _, SA_TAG_SAME, 32w1 << 13 &&& 32w1 << 13, 13): read; \
            (0, _, SA_TAG_SAME, 32w1 << 14 &&& 32w1 << 14, 14): read; \
            (0, _, SA_TAG_SAME, 32w1 << 15 &&& 32w1 << 15, 15): read; \
            (0, _, SA_TAG_SAME, 32w1 << 16 &&& 32w1 << 16, 16): read; \
            (0, _, SA_TAG_SAME, 32w1 << 17 &&& 32w1 << 17, 17): read; \
            (0, _, SA_TAG_SAME, 32w1 << 18 &&& 32w1 << 18, 18): read; \
            (0, _, SA_TAG_SAME, 32w1 << 19 &&& 32w1 << 19, 19): read; \
            (0, _, SA_TAG_SAME, 32w1 << 20 &&& 32w1 << 20, 20): read; \
            (0, _, SA_TAG_SAME, 32w1 << 21 &&& 32w1 << 21, 21): read; \
            (0, _, SA_TAG_SAME, 32w1 << 22 &&& 32w1 << 22, 22): read; \
            (0, _, SA_TAG_SAME, 32w1 << 23 &&& 32w1 << 23, 23): read; \
            (0, _, SA_TAG_SAME, 32w1 << 24 &&& 32w1 << 24, 24): read; \
            (0, _, SA_TAG_SAME, 32w1 << 25 &&& 32w1 << 25, 25): read; \
            (0, _, SA_TAG_SAME, 32w1 << 26 &&& 32w1 << 26, 26): read; \
            (0, _, SA_TAG_SAME, 32w1 << 27 &&& 32w1 << 27, 27): read; \
            (0, _, SA_TAG_SAME, 32w1 << 28 &&& 32w1 << 28, 28): read; \
            (0, _, SA_TAG_SAME, 32w1 << 29 &&& 32w1 << 29, 29): read; \
            (0, _, SA_TAG_SAME, 32w1 << 30 &&& 32w1 << 30, 30): read; \
            (0, _, SA_TAG_SAME, 32w1 << 31 &&& 32w1 << 31, 31): read; \
            (0, _, SA_TAG_SAME, _, _): add;

#define SA_DECIDE_KEY \
        key = { \
            md.half: ternary; \
            md.second_op: ternary;         /* the second pass's, decided a stage before (aggregation.p4) */ \
            md.tag: ternary; \
            md.workers_before: ternary; \
            hdr.sa.worker: ternary; \
        }

control Values(inout sa_headers_t hdr, inout sa_ingress_metadata_t md) {
    SA_VALUE_REGISTER(00)
    SA_VALUE_REGISTER(01)
    SA_VALUE_REGISTER(02)
    SA_VALUE_REGISTER(03)
    SA_VALUE_REGISTER(04)
    SA_VALUE_REGISTER(05)
    SA_VALUE_REGISTER(06)
    SA_VALUE_REGISTER(07)
    SA_VALUE_REGISTER(08)
    SA_VALUE_REGISTER(09)
    SA_VALUE_REGISTER(10)
    SA_VALUE_REGISTER(11)
    SA_VALUE_REGISTER(12)
    SA_VALUE_REGISTER(13)
    SA_VALUE_REGISTER(14)
    SA_VALUE_REGISTER(15)
    SA_VALUE_REGISTER(16)
    SA_VALUE_REGISTER(17)
    SA_VALUE_REGISTER(18)
    SA_VALUE_REGISTER(19)
    SA_VALUE_REGISTER(20)
    SA_VALUE_REGISTER(21)
    SA_VALUE_REGISTER(22)
    SA_VALUE_REGISTER(23)
    SA_VALUE_REGISTER(24)
    SA_VALUE_REGISTER(25)
    SA_VALUE_REGISTER(26)
    SA_VALUE_REGISTER(27)
    SA_VALUE_REGISTER(28)
    SA_VALUE_REGISTER(29)
    SA_VALUE_REGISTER(30)
    SA_VALUE_REGISTER(31)

    /* decide_00 also records the first pass's op for the registers after it. */
    action first_write() {
        md.op = SA_OP_WRITE;
        write_00();
    }
    action first_add() {
        md.op = SA_OP_ADD;
        add_00();
    }
    action first_read() {
        md.op = SA_OP_READ;
        read_00();
    }

    table decide_00 {
        SA_DECIDE_KEY
        actions = { first_write; first_add; first_read; write_00; add_00; read_00; @defaultonly NoAction; }
        const entries = {
            (1, SA_OP_WRITE, _, _, _): write_00();
            (1, SA_OP_ADD, _, _, _): add_00();
            (1, SA_OP_READ, _, _, _): read_00();
            (0, _, SA_TAG_FRESH, _, _): first_write();
            SA_DECIDE_TAKEN(first_write())
            (0, _, SA_TAG_SAME, 32w1 << 0 &&& 32w1 << 0, 0): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 1 &&& 32w1 << 1, 1): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 2 &&& 32w1 << 2, 2): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 3 &&& 32w1 << 3, 3): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 4 &&& 32w1 << 4, 4): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 5 &&& 32w1 << 5, 5): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 6 &&& 32w1 << 6, 6): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 7 &&& 32w1 << 7, 7): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 8 &&& 32w1 << 8, 8): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 9 &&& 32w1 << 9, 9): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 10 &&& 32w1 << 10, 10): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 11 &&& 32w1 << 11, 11): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 12 &&& 32w1 << 12, 12): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 13 &&& 32w1 << 13, 13): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 14 &&& 32w1 << 14, 14): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 15 &&& 32w1 << 15, 15): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 16 &&& 32w1 << 16, 16): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 17 &&& 32w1 << 17, 17): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 18 &&& 32w1 << 18, 18): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 19 &&& 32w1 << 19, 19): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 20 &&& 32w1 << 20, 20): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 21 &&& 32w1 << 21, 21): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 22 &&& 32w1 << 22, 22): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 23 &&& 32w1 << 23, 23): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 24 &&& 32w1 << 24, 24): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 25 &&& 32w1 << 25, 25): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 26 &&& 32w1 << 26, 26): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 27 &&& 32w1 << 27, 27): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 28 &&& 32w1 << 28, 28): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 29 &&& 32w1 << 29, 29): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 30 &&& 32w1 << 30, 30): first_read();
            (0, _, SA_TAG_SAME, 32w1 << 31 &&& 32w1 << 31, 31): first_read();
            (0, _, SA_TAG_SAME, _, _): first_add();
        }
        const default_action = NoAction();
        size = 64;
    }
    table decide_01 {
        SA_DECIDE_KEY
        actions = { write_01; add_01; read_01; @defaultonly NoAction; }
        const entries = {
            SA_DECIDE_ENTRIES(write_01(), add_01(), read_01())
        }
        const default_action = NoAction();
        size = 64;
    }
    table decide_02 {
        SA_DECIDE_KEY
        actions = { write_02; add_02; read_02; @defaultonly NoAction; }
        const entries = {
            SA_DECIDE_ENTRIES(write_02(), add_02(), read_02())
        }
        const default_action = NoAction();
        size = 64;
    }
    table decide_03 {
        SA_DECIDE_KEY
        actions = { write_03; add_03; read_03; @defaultonly NoAction; }
        const entries = {
            SA_DECIDE_ENTRIES(write_03(), add_03(), read_03())
        }
        const default_action = NoAction();
        size = 64;
    }

    SA_VALUE_TABLE(04)
    SA_VALUE_TABLE(05)
    SA_VALUE_TABLE(06)
    SA_VALUE_TABLE(07)
    SA_VALUE_TABLE(08)
    SA_VALUE_TABLE(09)
    SA_VALUE_TABLE(10)
    SA_VALUE_TABLE(11)
    SA_VALUE_TABLE(12)
    SA_VALUE_TABLE(13)
    SA_VALUE_TABLE(14)
    SA_VALUE_TABLE(15)
    SA_VALUE_TABLE(16)
    SA_VALUE_TABLE(17)
    SA_VALUE_TABLE(18)
    SA_VALUE_TABLE(19)
    SA_VALUE_TABLE(20)
    SA_VALUE_TABLE(21)
    SA_VALUE_TABLE(22)
    SA_VALUE_TABLE(23)
    SA_VALUE_TABLE(24)
    SA_VALUE_TABLE(25)
    SA_VALUE_TABLE(26)
    SA_VALUE_TABLE(27)
    SA_VALUE_TABLE(28)
    SA_VALUE_TABLE(29)
    SA_VALUE_TABLE(30)
    SA_VALUE_TABLE(31)

    apply {
        decide_00.apply();
        decide_01.apply();
        decide_02.apply();
        decide_03.apply();
        value_04.apply();
        value_05.apply();
        value_06.apply();
        value_07.apply();
        value_08.apply();
        value_09.apply();
        value_10.apply();
        value_11.apply();
        value_12.apply();
        value_13.apply();
        value_14.apply();
        value_15.apply();
        value_16.apply();
        value_17.apply();
        value_18.apply();
        value_19.apply();
        value_20.apply();
        value_21.apply();
        value_22.apply();
        value_23.apply();
        value_24.apply();
        value_25.apply();
        value_26.apply();
        value_27.apply();
        value_28.apply();
        value_29.apply();
        value_30.apply();
        value_31.apply();
    }
}
