/* The values: SA_VALUES_PER_PASS registers of 32-bit sums, one stateful ALU each, four to a stage, eight
 * stages. Each register holds, for every copy, the sum of one value of each half of the packet: value
 * j of the first half at (copy ++ 0), summed in the first pass, value j of the second half at
 * (copy ++ 1), summed in the second (docs/tofino.md). Each pass runs one RegisterAction on each
 * register, the same op on all of them: write the packet's value (a fresh chunk), add it and return
 * the sum (a new worker), or return the sum (a repeat), into the packet's value; nothing for a stale
 * chunk or a packet that is not a contribution.
 *
 * decide, in the stage after the first pass's workers stage, picks that pass's op from the tag and
 * the workers counted before (a repeat has its bit already set: a ternary match, one entry per
 * worker), and runs it on the first four registers itself, so that the values take the eight stages
 * after the workers stage and the first pass fits Tofino's twelve. In the second pass it runs the op
 * ExponentStage decided a stage before. group_1 .. group_7 run md.op on the others. */

#define SA_VALUE_INDEX (md.cell[9:0] ++ hdr.sa.flags[0:0] ++ md.half)

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
    };

/* One stage's four registers: the actions that run one op on all of them */
#define SA_VALUE_GROUP(g, a, b, c, d) \
    SA_VALUE_REGISTER(a) \
    SA_VALUE_REGISTER(b) \
    SA_VALUE_REGISTER(c) \
    SA_VALUE_REGISTER(d) \
    action write_##g() { \
        values_##a##_write.execute(SA_VALUE_INDEX); \
        values_##b##_write.execute(SA_VALUE_INDEX); \
        values_##c##_write.execute(SA_VALUE_INDEX); \
        values_##d##_write.execute(SA_VALUE_INDEX); \
    } \
    action add_##g() { \
        hdr.vals_active.v##a = values_##a##_add.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##b = values_##b##_add.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##c = values_##c##_add.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##d = values_##d##_add.execute(SA_VALUE_INDEX); \
    } \
    action read_##g() { \
        hdr.vals_active.v##a = values_##a##_read.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##b = values_##b##_read.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##c = values_##c##_read.execute(SA_VALUE_INDEX); \
        hdr.vals_active.v##d = values_##d##_read.execute(SA_VALUE_INDEX); \
    }

/* A stage after decide: md.op on its four registers */
#define SA_VALUE_GROUP_TABLE(g) \
    table group_##g { \
        key = { md.op: exact; } \
        actions = { write_##g; add_##g; read_##g; @defaultonly NoAction; } \
        const entries = { \
            SA_OP_WRITE: write_##g(); \
            SA_OP_ADD: add_##g(); \
            SA_OP_READ: read_##g(); \
        } \
        const default_action = NoAction(); \
        size = 4; \
    }

control Values(inout sa_headers_t hdr, inout sa_ingress_metadata_t md) {
    SA_VALUE_GROUP(0, 00, 01, 02, 03)
    SA_VALUE_GROUP(1, 04, 05, 06, 07)
    SA_VALUE_GROUP(2, 08, 09, 10, 11)
    SA_VALUE_GROUP(3, 12, 13, 14, 15)
    SA_VALUE_GROUP(4, 16, 17, 18, 19)
    SA_VALUE_GROUP(5, 20, 21, 22, 23)
    SA_VALUE_GROUP(6, 24, 25, 26, 27)
    SA_VALUE_GROUP(7, 28, 29, 30, 31)

    /* The first pass's op, into md.op for the stages after. */
    action first_write() {
        md.op = SA_OP_WRITE;
        write_0();
    }
    action first_add() {
        md.op = SA_OP_ADD;
        add_0();
    }
    action first_read() {
        md.op = SA_OP_READ;
        read_0();
    }

    table decide {
        key = {
            md.half: ternary;
            md.op: ternary;                /* the second pass's, decided a stage before (aggregation.p4) */
            md.tag: ternary;
            md.workers_before: ternary;
            hdr.sa.worker: ternary;
        }
        actions = { first_write; first_add; first_read; write_0; add_0; read_0; @defaultonly NoAction; }
        const entries = {
            (1, SA_OP_WRITE, _, _, _): write_0();
            (1, SA_OP_ADD, _, _, _): add_0();
            (1, SA_OP_READ, _, _, _): read_0();
            (0, _, SA_TAG_FRESH, _, _): first_write();
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

    SA_VALUE_GROUP_TABLE(1)
    SA_VALUE_GROUP_TABLE(2)
    SA_VALUE_GROUP_TABLE(3)
    SA_VALUE_GROUP_TABLE(4)
    SA_VALUE_GROUP_TABLE(5)
    SA_VALUE_GROUP_TABLE(6)
    SA_VALUE_GROUP_TABLE(7)

    apply {
        decide.apply();
        group_1.apply();
        group_2.apply();
        group_3.apply();
        group_4.apply();
        group_5.apply();
        group_6.apply();
        group_7.apply();
    }
}
