/* The aggregation state and the order one packet touches it (docs/protocol.md, "Per-packet order"):
 * tag -> bitmap -> count -> exponent -> values, each register read-modify-written at most once, in
 * one action, and each stage deciding only from the packet and earlier stages -- what a Tofino
 * stateful ALU can do, so the TNA port is a translation. Registers are indexed by
 * 2 * (slot_base + slot) + copy. Power-up zeros read as empty: generation 0 is never installed. */

/* One value register: write on a new chunk, add for a new worker, read for a repeat. */
#define SA_VALUE(i) \
    value_##i.read(v, meta.idx); \
    v = meta.tag == SA_TAG_NEW ? hdr.vals.v##i : (meta.seen == 1 ? v : v + hdr.vals.v##i); \
    value_##i.write(meta.idx, v); \
    hdr.vals.v##i = v;

control Aggregation(inout headers_t hdr, inout sa_metadata_t meta) {
    register<bit<64>>(SA_NUM_COPIES) tag;      /* generation ++ chunk id held by the copy */
    register<bit<32>>(SA_NUM_COPIES) bitmap;   /* workers counted in the copy */
    register<bit<8>>(SA_NUM_COPIES) count;     /* how many */
    register<bit<8>>(SA_NUM_COPIES) exponent;  /* max proposed exponent (int8) */
    register<bit<32>>(SA_NUM_COPIES) value_00;
    register<bit<32>>(SA_NUM_COPIES) value_01;
    register<bit<32>>(SA_NUM_COPIES) value_02;
    register<bit<32>>(SA_NUM_COPIES) value_03;
    register<bit<32>>(SA_NUM_COPIES) value_04;
    register<bit<32>>(SA_NUM_COPIES) value_05;
    register<bit<32>>(SA_NUM_COPIES) value_06;
    register<bit<32>>(SA_NUM_COPIES) value_07;
    register<bit<32>>(SA_NUM_COPIES) value_08;
    register<bit<32>>(SA_NUM_COPIES) value_09;
    register<bit<32>>(SA_NUM_COPIES) value_10;
    register<bit<32>>(SA_NUM_COPIES) value_11;
    register<bit<32>>(SA_NUM_COPIES) value_12;
    register<bit<32>>(SA_NUM_COPIES) value_13;
    register<bit<32>>(SA_NUM_COPIES) value_14;
    register<bit<32>>(SA_NUM_COPIES) value_15;
    register<bit<32>>(SA_NUM_COPIES) value_16;
    register<bit<32>>(SA_NUM_COPIES) value_17;
    register<bit<32>>(SA_NUM_COPIES) value_18;
    register<bit<32>>(SA_NUM_COPIES) value_19;
    register<bit<32>>(SA_NUM_COPIES) value_20;
    register<bit<32>>(SA_NUM_COPIES) value_21;
    register<bit<32>>(SA_NUM_COPIES) value_22;
    register<bit<32>>(SA_NUM_COPIES) value_23;
    register<bit<32>>(SA_NUM_COPIES) value_24;
    register<bit<32>>(SA_NUM_COPIES) value_25;
    register<bit<32>>(SA_NUM_COPIES) value_26;
    register<bit<32>>(SA_NUM_COPIES) value_27;
    register<bit<32>>(SA_NUM_COPIES) value_28;
    register<bit<32>>(SA_NUM_COPIES) value_29;
    register<bit<32>>(SA_NUM_COPIES) value_30;
    register<bit<32>>(SA_NUM_COPIES) value_31;
    register<bit<32>>(SA_NUM_COPIES) value_32;
    register<bit<32>>(SA_NUM_COPIES) value_33;
    register<bit<32>>(SA_NUM_COPIES) value_34;
    register<bit<32>>(SA_NUM_COPIES) value_35;
    register<bit<32>>(SA_NUM_COPIES) value_36;
    register<bit<32>>(SA_NUM_COPIES) value_37;
    register<bit<32>>(SA_NUM_COPIES) value_38;
    register<bit<32>>(SA_NUM_COPIES) value_39;
    register<bit<32>>(SA_NUM_COPIES) value_40;
    register<bit<32>>(SA_NUM_COPIES) value_41;
    register<bit<32>>(SA_NUM_COPIES) value_42;
    register<bit<32>>(SA_NUM_COPIES) value_43;
    register<bit<32>>(SA_NUM_COPIES) value_44;
    register<bit<32>>(SA_NUM_COPIES) value_45;
    register<bit<32>>(SA_NUM_COPIES) value_46;
    register<bit<32>>(SA_NUM_COPIES) value_47;
    register<bit<32>>(SA_NUM_COPIES) value_48;
    register<bit<32>>(SA_NUM_COPIES) value_49;
    register<bit<32>>(SA_NUM_COPIES) value_50;
    register<bit<32>>(SA_NUM_COPIES) value_51;
    register<bit<32>>(SA_NUM_COPIES) value_52;
    register<bit<32>>(SA_NUM_COPIES) value_53;
    register<bit<32>>(SA_NUM_COPIES) value_54;
    register<bit<32>>(SA_NUM_COPIES) value_55;
    register<bit<32>>(SA_NUM_COPIES) value_56;
    register<bit<32>>(SA_NUM_COPIES) value_57;
    register<bit<32>>(SA_NUM_COPIES) value_58;
    register<bit<32>>(SA_NUM_COPIES) value_59;
    register<bit<32>>(SA_NUM_COPIES) value_60;
    register<bit<32>>(SA_NUM_COPIES) value_61;
    register<bit<32>>(SA_NUM_COPIES) value_62;
    register<bit<32>>(SA_NUM_COPIES) value_63;

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

    /* Stage 5: the K value registers, each written, added to or read; the packet carries the result. */
    action values_stage() {
        bit<32> v;
        SA_VALUE(00)
        SA_VALUE(01)
        SA_VALUE(02)
        SA_VALUE(03)
        SA_VALUE(04)
        SA_VALUE(05)
        SA_VALUE(06)
        SA_VALUE(07)
        SA_VALUE(08)
        SA_VALUE(09)
        SA_VALUE(10)
        SA_VALUE(11)
        SA_VALUE(12)
        SA_VALUE(13)
        SA_VALUE(14)
        SA_VALUE(15)
        SA_VALUE(16)
        SA_VALUE(17)
        SA_VALUE(18)
        SA_VALUE(19)
        SA_VALUE(20)
        SA_VALUE(21)
        SA_VALUE(22)
        SA_VALUE(23)
        SA_VALUE(24)
        SA_VALUE(25)
        SA_VALUE(26)
        SA_VALUE(27)
        SA_VALUE(28)
        SA_VALUE(29)
        SA_VALUE(30)
        SA_VALUE(31)
        SA_VALUE(32)
        SA_VALUE(33)
        SA_VALUE(34)
        SA_VALUE(35)
        SA_VALUE(36)
        SA_VALUE(37)
        SA_VALUE(38)
        SA_VALUE(39)
        SA_VALUE(40)
        SA_VALUE(41)
        SA_VALUE(42)
        SA_VALUE(43)
        SA_VALUE(44)
        SA_VALUE(45)
        SA_VALUE(46)
        SA_VALUE(47)
        SA_VALUE(48)
        SA_VALUE(49)
        SA_VALUE(50)
        SA_VALUE(51)
        SA_VALUE(52)
        SA_VALUE(53)
        SA_VALUE(54)
        SA_VALUE(55)
        SA_VALUE(56)
        SA_VALUE(57)
        SA_VALUE(58)
        SA_VALUE(59)
        SA_VALUE(60)
        SA_VALUE(61)
        SA_VALUE(62)
        SA_VALUE(63)
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
