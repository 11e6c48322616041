"""Batched UDP: many datagrams per system call on Linux, and kernel refusals counted as loss."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from switchagg.transport import BATCHED_AVAILABLE, UdpSocket, from_sockaddr_in, sockaddr_in


def exchange(batched: bool, count: int = 200):
    with UdpSocket(("127.0.0.1", 0), batched=batched) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batched=batched) as tx:
        msgs = [((bytes([i % 256]) * 4, np.full(3, i, dtype=">i4")), None) for i in range(count)]
        assert tx.send(msgs) == 0
        got = []
        deadline = time.monotonic() + 5
        while len(got) < count and time.monotonic() < deadline:
            got += [(bytes(v), a) for v, a in rx.recv(0.5)]
        return tx.stats, rx.stats, got, tx.address


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_datagrams_arrive_whole_in_order_with_sender_address(batched):
    tx_stats, rx_stats, got, sender = exchange(batched)
    assert len(got) == 200
    for i, (data, addr) in enumerate(got):
        assert data == bytes([i % 256]) * 4 + np.full(3, i, dtype=">i4").tobytes()
        assert addr == sender


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sendmmsg/recvmmsg are Linux calls")
def test_linux_uses_batched_system_calls():
    assert BATCHED_AVAILABLE
    tx_stats, rx_stats, got, _ = exchange(None)
    assert tx_stats.sent == 200 and tx_stats.send_calls <= 200 // 64 + 2  # 64 datagrams a call
    assert rx_stats.received == 200 and rx_stats.recv_calls < 200 // 2


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_strace_sees_sendmmsg_and_recvmmsg():
    code = ("from tests.test_transport import exchange; exchange(None)")
    out = subprocess.run(["strace", "-f", "-c", "-e", "trace=sendmmsg,recvmmsg,sendto,sendmsg,recvfrom",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "sendmmsg" in out.stderr and "recvmmsg" in out.stderr, out.stderr


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_refused_sends_are_counted_not_raised(batched):
    import socket

    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nobody listens: the kernel answers with ICMP port unreachable
    with UdpSocket(("127.0.0.1", 0), peer=("127.0.0.1", port), batched=batched) as s:
        for _ in range(20):
            s.send([((b"x" * 10,), None)] * 3)
            assert s.recv(0.01) == []  # ECONNREFUSED may surface on receive instead
        assert s.stats.refused > 0


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_mixed_batch_to_several_receivers_arrives_exact(batched):
    """One batch of every kind of message: header only, numpy values writable or read-only, bytes
    values, one array sent to several receivers, headers of another length; each to its address."""
    shared = np.arange(5, dtype=">i4")
    readonly = np.frombuffer(np.arange(4, dtype=">i4").tobytes(), dtype=">i4")
    parts = [(b"h0",), (b"h1", shared), (b"h2", readonly), (b"h3", b"tail"), (b"longer-head", shared),
             (b"h5", shared[1:])]
    with UdpSocket(("127.0.0.1", 0), batched=batched) as a, UdpSocket(("127.0.0.1", 0), batched=batched) as b, \
            UdpSocket(("127.0.0.1", 0), batched=batched) as tx:
        msgs = [(p, (a if i % 2 else b).address) for i, p in enumerate(parts)]
        assert tx.send(msgs * 3) == 0
        got = {a.address: [], b.address: []}
        deadline = time.monotonic() + 5
        while sum(map(len, got.values())) < 3 * len(parts) and time.monotonic() < deadline:
            for rx in (a, b):
                for data, src in rx.recv(0.05):
                    assert src == tx.address
                    got[rx.address].append(bytes(data))
    for rx_addr in got:
        want = [b"".join(bytes(x) if isinstance(x, bytes) else x.tobytes() for x in p)
                for p, addr in msgs if addr == rx_addr]
        assert got[rx_addr] == want * 3


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_rows_written_in_place_go_out_as_written_between_ordinary_sends(batched):
    """send_rows (the client's path) and send (the switch's) share the send buffers: each lays them out anew."""
    with UdpSocket(("127.0.0.1", 0), batched=batched) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batched=batched, max_datagram=64) as tx:
        want = []
        for r in range(3):
            for i in range(5):
                tx.out_rows[i, :40] = 10 * r + i
            assert tx.send_rows(5, 40) == 0
            assert tx.send([((b"hd", np.arange(r + 1, dtype=">i4")), None)] * 2) == 0
            want += [bytes([10 * r + i]) * 40 for i in range(5)]
            want += [b"hd" + np.arange(r + 1, dtype=">i4").tobytes()] * 2
        assert tx.send_rows(1, 7) == 0  # one row: a plain send
        want.append(bytes(tx.out_rows[0, :7]))
        got = []
        deadline = time.monotonic() + 5
        while len(got) < len(want) and time.monotonic() < deadline:
            got += [bytes(v) for v, _ in rx.recv(0.5)]
        with pytest.raises(ValueError, match="connected"):
            rx.send_rows(1, 8)
    assert got == want


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_send_rows_refuses_a_length_past_max_datagram_and_sends_nothing(batched):
    """Rows sent at the lengths in out_lengths (the client's path) are held to max_datagram as one of a
    given size is: a ValueError before anything leaves, and the counters count nothing."""
    with UdpSocket(("127.0.0.1", 0), batched=batched) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batched=batched, max_datagram=64) as tx:
        tx.out_lengths[:3] = [64, 65, 10]
        with pytest.raises(ValueError, match="longer than 64 bytes"):
            tx.send_rows(3)
        with pytest.raises(ValueError, match="max_datagram"):
            tx.send_rows(1, 65)
        assert tx.stats.sent == tx.stats.bytes_sent == 0
        tx.out_lengths[:3] = [64, 1, 10]
        assert tx.send_rows(3) == 0 and tx.stats.sent == 3 and tx.stats.bytes_sent == 75
        got, deadline = [], time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            got += [len(v) for v, _ in rx.recv(0.5)]
        assert got == [64, 1, 10] and rx.stats.received == 3 and rx.stats.bytes_received == 75


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_recv_packets_describes_each_datagram_by_offset_and_length(batched):
    with UdpSocket(("127.0.0.1", 0), batch=8, max_datagram=64, batched=batched) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batched=batched) as tx:
        sent = [bytes([i]) * (1 + 3 * i) for i in range(20)]
        assert tx.send([((d,), None) for d in sent]) == 0
        got = []
        deadline = time.monotonic() + 5
        while len(got) < len(sent) and time.monotonic() < deadline:
            n = rx.recv_packets(0.5)
            got += [rx.in_buf[rx.in_offsets[i]:rx.in_offsets[i] + rx.in_lengths[i]].tobytes() for i in range(n)]
    assert got == sent


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_a_datagram_longer_than_the_receive_s_room_is_a_counted_drop_never_handed_on_cut_short(batched):
    import socket

    with UdpSocket(("127.0.0.1", 0), batch=8, max_datagram=64, batched=batched, segmentation=False) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        sent = [b"a" * 64, b"b" * 65, b"c" * 1000, b"d" * 10]
        for d in sent:
            tx.sendto(d, rx.address)
        got = []
        while len(got) < 2:  # the two that fit: the last is sent after the long ones, so they were taken first
            n = rx.recv_packets(10.0)
            got += [rx.in_buf[rx.in_offsets[i]:rx.in_offsets[i] + rx.in_lengths[i]].tobytes() for i in range(n)]
    assert got == [sent[0], sent[3]]
    assert rx.stats.truncated == 2 and rx.stats.received == 2


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_rows_go_to_their_names_and_come_back_with_their_sources(batched):
    """The C switch's path: an unconnected socket sends row i to name i, and hears where rows came from."""
    with UdpSocket(("127.0.0.1", 0), batch=8, max_datagram=64, batched=batched) as sw, \
            UdpSocket(("127.0.0.1", 0), batch=8, max_datagram=64, batched=batched) as a, \
            UdpSocket(("127.0.0.1", 0), batch=8, max_datagram=64, batched=batched) as b:
        for i, dst in enumerate([a, b, a, b, b]):
            sw.out_buf[64 * i:64 * i + i + 1] = i
            sw.out_offsets[i], sw.out_lengths[i] = 64 * i, i + 1
            sw.out_names[i] = np.frombuffer(sockaddr_in(dst.address), np.uint8)
        assert sw.send_packets(5) == 0
        heard = {}
        for rx in (a, b):
            n = 0
            deadline = time.monotonic() + 5
            while n < (2 if rx is a else 3) and time.monotonic() < deadline:
                got = rx.recv_packets(0.5)
                assert from_sockaddr_in(rx.in_names[0].tobytes()) == sw.address
                last = rx.in_buf[rx.in_offsets[got - 1]:rx.in_offsets[got - 1] + rx.in_lengths[got - 1]].tobytes()
                n += got
            heard[rx] = n
        assert heard == {a: 2, b: 3}
        assert last == bytes([4] * 5)
        a.send([((b"hi",), sw.address)])
        assert sw.recv_packets(1.0) == 1
        assert from_sockaddr_in(sw.in_names[0].tobytes()) == a.address


def _receive(rx: UdpSocket, count: int) -> list[tuple[bytes, tuple[str, int]]]:
    got: list[tuple[bytes, tuple[str, int]]] = []
    deadline = time.monotonic() + 5
    while len(got) < count and time.monotonic() < deadline:
        got += [(bytes(v), a) for v, a in rx.recv(0.2)]
    return got


segmented = pytest.mark.skipif(not BATCHED_AVAILABLE, reason="UDP segmentation offload is a Linux feature")


@segmented
@pytest.mark.parametrize("receiver", [None, False], ids=["gro", "no-gro"])
def test_segmented_rows_arrive_as_the_same_datagrams_in_order(receiver):
    """200 rows of 280 bytes leave in one system call; with or without GRO the receiver gets those datagrams."""
    with UdpSocket(("127.0.0.1", 0), batch=256, max_datagram=280, segmentation=receiver) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batch=256, max_datagram=280) as tx:
        assert tx.gso and tx.backend.startswith("sendmmsg+GSO")
        assert rx.gro == (receiver is None)
        for i in range(200):
            tx.out_rows[i] = np.arange(i, i + 280) % 251
        assert tx.send_rows(200, 280) == 0
        got = _receive(rx, 200)
    assert [d for d, _ in got] == [bytes(tx.out_rows[i]) for i in range(200)]
    assert tx.stats.sent == 200 and tx.stats.send_calls == 1
    if receiver is None:
        assert rx.stats.recv_calls < 20  # coalesced: up to a message's worth of segments per buffer


@segmented
def test_runs_break_where_the_size_changes_and_a_shorter_last_datagram_ends_one():
    sizes = [280] * 70 + [100] + [280] * 5 + [50] * 3 + [0] + [7]
    with UdpSocket(("127.0.0.1", 0), batch=256) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batch=128, max_datagram=280) as tx:
        msgs = [((bytes([i % 256]) * size,), None) for i, size in enumerate(sizes)]
        assert tx.send(msgs) == 0
        got = _receive(rx, len(sizes))
    assert [d for d, _ in got] == [m[0][0] for m in msgs]


@segmented
def test_an_unconnected_socket_groups_each_destinations_packets_and_keeps_their_order():
    """The switch's path: interleaved multicast replicas leave as one segmented message per worker."""
    with UdpSocket(("127.0.0.1", 0), batch=512, max_datagram=280) as sw, \
            UdpSocket(("127.0.0.1", 0)) as a, UdpSocket(("127.0.0.1", 0)) as b:
        for i in range(400):
            sw.out_buf[280 * i:280 * (i + 1)] = i % 256
            sw.out_offsets[i], sw.out_lengths[i] = 280 * i, 280
            sw.out_names[i] = np.frombuffer(sockaddr_in((a if i % 2 else b).address), np.uint8)
        assert sw.send_packets(400) == 0
        assert sw.stats.send_calls == 1 and sw.stats.sent == 400
        for rx, parity in ((a, 1), (b, 0)):
            got = _receive(rx, 200)
            assert [d for d, _ in got] == [bytes([i % 256]) * 280 for i in range(parity, 400, 2)]
            assert {src for _, src in got} == {sw.address}


@segmented
def test_segmentation_can_be_turned_off_and_the_datagrams_are_the_same():
    with UdpSocket(("127.0.0.1", 0), segmentation=False) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batch=100, max_datagram=280, segmentation=False) as tx:
        assert not tx.gso and not rx.gro and tx.backend == "sendmmsg/recvmmsg"
        tx.out_rows[:100] = np.arange(280) % 7
        assert tx.send_rows(100, 280) == 0
        assert [d for d, _ in _receive(rx, 100)] == [bytes(tx.out_rows[0])] * 100


_REFUSAL = """
import numpy as np
from switchagg.transport import UdpSocket
with UdpSocket(("127.0.0.1", 0)) as rx, UdpSocket(("127.0.0.1", 0), peer=rx.address, batch=8, max_datagram=2000) as tx:
    tx.out_rows[:8] = np.arange(8, dtype=np.uint8)[:, None]
    assert tx.send_rows(8, 2000) == 0
    got = []
    while len(got) < 8 and rx.wait(2.0):
        got += [bytes(v) for v, _ in rx.recv()]
    assert got == [bytes([i]) * 2000 for i in range(8)], [len(g) for g in got]
    print(tx.backend)
"""


@pytest.mark.netns
def test_a_refused_segmentation_falls_back_to_plain_datagrams_and_says_why():
    """2000-byte segments on a 1500-byte loopback: the kernel refuses GSO, the datagrams still arrive."""
    import os

    from .conftest import need

    need("netns", None if os.geteuid() == 0 and shutil.which("ip") else "needs root and `ip` for a namespace")
    from switchagg import netns

    ns = "sag-refuse"
    netns.delete_namespace(ns)
    netns.add_namespace(ns)
    try:
        netns.sh("ip", "link", "set", "lo", "mtu", "1500", ns=ns)
        root = str(Path(__file__).resolve().parents[1])
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _REFUSAL], capture_output=True,
                             text=True, timeout=60, cwd=root)
    finally:
        netns.delete_namespace(ns)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"sendmmsg \(GSO refused: (EINVAL|EMSGSIZE)\)/recvmmsg\+GRO", out.stdout.strip())


@pytest.mark.parametrize("batched", [False, True] if BATCHED_AVAILABLE else [False])
def test_packets_of_a_header_and_a_shared_body_arrive_whole_each_to_its_destination(batched):
    """The switch's multicast: a header per packet, the values once, every packet of the result pointing at them.
    Segmented runs (two workers' 200 results each) cut the iovecs by size; a header alone (a reduce-scatter's
    non-owner) or a longer header breaks a run as any other size does."""
    with UdpSocket(("127.0.0.1", 0), batch=512, out_bytes=1 << 16, batched=batched) as sw, \
            UdpSocket(("127.0.0.1", 0), batched=batched) as a, UdpSocket(("127.0.0.1", 0), batched=batched) as b:
        want: dict[UdpSocket, list[bytes]] = {a: [], b: []}
        at = n = 0
        for r in range(200):
            body_at, body = at, bytes([r % 256]) * (256 if r != 150 else 0)
            sw.out_buf[at:at + len(body)] = np.frombuffer(body, np.uint8)
            at += len(body)
            for rx in (a, b):
                head = bytes([r % 256, 0 if rx is a else 1]) * (12 if r != 199 else 13)
                sw.out_buf[at:at + len(head)] = np.frombuffer(head, np.uint8)
                sw.out_offsets[n], sw.out_lengths[n] = at, len(head)
                sw.out_body_offsets[n], sw.out_body_lengths[n] = body_at, len(body)
                sw.out_names[n] = np.frombuffer(sockaddr_in(rx.address), np.uint8)
                want[rx].append(head + body)
                at, n = at + len(head), n + 1
        assert sw.send_packets(n, bodies=True) == 0
        assert sw.stats.sent == n and sw.stats.bytes_sent == sum(map(len, want[a] + want[b]))
        for rx in (a, b):
            got = _receive(rx, 200)
            assert [d for d, _ in got] == want[rx]
            assert {src for _, src in got} == {sw.address}


class EchoedStream:
    """A stream for UdpSocket.drive: ``n`` packets of a size each, due at once; done when all came back.
    Its timers fall due ``wait`` seconds from each look at them."""

    def __init__(self, n: int, size: int = 280, *, wait: float = 60.0, raise_on_tick: bool = False) -> None:
        self.due = [bytes([i % 256, i // 256]) * (size // 2) for i in range(n)]
        self.n, self.back, self.ticks, self.wait, self.raise_on_tick = n, [], [], wait, raise_on_tick

    @property
    def done(self) -> bool:
        return len(self.back) == self.n

    def emit(self, rows: np.ndarray, lengths: np.ndarray) -> int:
        n = min(len(self.due), len(rows))
        for i, packet in enumerate(self.due[:n]):
            rows[i, :len(packet)] = np.frombuffer(packet, np.uint8)
            lengths[i] = len(packet)
        del self.due[:n]
        return n

    def next_deadline(self) -> float:
        return time.monotonic() + self.wait

    def receive_batch(self, buf, offsets, lengths, now: float) -> int:
        view = memoryview(buf).cast("B")
        self.back += [bytes(view[at:at + length]) for at, length in zip(offsets.tolist(), lengths.tolist(),
                                                                         strict=True)]
        return len(offsets)

    def tick(self, now: float) -> None:
        self.ticks.append(now)
        if self.raise_on_tick:
            raise RuntimeError("the stream's own error")


def echo(sock, count: int) -> threading.Thread:
    """A peer that sends each of ``count`` datagrams back as it came."""
    def run() -> None:
        left = count
        while left:
            data, source = sock.recvfrom(65535)
            sock.sendto(data, source)
            left -= 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="drive is the batched backend's (Linux)")
def test_drive_moves_a_streams_packets_until_it_is_done():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)  # 300 small datagrams at once
        peer.bind(("127.0.0.1", 0))
        with UdpSocket(("127.0.0.1", 0), peer=peer.getsockname(), batch=64, max_datagram=280) as sock:
            stream, steps = EchoedStream(300), []
            sent = list(stream.due)
            thread = echo(peer, 300)
            assert sock.drive(stream, 30.0, lambda s, now: steps.append((s, now))) is True
            thread.join(10)
    assert sorted(stream.back) == sorted(sent)  # whole, each once (loopback keeps them in order too)
    assert sock.stats.sent == sock.stats.received == 300 and sock.stats.bytes_sent == sock.stats.bytes_received
    assert sock.stats.bytes_sent == 300 * 280 and sock.stats.send_calls >= 300 // 64
    assert len(steps) == len(stream.ticks) >= 1 and all(s is stream for s, _ in steps)
    assert [now for _, now in steps] == stream.ticks == sorted(stream.ticks)
    assert stream.ticks[-1] <= time.monotonic()  # the clock is time.monotonic()'s


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="drive is the batched backend's (Linux)")
def test_drive_returns_after_wake_when_nothing_comes_and_raises_what_the_stream_raises():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.bind(("127.0.0.1", 0))
        with UdpSocket(("127.0.0.1", 0), peer=peer.getsockname(), max_datagram=280) as sock:
            stream = EchoedStream(10)
            start = time.monotonic()
            assert sock.drive(stream, 0.05) is False  # no answer: back to the caller, which may stop
            assert time.monotonic() - start < 5 and len(stream.ticks) == 1
            assert sock.stats.sent == 10 and sock.stats.received == 0
            failing = EchoedStream(5, wait=0.0, raise_on_tick=True)
            with pytest.raises(RuntimeError, match="the stream's own error"):
                sock.drive(failing, 30.0)
            assert sock.stats.sent == 15  # what moved before it raised is counted
        with UdpSocket(("127.0.0.1", 0)) as unconnected, pytest.raises(ValueError, match="connected socket"):
            unconnected.drive(EchoedStream(1), 1.0)


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="drive is the batched backend's (Linux)")
def test_interrupt_ends_a_drive_and_every_later_wait_at_once():
    """A drive whose stream's timers and wake are an hour off waits on a peer that never answers; once the
    peer has its packet (the drive waits), interrupt() ends the drive (False: the caller looks), and every
    wait after it returns at once. Without the interrupt the drive would run out its hour."""
    import socket

    hour = 3600.0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.bind(("127.0.0.1", 0))
        peer.settimeout(60)
        with UdpSocket(("127.0.0.1", 0), peer=peer.getsockname(), max_datagram=280) as sock:
            returned: list[bool] = []
            driving = threading.Thread(target=lambda: returned.append(sock.drive(EchoedStream(1, wait=hour), hour)),
                                       daemon=True)
            driving.start()
            peer.recv(2048)
            sock.interrupt()
            driving.join(60)
            assert not driving.is_alive() and returned == [False]
            assert sock.wait(hour) and sock.recv_packets(hour) == 0  # at once: nothing came, the socket is shut
