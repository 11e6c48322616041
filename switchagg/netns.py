"""Network namespaces and veth pairs through ``ip``, and sockets opened inside a namespace."""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import socket
import subprocess
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def sh(*argv: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run a command (inside namespace ``ns`` if given); a failure says which command and why."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def missing(bench: str, needs: str, tools: tuple[tuple[str, str], ...]) -> str | None:
    """Why ``bench`` (its name in the sentence: "the loss bench") cannot build its namespaces here, or None: it
    needs root (for ``needs``: "network namespaces and nftables") and each of ``tools``, (command, Debian
    package)."""
    if os.geteuid() != 0:
        return f"{bench} needs root ({needs}): run it with sudo"
    for tool, package in tools:
        if shutil.which(tool) is None:
            return f"{bench} needs `{tool}`: apt-get install {package}"
    return None


def add_namespace(name: str) -> None:
    sh("ip", "netns", "add", name)
    sh("ip", "link", "set", "lo", "up", ns=name)


def delete_namespace(name: str) -> None:
    sh("ip", "netns", "delete", name, check=False)


def namespaces(prefix: str) -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(prefix)]


def quiet_link(dev: str, ns: str | None = None, *, offloads: str = "off") -> None:
    """No IPv6 chatter, up, with ``offloads`` "off" (none), "default" (the kernel's) or "on" (all).

    Without checksum offload BMv2 never forwards a partial checksum as it is; without segmentation
    and receive offloads libpcap sizes BMv2's capture ring for the MTU rather than for 64 KB frames,
    so that ring holds ~1000 frames instead of ~32 and a burst is not dropped at the switch port.
    Without them a UDP_SEGMENT send is also cut into datagrams at the veth, so that a firewall on
    the far side sees each one; a veth with its default offloads (``tx-udp-segmentation`` on) passes
    the super-packet whole, as one packet to the firewall, which the loss bench's ``gso`` bed wants.
    With all of them on a link behaves as a NIC's does: a socket's batch of segments (TCP's, or
    UDP's GSO) crosses it as one buffer, and its receive side merges segments (GRO, which a veth
    does only when asked), so the kernel's work goes by the buffer, not by the packet (the link bench).
    """
    if offloads not in ("off", "default", "on"):
        raise ValueError(f"offloads={offloads!r}: use 'off', 'default' or 'on'")
    sh("sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1", ns=ns)
    if offloads != "default":
        sh("ethtool", "-K", dev, "tx", offloads, "rx", offloads, "tso", offloads, "gso", offloads, "gro", offloads,
           ns=ns, check=False)
    sh("ip", "link", "set", dev, "up", ns=ns)


def veth_into(root_dev: str, ns_dev: str, ns: str, mac: str) -> None:
    """A veth pair: ``root_dev`` stays here (a switch port), ``ns_dev`` moves into ``ns``."""
    peer = f"{root_dev}x"  # unique here; renamed once inside the namespace
    sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", peer)
    sh("ip", "link", "set", peer, "netns", ns)
    sh("ip", "link", "set", peer, "name", ns_dev, ns=ns)
    sh("ip", "link", "set", ns_dev, "address", mac, ns=ns)
    quiet_link(root_dev)
    quiet_link(ns_dev, ns)


def socket_in(ns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket that lives in namespace ``ns``: setns for this thread, create, switch back."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(Path("/var/run/netns") / ns, os.O_RDONLY)
    try:
        if _libc.setns(there, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
        try:
            return socket.socket(family, kind, proto)
        finally:
            if _libc.setns(here, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace failed")
    finally:
        os.close(here)
        os.close(there)


def veth_between(ns_a: str, dev_a: str, ns_b: str, dev_b: str, *, offloads: str = "off") -> None:
    """A veth pair with one end in each namespace, both quiet and up (:func:`quiet_link`'s ``offloads``)."""
    tmp_a, tmp_b = f"t{os.getpid() % 10000}{dev_a}"[:15], f"u{os.getpid() % 10000}{dev_b}"[:15]
    sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
    for tmp, ns, dev in ((tmp_a, ns_a, dev_a), (tmp_b, ns_b, dev_b)):
        sh("ip", "link", "set", tmp, "netns", ns)
        sh("ip", "link", "set", tmp, "name", dev, ns=ns)
        quiet_link(dev, ns, offloads=offloads)


ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # sll_pkttype of a frame this socket's host sent (a packet socket sees those too)


SO_RCVBUFFORCE = 33  # asm-generic/socket.h; needs CAP_NET_ADMIN, which this module needs anyway


def packet_socket(ns: str, dev: str = "eth0") -> socket.socket:
    """A raw packet socket on ``dev`` in namespace ``ns``: every frame in and out, non-blocking.

    Its receive buffer holds a few thousand frames, so a burst that BMv2 forwards is not lost here.
    """
    s = socket_in(ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    s.bind((dev, 0))
    s.setblocking(False)
    return s


def incoming(socks: list[socket.socket], wait: float) -> list[tuple[int, bytes]]:
    """The frames waiting on non-blocking packet sockets, as (index in ``socks``, frame), after
    waiting at most ``wait`` seconds for the first; a host's own sends, which its socket sees too,
    are left out."""
    out = []
    ready, _, _ = select.select(socks, [], [], wait)
    for s in ready:
        i = socks.index(s)
        while True:
            try:
                data, addr = s.recvfrom(65535)
            except BlockingIOError:
                break
            if addr[2] != PACKET_OUTGOING:
                out.append((i, data))
    return out
