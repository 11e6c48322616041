"""The wire format: one definition, and everything agrees with it."""

from __future__ import annotations

import numpy as np
import pytest

from switchagg import wire
from switchagg.wire import FIELDS, HEADER_SIZE, PacketType, make_header, unpack_header, values_of


def test_header_round_trip_and_size():
    h = make_header(PacketType.CONTRIB, job=0xBEEF, worker=31, slot=0x1234, copy=1, chunk=0xDEADBEEF,
                    generation=0xFFFFFFFF, key=0x01020304, exponent=-5, count=64)
    data = h.pack()
    assert len(data) == HEADER_SIZE == 24
    assert unpack_header(data) == h
    assert h.copy == 1
    # big-endian, in FIELDS order
    assert data[:8] == bytes([1, 1, 1, 31, 0xBE, 0xEF, 0x12, 0x34])
    assert data[8:12] == bytes.fromhex("deadbeef") and data[20] == 0xFB and data[22:24] == b"\x00\x40"


def test_values_are_big_endian_int32():
    vals = np.array([1, -1, 2**31 - 1], dtype=">i4")
    data = make_header(PacketType.RESULT, job=1, worker=0, count=3).pack() + vals.tobytes()
    assert data[HEADER_SIZE:HEADER_SIZE + 4] == b"\0\0\0\x01"
    assert values_of(data, 3).tolist() == [1, -1, 2**31 - 1]


def test_mtu_arithmetic():
    assert wire.datagram_size(64) == 24 + 256
    assert wire.max_values_for_mtu(1500) == (1500 - 28 - 24) // 4
    assert wire.datagram_size(wire.max_values_for_mtu(1500)) + 28 <= 1500


def test_scapy_layer_is_built_from_the_same_fields():
    scapy = pytest.importorskip("scapy.all")
    from switchagg.scapy_layer import SwitchAgg

    assert [f.name for f in SwitchAgg.fields_desc[:-1]] == [f.name for f in FIELDS]
    h = make_header(PacketType.CONTRIB, job=7, worker=2, slot=3, copy=1, chunk=99, generation=5, key=6,
                    exponent=-3, count=2)
    raw = h.pack() + np.array([5, -7], dtype=">i4").tobytes()
    frame = scapy.Ether() / scapy.IP(dst="10.0.0.1") / scapy.UDP(sport=4000, dport=wire.UDP_PORT) / raw
    parsed = scapy.Ether(bytes(frame))
    layer = parsed[SwitchAgg]
    assert layer.job == 7 and layer.exponent == -3 and layer.chunk == 99 and layer.values == [5, -7]
    assert bytes(SwitchAgg(**h._asdict(), values=[5, -7])) == raw


def test_the_c_code_uses_this_header_layout():
    """switchagg/_wire.h lays the header out for the C stream and switch; it must agree with FIELDS."""
    from switchagg import _native

    offsets = np.cumsum([0] + [f.bits // 8 for f in FIELDS])
    layout = tuple((f.name, int(o), f.bits // 8) for f, o in zip(FIELDS, offsets, strict=False))
    assert layout == _native.HEADER_LAYOUT
    assert _native.WIRE == {"HEADER_SIZE": HEADER_SIZE, "VERSION": wire.VERSION, "CONTRIB": PacketType.CONTRIB,
                             "RESULT": PacketType.RESULT, "PROBE": PacketType.PROBE,
                             "PROBE_REPLY": PacketType.PROBE_REPLY, "FLAG_OWNER": wire.FLAG_OWNER,
                             "QUERY": PacketType.QUERY, "PENDING": PacketType.PENDING, "FLAG_COPY": wire.FLAG_COPY,
                             "EXP_NONE": wire.EXP_NONE, "EXP_NONFINITE": wire.EXP_NONFINITE,
                             "MAX_WORKERS": wire.MAX_WORKERS}
