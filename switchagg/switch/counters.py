"""What the switch counts, shared by the software switch and the P4 program.

The numeric values are the indices of the P4 counter arrays (``p4/include/constants.p4``),
and a test checks that the two agree.
"""

from __future__ import annotations

import enum


class GlobalDrop(enum.IntEnum):
    """Drops before a packet is tied to a job, so they cannot be charged to one.

    The last two are of IPv4 that a switch seeing frames (the P4 program, ``SwitchModel.process_frame``)
    does not take; the embedded switch gets its datagrams from the kernel, which takes options and
    reassembles fragments, so it never counts them.
    """

    MALFORMED = 0  # too short, lengths disagree (IPv4, UDP, count), bad type, reserved bits, worker >= 32
    BAD_VERSION = 1
    NOT_ADMITTED = 2  # no admission entry for (job, worker, source IP, source port, key)
    IP_OPTIONS = 3  # an IPv4 header other than 20 bytes (options), UDP, sent to the switch
    FRAGMENT = 4  # a fragment of a UDP datagram sent to the switch


class JobCounter(enum.IntEnum):
    """Per-job events: what was done, then each reason for a drop."""

    CONTRIBUTIONS = 0  # contributions counted into a sum
    RESULTS_MULTICAST = 1  # finished sums sent to every worker
    RESULTS_UNICAST = 2  # stored sums resent to a worker that retransmitted
    PROBES = 3  # probes answered
    WRONG_GENERATION = 4  # a packet of another run of the job
    SLOT_OUT_OF_RANGE = 5
    BAD_COUNT = 6  # value count other than the job's K
    STALE = 7  # a chunk older than the one the slot copy holds
    DUPLICATE_PENDING = 8  # a repeat from a counted worker while the sum is unfinished


JOB_DROPS = tuple(c for c in JobCounter if c >= JobCounter.WRONG_GENERATION)
