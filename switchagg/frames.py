"""Ethernet, IPv4 and UDP frames: the headers of a result that a P4 target's control plane gives
each multicast replica, the frames that the BMv2 tests and bench forge, and what a switch that sees
frames (the P4 program, ``SwitchModel.process_frame``) takes of one."""

from __future__ import annotations

import socket
import struct

from .jobs import Address, GlobalDrop
from .wire import UDP_PORT

ETH_IP_UDP_SIZE = 14 + 20 + 8  # the headers before a frame's switchagg payload


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


def datagram_of(frame: bytes | memoryview) -> tuple[memoryview | bytes, Address] | GlobalDrop | None:
    """The switchagg datagram in an Ethernet frame sent to the switch, with its source; a drop reason;
    or None for a frame that is not the switch's to count.

    The embedded switch gets datagrams from the kernel; the P4 program gets frames, and what it
    takes of them (``docs/protocol.md``, section 1) is stated here, for the differential test to
    hold it to. A switchagg datagram is IPv4 with a 20-byte header, unfragmented, and UDP to
    :data:`~switchagg.wire.UDP_PORT`; its payload is what the IPv4 and UDP lengths say, whatever the
    frame holds past them. UDP with IPv4 options or in fragments is counted by reason (a later
    fragment has no port to tell whose it is, and the switch serves no other UDP). The IPv4 checksum
    is not verified (admission and the length checks cover the fields the switch relies on); the P4
    program works out a reply's afresh.
    """
    if len(frame) < ETH_IP_UDP_SIZE or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_UDP:
        return None
    if frame[14] & 0x0F != 5:
        return GlobalDrop.IP_OPTIONS
    ip_length, fragment = struct.unpack_from(">H2xH", frame, 16)
    if fragment & 0x3FFF:  # more fragments, or an offset
        return GlobalDrop.FRAGMENT
    src_port, dst_port, udp_length = struct.unpack_from(">HHH", frame, 34)
    if dst_port != UDP_PORT:
        return None
    if udp_length != ip_length - 20 or len(frame) < 14 + ip_length:
        return GlobalDrop.MALFORMED
    return frame[ETH_IP_UDP_SIZE:14 + ip_length], (socket.inet_ntoa(bytes(frame[26:30])), src_port)
