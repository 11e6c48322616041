"""A TCP port inside a network namespace that leads to an address outside it.

The BMv2 test bed's hosts are namespaces whose only link is to BMv2's data plane, but a process
group's rank 0 deploys its job over P4Runtime, which listens in the root namespace. Network
namespaces belong to threads: one thread enters the host's namespace and listens there; each
connection it accepts is joined, by a thread still in the root namespace, to the real address.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import socket
import threading

CLONE_NEWNET = 0x40000000


class NamespaceForwarder:
    """``127.0.0.1:port`` inside namespace ``ns`` forwards to ``upstream`` (host, port) outside it."""

    def __init__(self, ns: str, upstream: tuple[str, int]) -> None:
        self.ns, self.upstream = ns, upstream
        self._accepted: queue.Queue[socket.socket | None] = queue.Queue()
        self._listening = threading.Event()
        self._listener: socket.socket | None = None
        self.port = 0
        self._threads = [threading.Thread(target=self._listen, daemon=True),
                         threading.Thread(target=self._connect, daemon=True)]

    def __enter__(self) -> NamespaceForwarder:
        for t in self._threads:
            t.start()
        if not self._listening.wait(10) or self._listener is None:
            raise RuntimeError(f"could not listen inside namespace {self.ns}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._accepted.put(None)
        if self._listener is not None:
            self._listener.close()

    def _listen(self) -> None:
        fd = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:  # this thread only
                return
        finally:
            os.close(fd)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._listening.set()
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the forwarder is done
                return
            self._accepted.put(conn)

    def _connect(self) -> None:
        while (conn := self._accepted.get()) is not None:
            up = socket.create_connection(self.upstream)  # this thread is still in the root namespace
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        with contextlib.suppress(OSError):  # a side closed: close the other
            while data := src.recv(1 << 16):
                dst.sendall(data)
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
