/* The aggregation state and the order one packet touches it (docs/protocol.md, "Per-packet order"):
 * tag -> bitmap -> count -> exponent -> values, each register read-modify-written at most once, in
 * one action, and each stage deciding only from the packet and earlier stages -- what a Tofino
 * stateful ALU can do, so the TNA port is a translation. Registers are indexed by
 * 2 * (slot_base + slot) + copy. Power-up zeros read as empty: generation 0 is never installed. */

/* Bit 31 of each of the 64 32-bit values in the 2048-bit values field. */
#define SA_VALUE_TOPS 2048w0x80000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000

control Aggregation(inout headers_t hdr, inout sa_metadata_t meta) {
    register<bit<64>>(SA_NUM_COPIES) tag;      /* generation ++ chunk id held by the copy */
    register<bit<32>>(SA_NUM_COPIES) bitmap;   /* workers counted in the copy */
    register<bit<8>>(SA_NUM_COPIES) count;     /* how many */
    register<bit<8>>(SA_NUM_COPIES) exponent;  /* max proposed exponent (int8) */
    register<bit<2048>>(SA_NUM_COPIES) values;  /* the K sums, 32 bits each */

    /* Stage 1: is the chunk new to the copy (older chunk, other generation, or empty), the one it
     * holds, or older (serial-number order on 32-bit ids: newer within half the space)? */
    action tag_stage() {
        bit<64> stored;
        tag.read(stored, meta.idx);
        bit<32> diff = hdr.sa.chunk - stored[31:0];
        bool other_generation = stored[63:32] != hdr.sa.generation;
        bool newer = diff != 0 && diff[31:31] == 0;
        meta.tag = (other_generation || newer) ? SA_TAG_NEW : (diff == 0 ? SA_TAG_SAME : SA_TAG_STALE);
        tag.write(meta.idx, meta.tag == SA_TAG_NEW ? hdr.sa.generation ++ hdr.sa.chunk : stored);
    }

    /* Stage 2: set this worker's bit; a bit already set means a repeat. */
    action bitmap_stage() {
        bit<32> old;
        bitmap.read(old, meta.idx);
        bit<32> base = meta.tag == SA_TAG_NEW ? 32w0 : old;
        bit<32> wbit = 32w1 << hdr.sa.worker;
        meta.seen = (base & wbit) == 0 ? 1w0 : 1w1;
        bitmap.write(meta.idx, base | wbit);
    }

    /* Stage 3: first write resets to 1, a new worker increments, a repeat only reads. */
    action count_stage() {
        bit<8> c;
        count.read(c, meta.idx);
        c = meta.tag == SA_TAG_NEW ? 8w1 : (meta.seen == 1 ? c : c + 1);
        count.write(meta.idx, c);
        meta.count = c;
    }

    /* Stage 4: signed max of the exponents proposed for the slot's next chunk. */
    action exponent_stage() {
        bit<8> e;
        exponent.read(e, meta.idx);
        bit<8> mine = hdr.sa.exponent;
        bit<8> larger = (mine ^ 8w0x80) > (e ^ 8w0x80) ? mine : e;  /* signed compare, unsigned ALU */
        e = meta.tag == SA_TAG_NEW ? mine : (meta.seen == 1 ? e : larger);
        exponent.write(meta.idx, e);
        meta.exponent = e;
    }

    /* Stage 5, values: one of three actions on the register, chosen by the earlier stages (on Tofino,
     * three RegisterActions of one register, exactly one running per packet). The first contribution
     * writes its values, a repeat of a finished round reads the sums, any other contribution adds.
     * The add is 64 independent 32-bit adds (modulo 2^32, no carry between values): add the low 31
     * bits of each value, then put each value's bit 31 back as the xor of both inputs' bit 31 and
     * the carry into it. The packet carries the register's new content onward. */
    action values_write() {
        values.write(meta.idx, hdr.vals.values);
    }

    action values_read() {
        values.read(hdr.vals.values, meta.idx);
    }

    action values_add() {
        bit<2048> v;
        values.read(v, meta.idx);
        bit<2048> p = hdr.vals.values;
        v = ((v & ~SA_VALUE_TOPS) + (p & ~SA_VALUE_TOPS)) ^ ((v ^ p) & SA_VALUE_TOPS);
        values.write(meta.idx, v);
        hdr.vals.values = v;
    }

    apply {
        meta.idx = (((bit<32>)meta.slot_base + (bit<32>)hdr.sa.slot) << 1)
                   | (bit<32>)(hdr.sa.flags & SA_FLAG_COPY);
        tag_stage();
        if (meta.tag != SA_TAG_STALE) {
            bitmap_stage();
            count_stage();
            if (meta.seen == 0 || meta.count == meta.n_workers) {
                exponent_stage();
                if (meta.tag == SA_TAG_NEW) {
                    values_write();
                } else if (meta.seen == 1) {
                    values_read();
                } else {
                    values_add();
                }
            }
        }
    }
}
