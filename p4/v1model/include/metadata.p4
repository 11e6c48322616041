/* The v1model program's per-packet working state: what admission found and what each aggregation
 * stage read and decided.
 *
 * On BMv2 it is the fields of a header that is never valid, not user metadata: BMv2 sets every
 * metadata field to zero on every packet it receives (about 650 instructions a field) and copies
 * each into every multicast replica, where it keeps the fields of an invalid header like any other
 * field and does neither (setValid would zero them). Every field is written before it is read on
 * every path that reads it, so nothing depends on a reset. P4 leaves the fields of an invalid header
 * unspecified, so this is a choice for BMv2 that tests/test_bmv2.py holds to the model; on Tofino
 * (TNA) the working state is plain metadata. */
#ifndef SWITCHAGG_V1MODEL_METADATA_P4
#define SWITCHAGG_V1MODEL_METADATA_P4

header sa_local_h {
    bit<2048> held;        /* values stage: the sums the copy holds, read to add the packet's to */
    bit<64>   tag;         /* tag stage: the copy's tag as read, then as written */
    bit<32>   idx;         /* register index: 2 * (slot_base + slot) + copy */
    bit<64>   job;         /* admission: the job's slot count [63:48], whether it has a parent [47],
                            * multicast group [46:40] (so [47:40] is a leaf's uplink group, 128 + its group),
                            * workers [39:32] (where workers keeps the count) and installed generation [31:0]
                            * (what a probe's reply carries; a parent's RESULT has its own, and its entry
                            * keeps the owner limit, as owners would, in [23:0]) */
    bit<24>   owners;      /* admission: what owner_count is below where it names one of the tree's ranks (the
                            * ranks << 16; all ones from 256 ranks on, as owner is one byte), so that the owner
                            * is checked in one comparison; 0 for a parent's RESULT, which so never takes the
                            * contributions' path (aggregation.p4) */
    bit<8>    whole;       /* owner-only delivery (branch.p4): 1 where the owner's rank is under the child */
    bit<64>   workers;     /* bitmap and count stages: count [39:32] and bitmap [31:0], as read, then as
                            * written (64 bits wide, to compare with job without a cast) */
    bit<8>    exponent;    /* exponent stage: the maximum the copy holds */
    bit<64>   fresh;       /* tag stage: 1 if the chunk is new to the copy (first contribution of a round) */
    bit<64>   seen;        /* bitmap stage: 1 if this worker was already counted in the copy */
                           /* (both flags as wide as what they mask, so that no cast is needed) */
    bit<336>  checksum;    /* a reply: its IPv4 header's sum, on the way to its checksum (as wide as
                            * outer.head, which it is worked out from and written into) */
}

/* Where job keeps the worker count and workers the contribution count, and a count of one there */
#define LOCAL_COUNT_BITS 64w0x000000ff00000000
#define LOCAL_COUNT_ONE  64w0x0000000100000000
/* Where job says that the job has a parent (docs/protocol.md section 10), and its owner limit in a parent's entry */
#define LOCAL_PARENT     64w0x0000800000000000
#define LOCAL_OWNERS     64w0x0000000000ffffff

/* v1model's user metadata: none (see sa_local_h). */
struct sa_metadata_t { }

#endif
