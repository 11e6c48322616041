"""The P4 program's headers and constants agree with switchagg/wire.py and the counter enums."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest

from switchagg import wire
from switchagg.config import Endpoint
from switchagg.errors import ConfigError
from switchagg.frames import ipv4_checksum
from switchagg.jobs import GlobalDrop, JobCounter
from switchagg.loopback import loopback_job
from switchagg.targets import bmv2, p4job

P4 = Path(__file__).resolve().parents[1] / "p4"


def header_fields(name: str) -> list[tuple[str, int]]:
    text = (P4 / "include" / "headers.p4").read_text()
    body = re.search(r"header\s+" + name + r"\s*\{(.*?)\}", text, re.S).group(1)
    return [(f, int(b)) for b, f in re.findall(r"bit<(\d+)>\s+(\w+);", body)]


def constants() -> dict[str, int]:
    text = (P4 / "include" / "constants.p4").read_text()
    consts = {n: int(v, 0) for n, v in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(\w+);", text)}
    consts.update({n: int(v, 0) for n, v in re.findall(r"#define\s+(SA_\w+)\s+(\d+)", text)})
    return consts


def test_switchagg_header_matches_wire_fields():
    """In order and width, each P4 field being one wire field or neighbours named after them (a_b_c)."""
    wire_fields = iter(wire.FIELDS)
    for name, bits in header_fields("switchagg_h"):
        parts = [next(wire_fields) for _ in name.split("_")]
        assert (name, bits) == ("_".join(f.name for f in parts), sum(f.bits for f in parts))
    assert next(wire_fields, None) is None, "wire fields missing from switchagg_h"


def test_values_header_is_k_int32():
    assert header_fields("switchagg_values_h") == [("values", 32 * wire.P4_VALUES_PER_PACKET)]


def test_carry_mask_has_bit_31_of_every_value():
    text = (P4 / "v1model" / "aggregation.p4").read_text()
    mask = int(re.search(r"#define SA_VALUE_TOPS 2048w0x([0-9a-f]+)", text).group(1), 16)
    assert mask == sum(1 << (32 * j + 31) for j in range(wire.P4_VALUES_PER_PACKET))


def test_constants_match():
    c = constants()
    assert c["SA_UDP_PORT"] == wire.UDP_PORT and c["SA_VERSION"] == wire.VERSION
    assert c["SA_MAX_WORKERS"] == wire.MAX_WORKERS and c["SA_VALUES"] == wire.P4_VALUES_PER_PACKET
    assert c["SA_HEADER_BYTES"] == wire.HEADER_SIZE and c["SA_FLAG_COPY"] == wire.FLAG_COPY
    for t in wire.PacketType:
        assert c[f"SA_TYPE_{t.name}"] == t.value
    for d in GlobalDrop:
        assert c[f"SA_DROP_{d.name}"] == d.value
    assert c["SA_NUM_GLOBAL_DROPS"] == len(GlobalDrop)
    assert c["SA_NUM_SLOTS"] == bmv2.NUM_SLOTS and c["SA_NUM_COPIES"] == 2 * bmv2.NUM_SLOTS
    assert c["SA_MAX_JOBS"] == bmv2.MAX_JOBS and c["SA_FLOOD_GROUP"] == bmv2.FLOOD_GROUP
    assert c["SA_NUM_JOB_IDS"] == 1 << wire.FIELDS[[f.name for f in wire.FIELDS].index("job")].bits


def header_mask(name: str) -> int:
    """A mask of p4/include/headers.p4, ``((bit<336>)0x.. [<< n])``, as a number."""
    text = (P4 / "include" / "headers.p4").read_text()
    value, shift = re.search(rf"#define {name}\s+\(\(bit<336>\)(0x[0-9a-f]+)(?: << (\d+))?\)", text).groups()
    return int(value, 16) << int(shift or 0)


def test_reply_checksum_steps_give_the_ipv4_checksum():
    """reply_to_sender's steps (aggregation.p4), written out here with headers.p4's masks, on headers whose
    sums fold once, twice or to 0xffff: the checksum of the header as it is, whatever its own checksum said."""
    lanes, but_checksum, ones = (header_mask(n) for n in ("IP_WORD_LANES", "IP_WORD_LANES_BUT_CHECKSUM",
                                                          "IP_WORD_LANE_ONES"))
    assert header_mask("OUTER_IP_CHECKSUM") == 0xFFFF << 128
    rng = random.Random(20)
    headers = [bytes(20), b"\xff" * 20, bytes.fromhex("4500001c000040004011") + bytes(2) + bytes.fromhex("fffe") * 4]
    headers += [rng.randbytes(20) for _ in range(3000)]
    for ip in headers:
        head = int.from_bytes(bytes(14) + ip + bytes(8), "big")  # outer.head: Ethernet, IPv4, UDP
        total = ((head >> 80 & lanes) + (head >> 64 & but_checksum)) * ones >> 128 & 0xFFFFFFFF
        total = (total >> 16) + (total & 0xFFFF)
        checksum = (~(total + (total >> 16)) << 128 & 0xFFFF << 128) >> 128
        assert checksum == ipv4_checksum(ip[:10] + bytes(2) + ip[12:]), ip.hex()


def test_one_counter_array_per_job_counter():
    text = (P4 / "v1model" / "aggregation.p4").read_text()
    arrays = re.findall(r"counter<bit<16>>\(SA_NUM_JOB_IDS, CounterType\.packets\)\s+job_(\w+);", text)
    assert arrays == [j.name.lower() for j in JobCounter]


def test_replica_instances_count_workers_before_on_the_same_port():
    cfg = loopback_job(5)
    ports = [3, 7, 3, 3, 7]
    cfg = dataclasses.replace(cfg, workers=tuple(dataclasses.replace(w, switch_port=p)
                                                 for w, p in zip(cfg.workers, ports, strict=True)))
    assert p4job.replica_instances(cfg) == [0, 0, 1, 2, 1]


def test_deploy_refuses_a_switch_port_the_program_does_not_take():
    cfg = dataclasses.replace(loopback_job(2, values_per_packet=wire.P4_VALUES_PER_PACKET),
                              switch=Endpoint("10.0.0.1", wire.UDP_PORT + 1))
    with pytest.raises(ConfigError, match=f"UDP port {wire.UDP_PORT}"):
        bmv2.Bmv2Target("127.0.0.1:1").deploy(cfg)  # refused before it connects
