"""Real impairments inside test namespaces: nftables loss and duplication, and a reordering relay."""

from __future__ import annotations

import heapq
import random
import select
import socket
import threading
import time

from switchagg import netns


def nft_impair(ns: str, *, loss: int = 0, dup: int = 0, dup_to: str | None = None, dev: str = "eth0",
               port: int = 16711) -> None:
    """Drop ``loss``% of switchagg packets each way in ``ns``, duplicate ``dup``% of those sent."""
    rules = ["add table ip sa",
             "add chain ip sa out { type filter hook output priority 0 ; }",
             "add chain ip sa in { type filter hook input priority 0 ; }"]
    if loss:
        rules += [f"add rule ip sa out udp dport {port} numgen random mod 100 < {loss} drop",
                  f"add rule ip sa in udp sport {port} numgen random mod 100 < {loss} drop"]
    if dup:
        rules.append(f"add rule ip sa out udp dport {port} numgen random mod 100 < {dup} dup to {dup_to} "
                     f"device {dev}")
    for rule in rules:
        netns.sh("nft", *rule.split(), ns=ns)


class ReorderRelay:
    """Forwards every frame between interface pairs of namespace ``ns``, each one held 0..``jitter`` s.

    Frames that overtake each other arrive out of order; nothing is lost. It runs on a thread
    until :meth:`stop`.
    """

    def __init__(self, ns: str, pairs: list[tuple[str, str]], jitter: float = 0.003, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.jitter = jitter
        self.peer: dict[socket.socket, socket.socket] = {}
        for a, b in pairs:
            sa, sb = netns.packet_socket(ns, a), netns.packet_socket(ns, b)
            sa.setblocking(True)  # select says when to read; a send may wait for the link
            sb.setblocking(True)
            self.peer[sa], self.peer[sb] = sb, sa
        self.forwarded = 0
        self.reordered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        queue: list[tuple[float, int, socket.socket, bytes]] = []
        seq = 0
        last_sent_seq: dict[socket.socket, int] = {}
        socks = list(self.peer)
        while not self._stop.is_set():
            timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.05
            ready, _, _ = select.select(socks, [], [], timeout)
            now = time.monotonic()
            for s in ready:
                data, addr = s.recvfrom(65535)
                if addr[2] == netns.PACKET_OUTGOING:
                    continue
                heapq.heappush(queue, (now + self.rng.random() * self.jitter, seq, self.peer[s], data))
                seq += 1
            while queue and queue[0][0] <= time.monotonic():
                _, n, out, data = heapq.heappop(queue)
                if n < last_sent_seq.get(out, -1):
                    self.reordered += 1
                last_sent_seq[out] = max(n, last_sent_seq.get(out, -1))
                out.send(data)
                self.forwarded += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.peer:
            s.close()
