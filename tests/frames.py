"""Ethernet/IPv4/UDP frames built and taken apart with struct, for raw-socket tests against BMv2."""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from switchagg.frames import ipv4_checksum, udp_headers


def build(src_mac: str, dst_mac: str, src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    return udp_headers(dst_mac, src_mac, src, dst, len(payload)) + payload


class Frame(NamedTuple):
    dst_mac: bytes
    src_mac: bytes
    src: tuple[str, int]
    dst: tuple[str, int]
    payload: bytes
    ip_checksum_ok: bool
    udp_checksum: int


def parse(frame: bytes) -> Frame | None:
    """A UDP/IPv4 frame's parts, or None for anything else."""
    if len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    ip = frame[14:34]
    total = struct.unpack("!H", ip[2:4])[0]
    sport, dport, length, csum = struct.unpack("!HHHH", frame[34:42])
    payload = frame[42:14 + total]
    assert length == 8 + len(payload), "UDP length disagrees with IPv4 total length"
    return Frame(frame[:6], frame[6:12], (socket.inet_ntoa(ip[12:16]), sport), (socket.inet_ntoa(ip[16:20]), dport),
                 payload, ipv4_checksum(ip) == 0, csum)


def rewrite_ip(frame: bytes, *, options: bytes = b"", fragment: int | None = None, ip_length: int | None = None,
               checksum: int | None = None) -> bytes:
    """``frame`` with its IPv4 header changed: ``options`` inserted (IHL and total length grow with them),
    flags and fragment offset set to ``fragment``, the total length set to ``ip_length``; the checksum is
    made right for the new header, or set to ``checksum``."""
    ip = bytearray(frame[14:34])
    ip[0] = 0x40 | (20 + len(options)) // 4
    total = struct.unpack("!H", ip[2:4])[0] + len(options) if ip_length is None else ip_length
    ip[2:4] = struct.pack("!H", total)
    if fragment is not None:
        ip[6:8] = struct.pack("!H", fragment)
    ip[10:12] = bytes(2)
    header = bytes(ip) + options
    ip[10:12] = struct.pack("!H", ipv4_checksum(header) if checksum is None else checksum)
    return frame[:14] + bytes(ip) + options + frame[34:]
