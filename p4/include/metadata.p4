/* Per-packet metadata: what admission found and what each aggregation stage decided. */
#ifndef SWITCHAGG_METADATA_P4
#define SWITCHAGG_METADATA_P4

struct sa_metadata_t {
    bit<1>  is_sa;       /* UDP to SA_UDP_PORT: a switchagg packet, well-formed or not */
    bit<1>  admitted;
    bit<16> job_index;   /* which slice of the per-job counters */
    bit<8>  n_workers;
    bit<16> slot_base;
    bit<16> slot_count;
    bit<16> mcast_grp;
    bit<32> generation;
    bit<32> idx;         /* register index: 2 * (slot_base + slot) + copy */
    bit<2>  tag;         /* SA_TAG_NEW / SAME / STALE */
    bit<1>  seen;        /* this worker was already counted in the copy */
    bit<8>  count;       /* contributions in the copy after this packet */
    bit<8>  exponent;    /* max proposed exponent after this packet */
    bit<1>  multicast;   /* a finished sum going to every worker: egress rewrites each replica */
}

#endif
