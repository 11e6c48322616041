"""The switchagg wire format, defined once.

Every other part (host library, software switch, scapy layer, tests and the P4
header check) derives its view of a packet from :data:`FIELDS`, so a change here
is a change everywhere. ``docs/protocol.md`` explains each field.

A packet is Ethernet / IPv4 / UDP (destination port :data:`UDP_PORT` towards the
switch) / a :data:`HEADER_SIZE`-byte switchagg header / ``count`` int32 values,
everything big-endian.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

VERSION = 1
UDP_PORT = 16711  # 0x4147, "AG": the switch's port; workers use any port.
MAX_WORKERS = 32  # the width of the worker bitmap: the children of one switch's job
MAX_TREE_RANKS = 0xFFFF  # the ranks a tree of jobs sums at most: what a marked chunk's class codes count exactly
EXP_NONE = -128  # "no exponent": an all-zero block, or no next chunk on the slot
# A block proposing EXP_NONFINITE holds NaN, +-inf, or a magnitude >= 2**126 (past the codec's range).
# The switch keeps the max of the proposals, so one rank's mark reaches every rank with no switch change.
EXP_NONFINITE = 127
IP_UDP_OVERHEAD = 20 + 8
P4_VALUES_PER_PACKET = 64  # what one pass of the P4 program sums
MAX_VALUES_PER_PACKET = (65535 - IP_UDP_OVERHEAD - 24) // 4  # 16370: the largest K an IPv4 datagram holds

FLAG_COPY = 0x01  # which of the slot's two shadow copies the packet addresses
# A reduce-scatter's chunk: its finished sum goes whole only to the worker in `owner`; every other worker
# gets the RESULT's header alone (count 0), which frees its slot and carries the next exponent.
FLAG_OWNER = 0x02


class PacketType(enum.IntEnum):
    """What a packet is; the switch accepts CONTRIB, PROBE and QUERY from workers, and RESULT only from the parent
    switch of a job in a tree (docs/protocol.md section 10)."""

    CONTRIB = 1  # a worker's quantized chunk for one slot copy
    RESULT = 2  # the finished sum, multicast or unicast to a worker
    PROBE = 3  # "am I admitted, and under which generation?"
    PROBE_REPLY = 4  # the switch's answer, carrying the job's generation
    QUERY = 5  # "which workers has this chunk's copy counted?": a header, no values
    PENDING = 6  # the switch's answer: the copy's bitmap in the key field (0: it does not hold the chunk)


class Field(NamedTuple):
    """One header field: its name, width in bits, and whether it is signed."""

    name: str
    bits: int
    signed: bool = False


FIELDS: tuple[Field, ...] = (
    Field("version", 8),
    Field("type", 8),
    Field("flags", 8),
    Field("worker", 8),
    Field("job", 16),
    Field("slot", 16),
    Field("chunk", 32),
    Field("generation", 32),
    Field("key", 32),
    Field("exponent", 8, signed=True),
    Field("owner", 8),
    Field("count", 16),
)

_CODES = {(8, False): "B", (8, True): "b", (16, False): "H", (32, False): "I"}
HEADER_STRUCT = struct.Struct(">" + "".join(_CODES[(f.bits, f.signed)] for f in FIELDS))
HEADER_SIZE = HEADER_STRUCT.size
VALUE_DTYPE = np.dtype(">i4")
Buffer = bytes | bytearray | memoryview | np.ndarray  # a packet's values as they lie, K big-endian int32


class Header(NamedTuple):
    """A decoded switchagg header (field order and names follow :data:`FIELDS`)."""

    version: int
    type: int
    flags: int
    worker: int
    job: int
    slot: int
    chunk: int
    generation: int
    key: int
    exponent: int
    owner: int
    count: int

    @property
    def copy(self) -> int:
        return self.flags & FLAG_COPY

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(*self)


assert Header._fields == tuple(f.name for f in FIELDS)
assert HEADER_SIZE == sum(f.bits for f in FIELDS) // 8 == 24


def make_header(
    type: PacketType,
    *,
    job: int,
    worker: int,
    slot: int = 0,
    copy: int = 0,
    chunk: int = 0,
    generation: int = 0,
    key: int = 0,
    exponent: int = EXP_NONE,
    count: int = 0,
    owner: int | None = None,
) -> Header:
    """Build a header with the current version; ``owner`` (a rank) marks a reduce-scatter's chunk."""
    flags = (copy & FLAG_COPY) | (FLAG_OWNER if owner is not None else 0)
    return Header(VERSION, int(type), flags, worker, job, slot, chunk,
                  generation, key, exponent, owner or 0, count)


def unpack_header(data: bytes | memoryview) -> Header:
    """Decode the first :data:`HEADER_SIZE` bytes; the caller checks the length."""
    return Header._make(HEADER_STRUCT.unpack_from(data))


def values_of(data: bytes | memoryview, count: int) -> np.ndarray:
    """The packet's values as a big-endian int32 view (no copy)."""
    return np.frombuffer(data, dtype=VALUE_DTYPE, count=count, offset=HEADER_SIZE)


def datagram_size(values_per_packet: int) -> int:
    """UDP payload bytes of a packet with that many values."""
    return HEADER_SIZE + 4 * values_per_packet


IN_FLIGHT_BYTES = 256 << 10  # what a job's slots hold in flight by default: a fast loopback's round trip
MAX_DEFAULT_SLOTS = 1024  # ... at most the P4 program's whole pool (SA_NUM_SLOTS)


def default_slot_count(values_per_packet: int) -> int:
    """Slots of a job that names none: enough for :data:`IN_FLIGHT_BYTES` of chunks in flight, 16..1024.

    A slot holds one packet in flight, so the window's bytes are slots x 4K: 16 slots carry 1 MB of
    64 KB datagrams but only 4 KB of the P4 switch's 256-byte chunks, too little to keep a link busy.
    K = 64 gets 1024 slots, K = 256 gets 256, K >= 4096 gets 16.
    """
    return min(MAX_DEFAULT_SLOTS, max(16, IN_FLIGHT_BYTES // (4 * values_per_packet)))


def max_values_for_mtu(mtu: int) -> int:
    """The largest K whose IPv4 packet fits an MTU without fragmentation."""
    return (mtu - IP_UDP_OVERHEAD - HEADER_SIZE) // 4
