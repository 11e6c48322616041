/* switchagg constants shared by every architecture: the wire format's numbers (switchagg/wire.py) and
 * the counter indices (switchagg/jobs.py: GlobalDrop, JobCounter). tests/test_p4_source.py checks
 * that they agree. */
#ifndef SWITCHAGG_CONSTANTS_P4
#define SWITCHAGG_CONSTANTS_P4

#include "size.p4"

const bit<16> SA_UDP_PORT = 16711;
const bit<8>  SA_VERSION = 1;
const bit<8>  SA_TYPE_CONTRIB = 1;
const bit<8>  SA_TYPE_RESULT = 2;
const bit<8>  SA_TYPE_PROBE = 3;
const bit<8>  SA_TYPE_PROBE_REPLY = 4;
const bit<8>  SA_TYPE_QUERY = 5;
const bit<8>  SA_TYPE_PENDING = 6;
const bit<16> SA_HEADER_BYTES = 24;
/* UDP and IPv4 lengths of a contribution of SA_VALUES values */
const bit<16> SA_CONTRIB_UDP_BYTES = 8 + SA_HEADER_BYTES + 4 * SA_VALUES;
const bit<16> SA_CONTRIB_IP_BYTES = 20 + SA_CONTRIB_UDP_BYTES;
/* UDP and IPv4 lengths of a probe or a query: a header, no values */
const bit<16> SA_HEADER_UDP_BYTES = 8 + SA_HEADER_BYTES;
const bit<16> SA_HEADER_IP_BYTES = 20 + SA_HEADER_UDP_BYTES;
const bit<8>  SA_FLAG_COPY = 0x01;
const bit<8>  SA_FLAG_OWNER = 0x02;  /* a reduce-scatter's chunk: its sum goes whole to `owner` alone */

/* What a switchagg packet is carried in */
const bit<16> SA_ETHERTYPE_IPV4 = 0x0800;
const bit<8>  SA_IP_PROTOCOL_UDP = 17;

/* Global drops (counter index): a packet not (yet) tied to a job. */
const bit<32> SA_DROP_MALFORMED = 0;
const bit<32> SA_DROP_BAD_VERSION = 1;
const bit<32> SA_DROP_NOT_ADMITTED = 2;
const bit<32> SA_DROP_IP_OPTIONS = 3;
const bit<32> SA_DROP_FRAGMENT = 4;
#define SA_NUM_GLOBAL_DROPS 5

/* Per-job events (JobCounter): what was done, each reason for a drop, queries answered, then the
 * reduce-scatter's sums and drop (section 4b of docs/protocol.md). The
 * v1model program keeps one counter array per event, named after it; the TNA program one array whose
 * index is the job's index times SA_JOB_COUNTER_STRIDE plus the event. */
const bit<8>  SA_JOB_CONTRIBUTIONS = 0;
const bit<8>  SA_JOB_RESULTS_MULTICAST = 1;
const bit<8>  SA_JOB_RESULTS_UNICAST = 2;
const bit<8>  SA_JOB_PROBES = 3;
const bit<8>  SA_JOB_WRONG_GENERATION = 4;
const bit<8>  SA_JOB_SLOT_OUT_OF_RANGE = 5;
const bit<8>  SA_JOB_BAD_COUNT = 6;
const bit<8>  SA_JOB_STALE = 7;
const bit<8>  SA_JOB_DUPLICATE_PENDING = 8;
const bit<8>  SA_JOB_QUERIES = 9;
const bit<8>  SA_JOB_RESULTS_TO_OWNER = 10;  /* a reduce-scatter's sum: whole to its owner, a header to the rest */
const bit<8>  SA_JOB_BAD_OWNER = 11;         /* FLAG_OWNER with an owner that is not one of the job's ranks */
/* A tree's (section 10 of docs/protocol.md): partials sent up, sent up again for a repeat, parents'
 * results sent down, and a parent's result that no copy awaited. The TNA program counts them where it
 * serves trees (SA_TREES, Tofino 2); Tofino 1's keeps them at 0. */
const bit<8>  SA_JOB_PARTIALS_UP = 12;
const bit<8>  SA_JOB_PARTIALS_RESENT = 13;
const bit<8>  SA_JOB_RESULTS_FROM_PARENT = 14;
const bit<8>  SA_JOB_UNEXPECTED_RESULT = 15;
#define SA_NUM_JOB_COUNTERS 16
#define SA_JOB_COUNTER_STRIDE 16

/* Multicast group that floods ordinary broadcast traffic (ARP); a job's group is its index + 1, so
 * the job indices stay below it. */
const bit<16> SA_FLOOD_GROUP = 1000;

#endif
