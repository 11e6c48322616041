"""A TCP port inside a network namespace that leads to an address outside it.

The BMv2 test bed's hosts are namespaces whose only link is to BMv2's data plane, but a process
group's rank 0 deploys its job over P4Runtime, which listens in the root namespace. The listening
socket is made inside the host's namespace (``netns.socket_in``); each connection it accepts is
joined to the real address by a socket made here, outside.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from switchagg import netns


class NamespaceForwarder:
    """``127.0.0.1:port`` inside namespace ``ns`` forwards to ``upstream`` (host, port) outside it."""

    def __init__(self, ns: str, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = netns.socket_in(ns, socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> NamespaceForwarder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the forwarder is done
                return
            up = socket.create_connection(self.upstream)
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
