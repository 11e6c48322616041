"""Batched UDP: many datagrams per system call with sendmmsg/recvmmsg on Linux.

The batched backend calls libc through ctypes; elsewhere (or when asked) a plain
backend uses one sendmsg/recvfrom per datagram. Both present the same
interface, and both treat what the kernel refuses (ENOBUFS, EPERM from a
firewall, ECONNREFUSED from an ICMP error) as lost packets: the protocol
retransmits, nothing crashes. IPv4 only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import select
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Address = tuple[str, int]
Part = bytes | np.ndarray
Message = tuple[Sequence[Part], Address | None]

_TRANSIENT = {errno.ENOBUFS, errno.EPERM, errno.ECONNREFUSED, errno.EHOSTUNREACH,
              errno.ENETUNREACH, errno.EAGAIN, errno.EMSGSIZE}
IP_MTU = 14  # linux/in.h: the path MTU of a connected socket


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(_IoVec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


# Numpy views of the same memory, so a batch's fields are written and read a column at a time
# rather than one ctypes attribute at a time (which costs more than the system call per datagram).
_MMSG_VIEW = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "len"],
    "formats": [np.uintp, np.uint32, np.uintp, np.uintp, np.uint32],
    "offsets": [_MsgHdr.name.offset, _MsgHdr.namelen.offset, _MsgHdr.iov.offset, _MsgHdr.iovlen.offset,
                _MMsgHdr.len.offset],
    "itemsize": ctypes.sizeof(_MMsgHdr)})
_IOV_VIEW = np.dtype({"names": ["base", "len"], "formats": [np.uintp, np.uintp],
                      "offsets": [_IoVec.base.offset, _IoVec.len.offset], "itemsize": ctypes.sizeof(_IoVec)})
_MMSG_SIZE = ctypes.sizeof(_MMsgHdr)
_MAX_NAMES = 4096  # source addresses remembered; a sender forging many just empties the cache


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("sendmmsg", "recvmmsg"):
        if not hasattr(libc, name):
            return None
    libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    return libc


_LIBC = _load_libc()
BATCHED_AVAILABLE = _LIBC is not None


NAME_SIZE = 16  # sizeof(struct sockaddr_in)


def sockaddr_in(addr: Address) -> bytes:
    """``addr`` as the kernel's sockaddr_in, the form sendmmsg, recvmmsg and the C switch use."""
    return struct.pack("=H", socket.AF_INET) + struct.pack(">H", addr[1]) + socket.inet_aton(addr[0]) + bytes(8)


def from_sockaddr_in(raw: bytes) -> Address:
    return socket.inet_ntoa(raw[4:8]), struct.unpack(">H", raw[2:4])[0]


def _pointer(part: Part) -> int:
    """Where a part's bytes lie (it must stay alive until the system call returns)."""
    if isinstance(part, np.ndarray):
        if part.flags.writeable and part.flags.c_contiguous and part.nbytes:
            return ctypes.addressof(ctypes.c_char.from_buffer(part))  # a third of part.ctypes.data's cost
        return part.ctypes.data
    return ctypes.cast(ctypes.c_char_p(part), ctypes.c_void_p).value or 0


@dataclass
class TransportStats:
    """What the socket did: messages and the system calls that carried them."""

    sent: int = 0
    send_calls: int = 0
    received: int = 0
    recv_calls: int = 0
    refused: int = 0  # sends the kernel refused, or ICMP errors it reported (counted as loss)


class UdpSocket:
    """A UDP socket that sends and receives in batches.

    ``peer`` connects the socket: the kernel then only delivers datagrams from
    that address and reports ICMP errors, which is what a worker wants.
    """

    def __init__(self, bind: Address, *, peer: Address | None = None, batch: int = 64,
                 max_datagram: int = 65507, buffer_bytes: int = 8 << 20, batched: bool | None = None) -> None:
        if batched and not BATCHED_AVAILABLE:
            raise OSError("sendmmsg/recvmmsg are not available here; use batched=False")
        self.batched = BATCHED_AVAILABLE if batched is None else batched
        self.backend = "sendmmsg/recvmmsg" if self.batched else "sendmsg/recvfrom"
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for force, plain in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, plain, buffer_bytes)
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
        self.stats = TransportStats()
        self.batch = batch
        self.max_datagram = max_datagram
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)
        self.in_rows = np.empty((batch, max_datagram), dtype=np.uint8)  # where recv_rows puts datagrams
        self.in_lengths = np.zeros(batch, dtype=np.uint32)  # and their lengths
        self._rview = memoryview(self.in_rows).cast("B")
        self._names: dict[Address, tuple[ctypes.Array, int]] = {}
        self.in_names = np.zeros((batch, NAME_SIZE), dtype=np.uint8)  # and, unconnected, their sources
        self.out_rows = np.empty((batch, max_datagram), dtype=np.uint8)  # what send_rows sends
        self.out_lengths = np.zeros(batch, dtype=np.uint32)  # and, for send_rows_to, their lengths
        self.out_names = np.zeros((batch, NAME_SIZE), dtype=np.uint8)  # and destinations
        if self.batched:
            # Column views of the mmsghdr arrays, made once: numpy builds a new view per field access.
            self._svec, self._siov = self._vectors(self.out_rows, named=peer is None, parts=2)
            smsg = np.frombuffer(self._svec, dtype=_MMSG_VIEW)
            self._sname, self._siovlen = smsg["name"], smsg["iovlen"]
            iov = np.frombuffer(self._siov, dtype=_IOV_VIEW)
            self._shead_len, self._svals, self._svals_len = iov["len"][0::2], iov["base"][1::2], iov["len"][1::2]
            self._rows_size = 0  # the row size send_rows last laid out (0: send() changed the layout)
            # A connected socket hears only its peer: no source addresses to read then.
            self._rvec, self._riov = self._vectors(self.in_rows, named=peer is None)
            rmsg = np.frombuffer(self._rvec, dtype=_MMSG_VIEW)
            self._rnamelen, self._rlen = rmsg["namelen"], rmsg["len"]
            if peer is None:
                rmsg["name"] = self.in_names.ctypes.data + NAME_SIZE * np.arange(batch)
                self._out_name_pointers = self.out_names.ctypes.data + NAME_SIZE * np.arange(batch, dtype=np.uintp)
            self._addresses: dict[bytes, Address] = {}
            self._fd = self.sock.fileno()
            self._svec_at, self._rvec_at = ctypes.addressof(self._svec), ctypes.addressof(self._rvec)

    def _vectors(self, rows: np.ndarray, named: bool, parts: int = 1) -> tuple[ctypes.Array, ctypes.Array]:
        """mmsghdr and iovec arrays: message i has ``parts`` iovecs, the first pointing at row i of ``rows``."""
        vec = (_MMsgHdr * len(rows))()
        iovs = (_IoVec * (parts * len(rows)))()
        for i in range(len(rows)):
            first = iovs[parts * i]
            first.base, first.len = rows.ctypes.data + i * rows.shape[1], rows.shape[1]
            vec[i].hdr.iov = ctypes.pointer(first)
            vec[i].hdr.iovlen = 1
            vec[i].hdr.namelen = NAME_SIZE if named else 0
        return vec, iovs

    @property
    def address(self) -> Address:
        return self.sock.getsockname()

    def path_mtu(self) -> int:
        """The kernel's MTU towards the connected peer (Linux), or 1500 if it cannot tell."""
        try:
            return self.sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:
            return 1500

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> UdpSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sending ---------------------------------------------------------------------------------

    def send(self, messages: Sequence[Message]) -> int:
        """Send every message; returns how many the kernel refused (they count as lost).

        A message is ((header,), address) or ((header, values), address): the header is bytes, the
        values bytes or a contiguous array; address None sends to the connected peer.
        """
        refused = 0
        for start in range(0, len(messages), self.batch):
            chunk = messages[start:start + self.batch]
            refused += self._send_mmsg(chunk) if self.batched else self._send_plain(chunk)
        self.stats.refused += refused
        return refused

    def _send_plain(self, messages: Sequence[Message]) -> int:
        refused = 0
        for parts, addr in messages:
            self.stats.send_calls += 1
            try:
                if addr is None:
                    self.sock.sendmsg(parts)
                else:
                    self.sock.sendmsg(parts, [], 0, addr)
                self.stats.sent += 1
            except BlockingIOError:
                refused += 1
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    raise
                refused += 1
        return refused

    def _send_mmsg(self, messages: Sequence[Message]) -> int:
        if len(messages) == 1:  # one datagram: a plain sendmsg is the cheaper call
            return self._send_plain(messages)
        # The first part (the header) is copied into the message's fixed row; a second part (the
        # values) is sent from where it lies, so a multicast of one result copies nothing here.
        n = len(messages)
        heads = [parts[0] for parts, _ in messages]
        size = len(heads[0])
        if all(len(h) == size for h in heads):  # the usual case: one copy for all headers
            self.out_rows[:n, :size] = np.frombuffer(b"".join(heads), np.uint8).reshape(n, size)
            self._shead_len[:n] = size
        else:
            for i, head in enumerate(heads):
                self.out_rows[i, :len(head)] = np.frombuffer(head, np.uint8)
                self._shead_len[i] = len(head)
        iovlen = [len(parts) for parts, _ in messages]
        if not set(iovlen) <= {1, 2}:
            raise ValueError("a message has one or two parts (header, values)")
        self._siovlen[:n] = iovlen
        self._rows_size = 0
        keep = [parts[1] if len(parts) == 2 else b"" for parts, _ in messages]
        pointers: dict[int, int] = {}  # a result multicast to n workers is one array n times
        self._svals[:n] = [pointers.get(id(v)) or pointers.setdefault(id(v), _pointer(v)) for v in keep]
        self._svals_len[:n] = [len(v) if isinstance(v, bytes) else v.nbytes for v in keep]
        if self.peer is None:
            self._sname[:n] = [self._name(addr) for _, addr in messages]
        refused = self._sendmmsg(n)
        del keep  # the values buffers had to live until the kernel copied them
        return refused

    def send_rows(self, n: int, size: int) -> int:
        """Send the first ``size`` bytes of each of the first ``n`` rows of :attr:`out_rows` to the peer.

        The zero-copy path of a connected socket: the caller writes each packet
        straight into its row. Returns how many the kernel refused (lost).
        """
        if self.peer is None or not 0 <= n <= self.batch or size > self.max_datagram:
            raise ValueError("send_rows needs a connected socket, n <= batch and size <= max_datagram")
        if self.batched and n > 1:
            if self._rows_size != size:  # lay every row out as one part of `size` bytes, once
                self._shead_len[:] = size
                self._siovlen[:] = 1
                self._rows_size = size
            refused = self._sendmmsg(n)
        else:
            refused = self._send_plain([((self.out_rows[i, :size],), None) for i in range(n)])
        self.stats.refused += refused
        return refused

    def send_rows_to(self, n: int) -> int:
        """Send row i of :attr:`out_rows` (:attr:`out_lengths` [i] bytes) to the sockaddr_in in row i of
        :attr:`out_names`, for i < ``n``: the path of the C switch, which writes all three.

        Returns how many the kernel refused (lost).
        """
        if self.peer is not None or not 0 <= n <= self.batch:
            raise ValueError("send_rows_to needs an unconnected socket and n <= batch")
        if self.batched:
            self._shead_len[:n] = self.out_lengths[:n]
            self._siovlen[:n] = 1
            self._sname[:n] = self._out_name_pointers[:n]
            self._rows_size = 0
            refused = self._sendmmsg(n) if n else 0
        else:
            refused = self._send_plain([((self.out_rows[i, :self.out_lengths[i]],),
                                         from_sockaddr_in(self.out_names[i].tobytes())) for i in range(n)])
        self.stats.refused += refused
        return refused

    def _sendmmsg(self, n: int) -> int:
        """sendmmsg the first ``n`` prepared messages; a refused one is skipped and counted."""
        done = refused = 0
        while done < n:
            self.stats.send_calls += 1
            sent = _LIBC.sendmmsg(self._fd, self._svec_at + done * _MMSG_SIZE, n - done, 0)
            if sent < 0:
                err = ctypes.get_errno()
                if err not in _TRANSIENT and err != errno.EINTR:
                    raise OSError(err, f"sendmmsg failed: {errno.errorcode.get(err, err)}")
                if err != errno.EINTR:
                    refused += 1
                    done += 1  # the first message of the batch is the one the kernel refused
                continue
            self.stats.sent += sent
            done += sent
        return refused

    def _name(self, addr: Address) -> int:
        """The address of a sockaddr_in for ``addr``, made once and kept."""
        entry = self._names.get(addr)
        if entry is None:
            buf = ctypes.create_string_buffer(sockaddr_in(addr), NAME_SIZE)
            entry = self._names[addr] = (buf, ctypes.addressof(buf))
        return entry[1]

    # ---- receiving -------------------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Block until a datagram is waiting or ``timeout`` seconds passed."""
        return bool(self._poll.poll(max(0, int(timeout * 1000 + 0.999))))

    def recv(self, timeout: float = 0.0) -> list[tuple[memoryview, Address]]:
        """Up to ``batch`` datagrams, waiting at most ``timeout`` for the first.

        The views point into a buffer that the next call overwrites: use them first.
        """
        if timeout > 0 and not self.wait(timeout):
            return []
        return self._recv_mmsg() if self.batched else self._recv_plain()

    def recv_rows(self, timeout: float = 0.0) -> int:
        """Up to ``batch`` datagrams into the rows of :attr:`in_rows`, their lengths into :attr:`in_lengths`.

        Waits at most ``timeout`` for the first; returns how many. An unconnected socket puts
        each datagram's source, a sockaddr_in, in the rows of :attr:`in_names`. No Python object
        is made per datagram by the batched backend, which is the point.
        """
        if timeout > 0 and not self.wait(timeout):
            return 0
        if not self.batched:
            got = self._recv_plain()
            self.in_lengths[:len(got)] = [len(view) for view, _ in got]
            for i, (_, addr) in enumerate(got):
                self.in_names[i] = np.frombuffer(sockaddr_in(addr), dtype=np.uint8)
            return len(got)
        got = self._recvmmsg()
        self.in_lengths[:got] = self._rlen[:got]
        return got

    def _recv_plain(self) -> list[tuple[memoryview, Address]]:
        out = []
        for i in range(self.batch):
            view = self._rview[i * self.max_datagram:(i + 1) * self.max_datagram]
            self.stats.recv_calls += 1
            try:
                size, addr = self.sock.recvfrom_into(view)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    raise
                self.stats.refused += 1  # an ICMP error reported late: a loss
                continue
            out.append((view[:size], addr))
        self.stats.received += len(out)
        return out

    def _recvmmsg(self) -> int:
        """recvmmsg into the rows; how many datagrams came (0 when none waited)."""
        if self.peer is None:
            self._rnamelen[:] = NAME_SIZE
        while True:
            self.stats.recv_calls += 1
            got = _LIBC.recvmmsg(self._fd, self._rvec_at, self.batch, socket.MSG_DONTWAIT, None)
            if got >= 0:
                break
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if err not in _TRANSIENT and err != errno.EINTR:
                raise OSError(err, f"recvmmsg failed: {errno.errorcode.get(err, err)}")
            self.stats.refused += err != errno.EINTR  # an ICMP error reported late: a loss
        self.stats.received += got
        return got

    def _recv_mmsg(self) -> list[tuple[memoryview, Address]]:
        got = self._recvmmsg()
        view, size = self._rview, self.max_datagram
        lengths = self._rlen[:got].tolist()
        if self.peer is not None:
            return [(view[i * size:i * size + length], self.peer) for i, length in enumerate(lengths)]
        names = self.in_names[:got].tobytes()
        known = self._addresses
        if len(known) > _MAX_NAMES:
            known.clear()
        out = []
        for i, length in enumerate(lengths):
            raw = names[NAME_SIZE * i:NAME_SIZE * (i + 1)]
            addr = known.get(raw)
            if addr is None:
                addr = known[raw] = from_sockaddr_in(raw)
            out.append((view[i * size:i * size + length], addr))
        return out
