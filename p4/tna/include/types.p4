/* The TNA program's own headers and metadata: the values as the two passes hold them, what ingress
 * tells egress (bridge), what the first pass tells the second (recirculation), and the working state
 * of a packet. docs/tofino.md explains the layout. */
#ifndef SWITCHAGG_TNA_TYPES_P4
#define SWITCHAGG_TNA_TYPES_P4

/* A packet's K values are summed in two passes of the ingress pipeline, half of them in each: on
 * Tofino each 32-bit sum is a register with its own stateful ALU (four per stage), and the half that
 * a pass sums must sit in 32-bit PHV containers, which hold fewer than K values besides everything
 * else. */
#define SA_VALUES_PER_PASS (SA_VALUES / 2)

/* Register indices. A copy: (slot_base + slot) ++ copy bit, 2 * SA_NUM_SLOTS copies. A value register
 * holds both halves of every copy: copy ++ pass. */
typedef bit<11> copy_index_t;    /* log2(SA_NUM_COPIES) bits */
typedef bit<12> value_index_t;   /* log2(2 * SA_NUM_COPIES) bits */
#define SA_VALUE_CELLS 4096      /* 2 * SA_NUM_COPIES */

/* The job's index among the installed jobs (its multicast group is the index + 1) and a per-job
 * event: the index of a per-job counter is job ++ event. */
typedef bit<6> job_index_t;      /* log2(SA_MAX_JOBS) bits: the job index's part of a counter index */
typedef bit<4> job_event_t;      /* log2(SA_JOB_COUNTER_STRIDE) bits */
typedef bit<10> job_counter_index_t;

/* Half of a packet's values, 32 int32 each: which half a header holds depends on the pass
 * (parser.p4). The fields are named by their place in the half. */
header sa_values_h {
    bit<32> v00; bit<32> v01; bit<32> v02; bit<32> v03; bit<32> v04; bit<32> v05; bit<32> v06; bit<32> v07;
    bit<32> v08; bit<32> v09; bit<32> v10; bit<32> v11; bit<32> v12; bit<32> v13; bit<32> v14; bit<32> v15;
    bit<32> v16; bit<32> v17; bit<32> v18; bit<32> v19; bit<32> v20; bit<32> v21; bit<32> v22; bit<32> v23;
    bit<32> v24; bit<32> v25; bit<32> v26; bit<32> v27; bit<32> v28; bit<32> v29; bit<32> v30; bit<32> v31;
}

/* Ingress to egress, in front of every packet ingress sends on (egress strips it). Its layout is the
 * compiler's (@flexible): it never leaves the switch. */
@flexible
header sa_bridge_h {
    bit<8>   kind;           /* SA_BRIDGE_* */
    PortId_t ingress_port;   /* a flooded frame does not go back out of the port it came in on */
}
const bit<8> SA_BRIDGE_NONE = 0;    /* egress leaves the packet as it is */
const bit<8> SA_BRIDGE_FLOOD = 1;   /* a broadcast frame, replicated to every host port */
const bit<8> SA_BRIDGE_RESULT = 2;  /* a replica of a finished sum, addressed to its worker in egress */

/* The first pass to the second, in front of the Ethernet header of a recirculated contribution: what
 * admission found, so that the second pass needs neither the admission table nor its entry (a job
 * reset or removed meanwhile changes nothing for a packet already admitted). Every field fills its
 * own PHV container, so that each is written from one source. */
header sa_recirc_h {
    bit<16>     cell;           /* slot_base + slot: the second pass's first stage indexes by it */
    bit<16>     job_index;
    bit<16>     ingress_port;   /* where the contribution came in: a stored result goes back there */
    bit<32>     worker_bit;
    bit<32>     other_workers;
    bit<32>     all_workers;
#ifdef SA_TREES
    bit<32>     parent_bit;     /* a level of a tree: its parent's bit in all_workers (else 0) */
#endif
}

/* What a pass does to its half of a copy's values (and the second pass to the exponent). */
const bit<8> SA_OP_NONE = 0;
const bit<8> SA_OP_WRITE = 1;  /* a fresh chunk: the packet's values */
const bit<8> SA_OP_ADD = 2;    /* a new worker: stored + packet's, into the packet too */
const bit<8> SA_OP_READ = 3;   /* a repeat: the stored values into the packet */

/* The tag stage's verdict on a contribution's chunk, against the half's tag. */
const bit<8> SA_TAG_STALE = 0;  /* older than the chunk the half holds */
const bit<8> SA_TAG_FRESH = 1;  /* new to the half: another generation, or a newer chunk */
const bit<8> SA_TAG_SAME = 2;   /* the chunk the half holds */
const bit<8> SA_TAG_NONE = 3;   /* not compared (the parser's) */
/* A query's, which writes nothing (and matches no entry of the values' decision: op NONE); stale as
 * above. */
const bit<8> SA_TAG_PEEK = 4;    /* the generation stage found the packet's: the chunk stage decides */
const bit<8> SA_TAG_UNHELD = 5;  /* the half does not hold the chunk: another generation, or an older chunk */
const bit<8> SA_TAG_HELD = 6;    /* the half holds the chunk: its workers are the answer */
#ifdef SA_TREES
/* A parent's RESULT (trees: docs/tofino.md), from the workers stage on: the half held the chunk, and
 * md.workers_before says whether its workers were the children alone (1: the result is taken, the
 * parent's bit set) or not (0: unexpected). */
const bit<8> SA_TAG_TAKE = 7;
/* A job's uplink group, one replica to its parent, is its group + SA_UPLINK_GROUPS (as v1model's
 * group | 0x80: the job groups are 1..SA_MAX_JOBS). */
const bit<16> SA_UPLINK_GROUPS = 0x80;
#endif
const bit<8> SA_NOT_CHECKED = 2;  /* md.new_generation where the generation stage did not run */

struct sa_headers_t {
    sa_bridge_h  bridge;
    sa_recirc_h  recirc;
    ethernet_h   ethernet;
    ipv4_h       ipv4;
    udp_h        udp;
    switchagg_h  sa;
    sa_values_h  vals_head;    /* second pass: the first half, carried (never read) */
    sa_values_h  vals_active;  /* the half this pass sums: the first in the first pass, the second in the second */
    sa_values_h  vals_tail;    /* first pass: the second half, carried (never read) */
}

/* Ingress working state. The parser sets which pass it is and the flags below to their defaults; the
 * rest is written before it is read on every path that reads it. */
struct sa_ingress_metadata_t {
    bit<1>        half;            /* which pass: 0 the first (from a host), 1 the second (recirculated) */
    bit<8>        op;              /* SA_OP_*: what this pass does to its half of the values */
    bit<8>        second_op;       /* the second pass's op, as its decision wrote it (the first four
                                    * value tables key on it, not on op, which one of them writes) */
    bit<16>       cell;            /* slot_base + slot */
    bit<16>       job_index;       /* the job's index among the installed jobs, below SA_MAX_JOBS */
    bit<1>        query;           /* a well-formed query (the parser's verdict, but the IPv4 length) */
#ifdef SA_TREES
    bit<1>        result;          /* a parent's RESULT of K values, well formed (the parser's, both passes) */
    bit<32>       parent_bit;      /* a level of a tree: the parent's bit in all_workers (else 0) */
#endif
    /* admission */
    bit<1>        admitted;
    bit<32>       generation;      /* the job's installed one: what a probe's reply carries */
    bit<16>       slot_room;       /* slot_count - slot, or 0 if the job has no such slot */
    bit<32>       worker_bit;      /* 1 << worker */
    bit<32>       other_workers;   /* the job's other workers: all_workers & ~worker_bit */
    bit<32>       all_workers;     /* the job's workers: (1 << n) - 1 */
    PortId_t      recirc_port;     /* the recirculation port of the job's pipe */
    /* aggregation: the state of this pass's half of the copy */
    bit<8>        new_generation;  /* tag stage, generation: 1 if the half held another run's state */
    bit<8>        tag;             /* tag stage, chunk (a query's, from the generation on): SA_TAG_* */
    bit<32>       workers_before;  /* workers stage: the half's workers before this packet */
    bit<32>       workers_missing; /* the job's workers the copy lacks with this packet's: 0 when complete */
    /* validation of a packet to the switchagg port that is not a contribution of K values */
    bit<16>       ip_minus_udp;    /* IPv4 total length - UDP length: 20 */
    bit<16>       count_bytes;     /* 4 * count */
    bit<16>       udp_minus_count; /* UDP length - 4 * count: 8 + 24 */
    /* counting */
    bit<1>        count_global;
    bit<8>        global_drop;     /* SA_DROP_* */
    bit<1>        count_job;
    job_event_t   job_event;       /* SA_JOB_* */
    /* deparser */
    bit<1>        reply;           /* a reply to the sender: its IPv4 checksum is worked out afresh */
}

struct sa_egress_headers_t {
    sa_bridge_h  bridge;
    ethernet_h   ethernet;
    ipv4_h       ipv4;
    udp_h        udp;
    switchagg_h  sa;
}

struct sa_egress_metadata_t { }

#endif
