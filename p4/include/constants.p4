/* switchagg constants shared by every architecture. switchagg/wire.py and
 * switchagg/switch/counters.py define the same numbers; tests/test_p4_source.py checks they agree. */
#ifndef SWITCHAGG_CONSTANTS_P4
#define SWITCHAGG_CONSTANTS_P4

const bit<16> SA_UDP_PORT = 16711;
const bit<8>  SA_VERSION = 1;
const bit<8>  SA_TYPE_CONTRIB = 1;
const bit<8>  SA_TYPE_RESULT = 2;
const bit<8>  SA_TYPE_PROBE = 3;
const bit<8>  SA_TYPE_PROBE_REPLY = 4;
const bit<8>  SA_MAX_WORKERS = 32;
const bit<16> SA_VALUES = 64;          /* K: int32 values per packet */
const bit<16> SA_HEADER_BYTES = 24;
/* UDP and IPv4 lengths of a contribution of SA_VALUES values */
const bit<16> SA_CONTRIB_UDP_BYTES = 8 + SA_HEADER_BYTES + 4 * SA_VALUES;
const bit<16> SA_CONTRIB_IP_BYTES = 20 + SA_CONTRIB_UDP_BYTES;
const bit<8>  SA_FLAG_COPY = 0x01;
/* What turns a contribution's type into a result's, and a probe's into a reply's, in place (xor) */
const bit<32> SA_CONTRIB_TO_RESULT = (bit<32>)(SA_TYPE_CONTRIB ^ SA_TYPE_RESULT) << 16;
const bit<32> SA_PROBE_TO_REPLY = (bit<32>)(SA_TYPE_PROBE ^ SA_TYPE_PROBE_REPLY) << 16;

/* Aggregation pool: NUM_SLOTS slots, two shadow copies each. */
#define SA_NUM_SLOTS 1024
#define SA_NUM_COPIES 2048
#define SA_MAX_JOBS 64
#define SA_NUM_JOB_IDS 65536  /* per-job counters are indexed by the 16-bit job id */

/* Global drops (counter index). */
const bit<32> SA_DROP_MALFORMED = 0;
const bit<32> SA_DROP_BAD_VERSION = 1;
const bit<32> SA_DROP_NOT_ADMITTED = 2;
const bit<32> SA_DROP_IP_OPTIONS = 3;
const bit<32> SA_DROP_FRAGMENT = 4;
#define SA_NUM_GLOBAL_DROPS 5

/* Multicast group that floods ordinary broadcast traffic (ARP); a job's group is its index + 1
 * (SaIngress.result_to_all), so the job indices stay below it. */
const bit<16> SA_FLOOD_GROUP = 1000;

#endif
