"""Batched UDP: many datagrams per system call on Linux, with the kernel's segmentation offload.

On Linux the batched backend (:mod:`switchagg._udp`, C) sends with sendmmsg and receives with
recvmmsg, and where the kernel has them it turns on UDP generic segmentation offload (a run of
equal-sized datagrams to one destination leaves as one message, ``UDP_SEGMENT``) and receive
coalescing (``UDP_GRO``: consecutive datagrams of a flow arrive as one buffer, split here by the
segment size the kernel reports). At the P4 switch's packet size (K = 64, 280-byte datagrams) that
moves tens of times more datagrams per core than one datagram per message. Each socket probes both
once; a kernel or device that refuses segmentation on a send (EIO where the device has no checksum
offload, EINVAL, a firewall) gets the same datagrams as plain messages, then and from then on, and
:attr:`UdpSocket.backend` says so. Elsewhere, or when asked, a plain backend uses one
sendto/recvfrom per datagram. All present the same interface and send the same datagrams.

Datagrams lie in flat byte buffers described by offset, length and (unconnected) address arrays,
which the C state machines read and write directly: no Python object per datagram. What the
kernel refuses (ENOBUFS, EPERM from a firewall, ECONNREFUSED from an ICMP error) counts as lost
packets: the protocol retransmits, nothing crashes. IPv4 only.
"""

from __future__ import annotations

import errno
import functools
import select
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import _udp

Address = tuple[str, int]
Part = bytes | np.ndarray
Message = tuple[Sequence[Part], Address | None]


class Stream(Protocol):
    """What :meth:`UdpSocket.drive` moves packets for: a worker's state machine (``protocol.Reduction``,
    ``NativeReduction``), seen from the socket."""

    @property
    def done(self) -> bool: ...
    def emit(self, rows: np.ndarray, lengths: np.ndarray) -> int: ...
    def next_deadline(self) -> float: ...
    def receive_batch(self, buf: np.ndarray, offsets: np.ndarray | memoryview, lengths: np.ndarray | memoryview,
                      now: float) -> int: ...
    def tick(self, now: float) -> None: ...

_TRANSIENT = {errno.ENOBUFS, errno.EPERM, errno.ECONNREFUSED, errno.EHOSTUNREACH,
              errno.ENETUNREACH, errno.EAGAIN, errno.EMSGSIZE}
IP_MTU = 14  # linux/in.h: the path MTU of a connected socket
NAME_SIZE = 16  # sizeof(struct sockaddr_in)
MAX_UDP = 65507  # the largest UDP payload of an IPv4 datagram
GRO_BUFFER = 65535  # a coalesced message is at most this long
BATCHED_AVAILABLE = sys.platform.startswith("linux") and hasattr(_udp, "send")
_GRO_MESSAGES = 16  # coalesced messages per receive call (each up to GRO_BUFFER bytes)
_RECV_VLEN = getattr(_udp, "RECV_VLEN", 256)  # messages per receive call otherwise
_MAX_NAMES = 4096  # source addresses remembered; a sender forging many just empties the cache
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: a wait wakes when the socket is shut for reading (interrupt)


def sockaddr_in(addr: Address) -> bytes:
    """``addr`` as the kernel's sockaddr_in, the form the batched backend and the C switch use."""
    return struct.pack("=H", socket.AF_INET) + struct.pack(">H", addr[1]) + socket.inet_aton(addr[0]) + bytes(8)


def from_sockaddr_in(raw: bytes) -> Address:
    return socket.inet_ntoa(raw[4:8]), struct.unpack(">H", raw[2:4])[0]


@functools.cache
def max_segments() -> int:
    """Datagrams one segmented message may carry on this kernel: 128 since Linux 6.x, 64 before.

    Found once per process by sending 128 tiny segments from one loopback socket to another.
    """
    if not BATCHED_AVAILABLE:
        return 1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        try:
            rx.bind(("127.0.0.1", 0))
            tx.connect(rx.getsockname())
            tx.sendmsg([bytes(8 * 128)], [(_udp.SOL_UDP, _udp.UDP_SEGMENT, struct.pack("=H", 8))])
        except OSError:
            return 64
    return 128


@dataclass
class TransportStats:
    """What the socket did: datagrams and the system calls that carried them."""

    sent: int = 0
    send_calls: int = 0
    received: int = 0
    recv_calls: int = 0
    refused: int = 0  # sends the kernel refused, or ICMP errors it reported (counted as loss)
    dropped: int = 0  # datagrams of a coalesced message beyond the room of one receive (counted as loss)
    truncated: int = 0  # datagrams longer than a receive's room (MSG_TRUNC): dropped, never handed on cut short
    bytes_sent: int = 0  # UDP payload bytes handed to the kernel (those it refused too) ...
    bytes_received: int = 0  # ... and received: what a reduce-scatter saves shows here


class UdpSocket:
    """A UDP socket that sends and receives in batches.

    ``peer`` connects the socket: the kernel then only delivers datagrams from that address and
    reports ICMP errors, which is what a worker wants. ``batch`` is how many datagrams one send
    takes (the rows of :attr:`out_rows`, each ``max_datagram`` bytes, or ``out_bytes`` of
    :attr:`out_buf` laid out by the caller) and about how many one receive brings.
    ``segmentation`` None turns on GSO and GRO where the kernel has them, False never, True
    requires them. ``reuse_port`` joins the SO_REUSEPORT group already bound to ``bind`` (the
    embedded switch's sockets, one a core).
    """

    def __init__(self, bind: Address, *, peer: Address | None = None, batch: int = 64,
                 max_datagram: int = MAX_UDP, buffer_bytes: int = 8 << 20, batched: bool | None = None,
                 segmentation: bool | None = None, out_bytes: int | None = None, reuse_port: bool = False) -> None:
        if batched and not BATCHED_AVAILABLE:
            raise OSError("sendmmsg/recvmmsg are not available here (Linux only); use batched=False")
        self.batched = BATCHED_AVAILABLE if batched is None else batched
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for force, plain in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, plain, buffer_bytes)
        if reuse_port:  # join the SO_REUSEPORT group of the sockets already on ``bind`` (asked before binding)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind(bind)
        except OSError as exc:
            self.sock.close()
            raise OSError(exc.errno, f"cannot bind UDP {bind[0]}:{bind[1]}: {exc.strerror}; "
                          "is another process using that address?") from None
        self.peer = peer
        if peer is not None:
            self.sock.connect(peer)
        self.sock.setblocking(False)
        self._fd = self.sock.fileno()
        self.stats = TransportStats()
        self.batch, self.max_datagram = batch, max_datagram
        self.gso, self.gro = self._probe(segmentation)
        self.segments = max_segments() if self.gso else 1
        self._gso_refused = ""
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN | _POLLRDHUP)
        # Sending: packet i is out_lengths[i] bytes at out_buf[out_offsets[i]:], to out_names[i] when unconnected.
        self.out_buf = np.zeros(out_bytes or batch * max_datagram, dtype=np.uint8)
        self.out_offsets = np.zeros(batch, dtype=np.uint32)
        self.out_lengths = np.zeros(batch, dtype=np.uint32)
        self.out_names = np.zeros((batch, NAME_SIZE), dtype=np.uint8)
        # ... followed by out_body_lengths[i] bytes at out_buf[out_body_offsets[i]:] with send_packets(bodies=True):
        # a body several packets share (the embedded switch's multicast of a large sum: one copy, a header per
        # worker), or none (length 0).
        self.out_body_offsets = np.zeros(batch, dtype=np.uint32)
        self.out_body_lengths = np.zeros(batch, dtype=np.uint32)
        rows = len(self.out_buf) // max_datagram
        self.out_rows = self.out_buf[:rows * max_datagram].reshape(rows, max_datagram)
        self._row_offsets = (max_datagram * np.arange(min(rows, batch))).astype(np.uint32)
        self._rows_laid_out = False
        # Receiving: message j lands at in_buf[j * stride:], and datagram i is described like a send.
        self._stride = GRO_BUFFER if self.gro else max_datagram
        self._messages = min(batch, _GRO_MESSAGES if self.gro else _RECV_VLEN)
        room = self._messages * (max_segments() if self.gro else 1)
        self.in_buf = np.zeros(self._messages * self._stride, dtype=np.uint8)
        self.in_offsets = np.zeros(room, dtype=np.uint32)
        self.in_lengths = np.zeros(room, dtype=np.uint32)
        self.in_names = np.zeros((room, NAME_SIZE), dtype=np.uint8)  # unconnected: each datagram's source
        self._view = memoryview(self.in_buf)
        self._addresses: dict[bytes, Address] = {}

    def _probe(self, segmentation: bool | None) -> tuple[bool, bool]:
        """Whether this socket segments its sends and has its receives coalesced (asked once, here)."""
        if segmentation is False or not self.batched:
            if segmentation:
                raise OSError("UDP segmentation needs the batched backend (Linux)")
            return False, False
        try:
            self.sock.getsockopt(_udp.SOL_UDP, _udp.UDP_SEGMENT)
            gso = True
        except OSError:
            gso = False
        try:
            self.sock.setsockopt(_udp.SOL_UDP, _udp.UDP_GRO, 1)
            gro = True
        except OSError:
            gro = False
        if segmentation and not (gso and gro):
            self.sock.close()
            raise OSError("this kernel has no UDP_SEGMENT (Linux 4.18) or UDP_GRO (Linux 5.0): "
                          "use segmentation=None to fall back to sendmmsg/recvmmsg")
        return gso, gro

    @property
    def backend(self) -> str:
        """How datagrams move, e.g. ``sendmmsg+GSO/recvmmsg+GRO``, and why segmentation stopped if it did."""
        if not self.batched:
            return "sendto/recvfrom"
        send = "sendmmsg+GSO" if self.gso else "sendmmsg"
        if self._gso_refused:
            send += f" (GSO refused: {self._gso_refused})"
        return f"{send}/recvmmsg" + ("+GRO" if self.gro else "")

    @property
    def address(self) -> Address:
        return self.sock.getsockname()

    def path_mtu(self) -> int:
        """The kernel's MTU towards the connected peer (Linux), or 1500 if it cannot tell."""
        try:
            return self.sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:
            return 1500

    def interrupt(self) -> None:
        """End a wait on this socket now, and every later one at once: its owner is closing.

        The socket is shut for reading, which wakes a poll on it (the kernel reports a hang-up:
        :meth:`wait` returns, :meth:`drive` returns False) and leaves it ready; sends still go.
        """
        self.sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> UdpSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sending ---------------------------------------------------------------------------------

    def send_packets(self, n: int, bodies: bool = False, max_length: int = 0) -> int:
        """Send packets 0..n-1 as :attr:`out_buf`, :attr:`out_offsets`, :attr:`out_lengths` and (unconnected)
        :attr:`out_names` describe them, each followed by its body (:attr:`out_body_offsets`,
        :attr:`out_body_lengths`) with ``bodies``; returns how many the kernel refused (they count as lost).
        With ``max_length``, a packet longer than that (body included) is a ValueError, and nothing is sent.

        The C switch's path: it writes all six, a result's values once for all the packets that carry them.
        """
        if not 0 <= n <= self.batch:
            raise ValueError(f"send_packets: n = {n}, this socket sends at most {self.batch} at a time")
        if n == 0:
            return 0
        if not self.batched:
            return self._send_plain(n, bodies, max_length)
        names = None if self.peer is not None else self.out_names
        body = (self.out_body_offsets, self.out_body_lengths) if bodies else (None, None)
        sent, refused, calls, gso_errno, nbytes = _udp.send(self._fd, self.out_buf, self.out_offsets,
                                                            self.out_lengths, names, n, self.segments, *body,
                                                            max_length)
        if gso_errno:
            self._refuse_gso(gso_errno)
        self.stats.sent += sent
        self.stats.bytes_sent += nbytes
        self.stats.send_calls += calls
        self.stats.refused += refused
        return refused

    def _lay_out_rows(self) -> None:
        if not self._rows_laid_out:
            self.out_offsets[:len(self._row_offsets)] = self._row_offsets
            self._rows_laid_out = True

    def _refuse_gso(self, err: int) -> None:
        """The kernel will not segment for this socket: stop asking."""
        self.gso, self.segments = False, 1
        self._gso_refused = errno.errorcode.get(err, str(err))

    def send_rows(self, n: int, size: int | None = None) -> int:
        """Send the first ``size`` bytes of each of the first ``n`` rows of :attr:`out_rows` to the peer,
        or with ``size`` None, the first :attr:`out_lengths` [i] bytes of row i.

        The zero-copy path of a connected socket: the caller writes each packet straight into
        its row, and consecutive rows of one size leave as segmented messages. Returns how many
        the kernel refused (lost).
        """
        if self.peer is None or not 0 <= n <= len(self._row_offsets) or (size or 0) > self.max_datagram:
            raise ValueError("send_rows needs a connected socket, n <= the rows and sizes <= max_datagram")
        self._lay_out_rows()
        if size is not None:
            self.out_lengths[:n] = size
        # the sizes in out_lengths are checked where the packets are walked anyway (a numpy max over them
        # was a twentieth of a worker's CPU at K = 64)
        return self.send_packets(n, max_length=self.max_datagram)

    def send(self, messages: Sequence[Message]) -> int:
        """Send every message; returns how many the kernel refused (they count as lost).

        A message is ((header,), address) or ((header, values), address): the header is bytes, the
        values bytes or a contiguous array; address None sends to the connected peer. The parts
        are copied into :attr:`out_buf`, a batch at a time.
        """
        self._rows_laid_out = False
        refused = n = at = 0
        for parts, addr in messages:
            if len(parts) not in (1, 2):
                raise ValueError("a message has one or two parts (header, values)")
            data = b"".join(p if isinstance(p, bytes) else p.tobytes() for p in parts)
            if n == self.batch or at + len(data) > len(self.out_buf):
                refused += self.send_packets(n)
                n = at = 0
            if len(data) > len(self.out_buf):
                raise ValueError(f"a {len(data)}-byte datagram does not fit this socket's {len(self.out_buf)} bytes")
            self.out_buf[at:at + len(data)] = np.frombuffer(data, np.uint8)
            self.out_offsets[n], self.out_lengths[n] = at, len(data)
            if self.peer is None:
                self.out_names[n] = np.frombuffer(sockaddr_in(addr), np.uint8)
            n, at = n + 1, at + len(data)
        return refused + self.send_packets(n)

    def _send_plain(self, n: int, bodies: bool, max_length: int) -> int:
        if max_length > 0:
            lengths = self.out_lengths[:n] + (self.out_body_lengths[:n] if bodies else 0)
            if int(lengths.max(initial=0)) > max_length:
                raise ValueError(f"send: a packet is longer than {max_length} bytes")
        refused = 0
        view = memoryview(self.out_buf)
        for i in range(n):
            at, length = int(self.out_offsets[i]), int(self.out_lengths[i])
            parts = [view[at:at + length]]
            if bodies:
                at, length = int(self.out_body_offsets[i]), int(self.out_body_lengths[i])
                parts.append(view[at:at + length])
            self.stats.bytes_sent += sum(len(part) for part in parts)
            self.stats.send_calls += 1
            try:
                if self.peer is not None:
                    self.sock.sendmsg(parts)
                else:
                    self.sock.sendmsg(parts, [], 0, from_sockaddr_in(self.out_names[i].tobytes()))
                self.stats.sent += 1
            except BlockingIOError:
                refused += 1
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    raise
                refused += 1
        self.stats.refused += refused
        return refused

    # ---- a stream's loop ---------------------------------------------------------------------------

    @property
    def drives(self) -> bool:
        """Whether :meth:`drive` runs here: the batched backend, on a connected socket."""
        return self.batched and self.peer is not None

    def drive(self, stream: Stream, wake: float,
              advance: Callable[[Stream, float], None] | None = None) -> bool:
        """Move ``stream``'s packets until it is done (True), or for about ``wake`` seconds (False: call again).

        Turn after turn, what the stream has due goes out from :attr:`out_rows` (``stream.emit``), the
        socket is polled until ``stream.next_deadline()``, what came goes to ``stream.receive_batch``, then
        ``stream.tick(now)`` and ``advance(stream, now)`` run: a client's loop, in C (``_udp.drive``). At
        K = 64 a 64 MiB call takes a few hundred turns, and the same loop in Python cost about ten
        microseconds each, a tenth of a worker's CPU; here Python runs once per ``wake``, between which
        the caller looks whether it should stop. What the stream raises is raised; the packets moved
        until then are in :attr:`stats` either way.
        """
        if not self.drives:
            raise ValueError("drive needs the batched backend and a connected socket")
        self._lay_out_rows()
        counts = np.zeros(len(_udp.DRIVE_COUNTS), np.int64)
        try:
            return _udp.drive(self._fd, stream, self.out_rows, self.out_offsets[:len(self._row_offsets)],
                              self.out_lengths, self.segments, self.max_datagram, self.in_buf, self._stride,
                              self._messages, self.in_offsets, self.in_lengths, wake, counts, advance)
        finally:
            moved = dict(zip(_udp.DRIVE_COUNTS, counts.tolist(), strict=True))
            if gso_errno := moved.pop("gso_errno"):
                self._refuse_gso(gso_errno)
            for name, count in moved.items():
                setattr(self.stats, name, getattr(self.stats, name) + count)

    # ---- receiving -------------------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Block until a datagram is waiting or ``timeout`` seconds passed."""
        return bool(self._poll.poll(max(0, int(timeout * 1000 + 0.999))))

    def recv_packets(self, timeout: float = 0.0) -> int:
        """Receive what is waiting (at most one call's worth), waiting at most ``timeout`` for the first.

        Datagram i is then :attr:`in_lengths` [i] bytes at :attr:`in_buf` [:attr:`in_offsets` [i]:],
        and on an unconnected socket its source, a sockaddr_in, is row i of :attr:`in_names`.
        Returns how many; the next call overwrites them.
        """
        if timeout > 0 and not self.wait(timeout):
            return 0
        if not self.batched:
            return self._recv_plain()
        names = None if self.peer is not None else self.in_names
        got, _, dropped, errors, nbytes, truncated = _udp.recv(self._fd, self.in_buf, self._stride, self._messages,
                                                               self.in_offsets, self.in_lengths, names)
        self.stats.truncated += truncated
        self.stats.recv_calls += 1
        self.stats.received += got
        self.stats.bytes_received += nbytes
        self.stats.dropped += dropped
        self.stats.refused += errors
        return got

    def recv(self, timeout: float = 0.0) -> list[tuple[memoryview, Address]]:
        """What :meth:`recv_packets` brings, as (view, source) pairs; the views live until the next receive."""
        got = self.recv_packets(timeout)
        view = self._view
        spans = zip(self.in_offsets[:got].tolist(), self.in_lengths[:got].tolist(), strict=True)
        if self.peer is not None:
            return [(view[at:at + length], self.peer) for at, length in spans]
        if len(self._addresses) > _MAX_NAMES:
            self._addresses.clear()
        names = self.in_names[:got].tobytes()
        out = []
        for i, (at, length) in enumerate(spans):
            raw = names[NAME_SIZE * i:NAME_SIZE * (i + 1)]
            addr = self._addresses.get(raw)
            if addr is None:
                addr = self._addresses[raw] = from_sockaddr_in(raw)
            out.append((view[at:at + length], addr))
        return out

    def _recv_plain(self) -> int:
        got = 0
        for j in range(self._messages):
            at = j * self._stride
            self.stats.recv_calls += 1
            try:
                size, _, flags, addr = self.sock.recvmsg_into([self._view[at:at + self._stride]])
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    raise
                self.stats.refused += 1  # an ICMP error reported late: a loss
                continue
            if flags & socket.MSG_TRUNC:  # longer than the room: dropped, as the batched receive drops it
                self.stats.truncated += 1
                continue
            self.in_offsets[got], self.in_lengths[got] = at, size
            if self.peer is None:
                self.in_names[got] = np.frombuffer(sockaddr_in(addr), np.uint8)
            got += 1
        self.stats.received += got
        self.stats.bytes_received += int(self.in_lengths[:got].sum())
        return got

