/* Sizes every switchagg program shares: what a packet carries and how much state the switch holds.
 * Plain numbers (#define), so that they can size externs and tables as well as appear in
 * expressions; tests/test_p4_source.py checks them against switchagg/wire.py and the control plane
 * (switchagg/targets/bmv2.py). */
#ifndef SWITCHAGG_SIZE_P4
#define SWITCHAGG_SIZE_P4

/* K: the int32 values one packet carries and the switch sums (wire.P4_VALUES_PER_PACKET). The
 * one place the P4 side states it; every length and width of the values derives from it. */
#define SA_VALUES 64

/* Workers of one job: the width of the worker bitmap (wire.MAX_WORKERS). */
#define SA_MAX_WORKERS 32

/* The aggregation pool: SA_NUM_SLOTS slots for all jobs together, two shadow copies each. */
#define SA_NUM_SLOTS 1024
#define SA_NUM_COPIES 2048  /* 2 * SA_NUM_SLOTS */

/* Jobs installed at once; a job's multicast group is its index + 1 (below SA_FLOOD_GROUP). */
#define SA_MAX_JOBS 64

/* Job ids on the wire are 16 bits. */
#define SA_NUM_JOB_IDS 65536

/* Table sizes: an admission entry per worker of every job, a replica per worker of every job, and
 * one L2 entry per host. */
#define SA_ADMISSION_SIZE 2112  /* SA_MAX_JOBS * (SA_MAX_WORKERS + 1): and a parent's, a level of a tree */
#define SA_REPLICA_SIZE 2112    /* SA_MAX_JOBS * (SA_MAX_WORKERS + 1): and one up to its parent */
#define SA_L2_SIZE 1024

#endif
