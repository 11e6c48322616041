/* Per-packet metadata: what admission found and what each aggregation stage decided. BMv2 pays for
 * every field of the PHV on every packet (reset, and a copy per multicast replica), so only what a
 * later step reads is kept here. */
#ifndef SWITCHAGG_METADATA_P4
#define SWITCHAGG_METADATA_P4

struct sa_metadata_t {
    bit<32> job_index;   /* the job's index in the per-job counter arrays */
    bit<8>  n_workers;   /* 0: not admitted (no job has 0 workers) */
    bit<16> slot_count;
    bit<32> generation;
    bit<32> idx;         /* register index: 2 * (slot_base + slot) + copy */
    bit<1>  fresh;       /* tag stage: the chunk is new to the copy (first contribution of a round) */
    bit<1>  stale;       /* tag stage: the chunk is older than the one the copy holds */
    bit<1>  seen;        /* this worker was already counted in the copy */
    bit<8>  count;       /* contributions in the copy after this packet */
}

#endif
