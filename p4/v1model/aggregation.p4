/* The aggregation state and the order one packet touches it (docs/protocol.md, "Per-packet order"):
 * tag -> bitmap -> count -> exponent -> values, each register read-modify-written at most once, in
 * one action, and each stage deciding only from the packet and earlier stages -- what a Tofino
 * stateful ALU can do, so the TNA port is a translation. Registers are indexed by
 * 2 * (slot_base + slot) + copy. Power-up zeros read as empty: generation 0 is never installed. */

/* Bit 31 of each of the eight 32-bit values in a 256-bit lane. */
#define SA_LANE_TOPS 256w0x8000000080000000800000008000000080000000800000008000000080000000

/* One lane register (eight values): write on a new chunk, add for a new worker, read for a repeat.
 * The add is eight independent 32-bit adds (modulo 2^32, no carry between values): add the low
 * 31 bits of each value, then put each value's bit 31 back as the xor of the two inputs' bit 31
 * and the carry into it. */
#define SA_LANE(i) \
    value_##i.read(v, meta.idx); \
    sum = ((v & ~SA_LANE_TOPS) + (hdr.vals.lane##i & ~SA_LANE_TOPS)) ^ ((v ^ hdr.vals.lane##i) & SA_LANE_TOPS); \
    v = meta.tag == SA_TAG_NEW ? hdr.vals.lane##i : (meta.seen == 1 ? v : sum); \
    value_##i.write(meta.idx, v); \
    hdr.vals.lane##i = v;

control Aggregation(inout headers_t hdr, inout sa_metadata_t meta) {
    register<bit<64>>(SA_NUM_COPIES) tag;      /* generation ++ chunk id held by the copy */
    register<bit<32>>(SA_NUM_COPIES) bitmap;   /* workers counted in the copy */
    register<bit<8>>(SA_NUM_COPIES) count;     /* how many */
    register<bit<8>>(SA_NUM_COPIES) exponent;  /* max proposed exponent (int8) */
    register<bit<256>>(SA_NUM_COPIES) value_0;
    register<bit<256>>(SA_NUM_COPIES) value_1;
    register<bit<256>>(SA_NUM_COPIES) value_2;
    register<bit<256>>(SA_NUM_COPIES) value_3;
    register<bit<256>>(SA_NUM_COPIES) value_4;
    register<bit<256>>(SA_NUM_COPIES) value_5;
    register<bit<256>>(SA_NUM_COPIES) value_6;
    register<bit<256>>(SA_NUM_COPIES) value_7;

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

    /* Stage 5: the value registers, each written, added to or read; the packet carries the result. */
    action values_stage() {
        bit<256> v;
        bit<256> sum;
        SA_LANE(0)
        SA_LANE(1)
        SA_LANE(2)
        SA_LANE(3)
        SA_LANE(4)
        SA_LANE(5)
        SA_LANE(6)
        SA_LANE(7)
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
                values_stage();
            }
        }
    }
}
