"""Ethernet, IPv4 and UDP headers built with struct: the headers of a result that the P4 target's
control plane gives each multicast replica, and the frames that the BMv2 tests and bench forge."""

from __future__ import annotations

import socket
import struct


def mac_bytes(mac: str) -> bytes:
    """``"02:5a:00:00:00:01"`` as its 6 bytes."""
    return bytes.fromhex(mac.replace(":", ""))


def ipv4_checksum(header: bytes) -> int:
    """The one's-complement checksum of an IPv4 header: what its checksum field must hold when that
    field is 0, and 0 over a header whose checksum is right."""
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_headers(dst_mac: str, src_mac: str, src: tuple[str, int], dst: tuple[str, int], payload_len: int) -> bytes:
    """Ethernet, IPv4 (no options, not fragmented, TTL 64, its checksum right) and UDP (no checksum)
    headers of a datagram of ``payload_len`` bytes."""
    udp_len = 8 + payload_len
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    ip = ip[:10] + struct.pack("!H", ipv4_checksum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", src[1], dst[1], udp_len, 0)
    return mac_bytes(dst_mac) + mac_bytes(src_mac) + b"\x08\x00" + ip + udp
