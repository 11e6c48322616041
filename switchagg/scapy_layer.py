"""A scapy layer for switchagg packets, built from :data:`switchagg.wire.FIELDS`.

For tests and for dissecting captures (``tcpdump -w``, then ``rdpcap``); the data
path never uses scapy, which builds about a thousand packets a second.
"""

from __future__ import annotations

from scapy.fields import ByteField, FieldListField, IntField, ShortField, SignedByteField, SignedIntField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from .wire import FIELDS, UDP_PORT, VERSION

_KINDS = {(8, False): ByteField, (8, True): SignedByteField, (16, False): ShortField, (32, False): IntField}


class SwitchAgg(Packet):
    """switchagg header followed by ``count`` big-endian int32 values."""

    name = "SwitchAgg"
    fields_desc = [_KINDS[(f.bits, f.signed)](f.name, VERSION if f.name == "version" else 0) for f in FIELDS] + [
        FieldListField("values", [], SignedIntField("", 0), count_from=lambda pkt: pkt.count)
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        return pkt + pay


bind_layers(UDP, SwitchAgg, dport=UDP_PORT)
