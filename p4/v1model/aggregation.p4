/* The aggregation state and the order one packet touches it (docs/protocol.md, "Per-packet order"):
 * tag -> bitmap -> count -> exponent -> values, each register read-modify-written at most once, in
 * one action, and each stage deciding only from the packet and earlier stages -- what a Tofino
 * stateful ALU can do, so the TNA port is a translation. Registers are indexed by
 * 2 * (slot_base + slot) + copy. Power-up zeros read as empty: generation 0 is never installed.
 *
 * Each stage sets its outcome flags once, the control flow picks the action for the outcome, and
 * what is left to choose within an action is a mask ((bit<N>)flag - 1 is all ones when the flag is
 * 0), with no ?: in an action: BMv2 pays per field assignment and per operator, and p4c (run
 * without LocalCopyPropagation, switchagg/control/build.py) spills a ternary into two temporaries
 * (docs/protocol.md, section 8). */

/* Bit 31 of each of the 64 32-bit values in the 2048-bit values field. */
#define SA_VALUE_TOPS 2048w0x80000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000

control Aggregation(inout headers_t hdr) {
    register<bit<64>>(SA_NUM_COPIES) tag;      /* generation ++ chunk id held by the copy */
    register<bit<32>>(SA_NUM_COPIES) bitmap;   /* workers counted in the copy */
    register<bit<8>>(SA_NUM_COPIES) count;     /* how many */
    register<bit<8>>(SA_NUM_COPIES) exponent;  /* max proposed exponent, offset binary (int8 + 128) */
    register<bit<2048>>(SA_NUM_COPIES) values;  /* the K sums, 32 bits each */

    /* Stage 1: is the chunk new to the copy (other generation, or newer in serial-number order on
     * 32-bit ids: chunk - held in 1 .. 2^31 - 1), the one it holds, or older (stale)? Only a new
     * chunk changes the tag. */
    action tag_stage() {
        tag.read(hdr.local.tag, hdr.local.idx);
        hdr.local.fresh = (bit<1>)(hdr.local.tag[63:32] != hdr.sa.generation || hdr.sa.chunk - hdr.local.tag[31:0] - 1 < 0x7fffffff);
        hdr.local.stale = (bit<1>)(hdr.local.fresh == 0 && hdr.sa.chunk != hdr.local.tag[31:0]);
        hdr.local.tag = hdr.local.tag ^ ((hdr.local.tag ^ (hdr.sa.generation ++ hdr.sa.chunk)) & (0 - (bit<64>)hdr.local.fresh));
        tag.write(hdr.local.idx, hdr.local.tag);
    }

    /* Stages 2 to 5 each have an action for a fresh chunk, which starts the copy afresh without
     * reading it, and one or two for the chunk the copy holds, chosen by the earlier stages (on
     * Tofino, RegisterActions of one register, exactly one running per packet). */

    /* Stage 2: the worker's bit; on the chunk the copy holds, a bit already set means a repeat. */
    action bitmap_first() {
        hdr.local.seen = 0;
        hdr.local.bitmap = 32w1 << hdr.sa.worker;
        bitmap.write(hdr.local.idx, hdr.local.bitmap);
    }

    action bitmap_add() {
        bitmap.read(hdr.local.bitmap, hdr.local.idx);
        hdr.local.seen = (bit<1>)(hdr.local.bitmap >> hdr.sa.worker);
        hdr.local.bitmap = hdr.local.bitmap | (32w1 << hdr.sa.worker);
        bitmap.write(hdr.local.idx, hdr.local.bitmap);
    }

    /* Stage 3: a fresh chunk counts 1, a new worker adds 1, a repeat adds 0. */
    action count_first() {
        hdr.local.count = 1;
        count.write(hdr.local.idx, hdr.local.count);
    }

    action count_add() {
        count.read(hdr.local.count, hdr.local.idx);
        hdr.local.count = hdr.local.count + (bit<8>)(~hdr.local.seen);
        count.write(hdr.local.idx, hdr.local.count);
    }

    /* Stage 4: signed max of the exponents proposed for the slot's next chunk, kept in offset binary
     * (int8 + 128), where the unsigned max is the signed max. Like stage 5, one of three actions on
     * the register, chosen by the earlier stages: the first contribution writes its proposal, any
     * other contribution keeps the max (b ^ ((a ^ b) & -(a > b)), written out), a repeat of a
     * finished round reads it. The packet's exponent field carries the value on (offset binary
     * until a result is sent). */
    action exponent_write() {
        hdr.sa.exponent = hdr.sa.exponent ^ 0x80;
        exponent.write(hdr.local.idx, hdr.sa.exponent);
    }

    action exponent_read() {
        exponent.read(hdr.sa.exponent, hdr.local.idx);
    }

    action exponent_max() {
        exponent.read(hdr.local.exponent, hdr.local.idx);
        hdr.sa.exponent = hdr.local.exponent ^ (((hdr.sa.exponent ^ 0x80) ^ hdr.local.exponent)
                                           & (0 - (bit<8>)(bit<1>)((hdr.sa.exponent ^ 0x80) > hdr.local.exponent)));
        exponent.write(hdr.local.idx, hdr.sa.exponent);
    }

    /* Stage 5, values: one of three actions on the register, chosen by the earlier stages (on Tofino,
     * three RegisterActions of one register, exactly one running per packet). The first contribution
     * writes its values, a repeat of a finished round reads the sums, any other contribution adds.
     * The add is 64 independent 32-bit adds (modulo 2^32, no carry between values): add the low 31
     * bits of each value, then put each value's bit 31 back as the xor of both inputs' bit 31 and
     * the carry into it. The sum goes into the packet, and from there into the register. */
    action values_write() {
        values.write(hdr.local.idx, hdr.vals.values);
    }

    action values_read() {
        values.read(hdr.vals.values, hdr.local.idx);
    }

    action values_add() {
        values.read(hdr.local.held, hdr.local.idx);
        hdr.vals.values = ((hdr.local.held & ~SA_VALUE_TOPS) + (hdr.vals.values & ~SA_VALUE_TOPS))
                          ^ ((hdr.local.held ^ hdr.vals.values) & SA_VALUE_TOPS);
        values.write(hdr.local.idx, hdr.vals.values);
    }

    /* A stale chunk stops after the tag stage: it sets no other field of hdr.local. */
    apply {
        tag_stage();
        if (hdr.local.fresh == 1) {
            bitmap_first();
            count_first();
            exponent_write();
            values_write();
        } else if (hdr.local.stale == 0) {
            bitmap_add();
            count_add();
            if (hdr.local.seen == 0) {
                exponent_max();
                values_add();
            } else if (hdr.local.count == hdr.local.n_workers) {
                exponent_read();
                values_read();
            }
        }
    }
}
