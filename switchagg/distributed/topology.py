"""Which ranks of a group share a node, and the switch jobs the group runs: one, or one per rail.

A node's ranks (one per GPU) reach the network through the same NICs, so summing them in the
network sends each of their bytes across the NIC although a neighbour holds the same shard. NCCL's
CollNet, and FSDP's HYBRID_SHARD, reduce inside the node first: the node's ranks reduce-scatter, so
that local rank ``r`` holds the node's partial sums of shard ``r``; local rank ``r`` of every node
then sums its shard through the network in *rail* ``r``, a job of its own with one worker per node;
and the node all-gathers the result. So a job counts nodes, not ranks: 32 nodes of any width fit one
switch's 32-worker bitmap, and the codec's headroom counts nodes.

A group whose ranks are each on a node of their own, or all on one node, is today's flat job: every
rank a worker. Nodes of different widths cannot split a tensor into the same rails, so such a group
is flat too, which holds at most :data:`~switchagg.wire.MAX_WORKERS` ranks.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..wire import MAX_WORKERS


def node_identity(node: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The name of the node this process runs on: ``node`` (``SWITCHAGG_NODE``) where given, else
    torchrun's ``GROUP_RANK`` (the rank of this process's node in the job), else the host name."""
    if node:
        return node
    group_rank = environ.get("GROUP_RANK")
    if group_rank:
        return f"torchrun node {group_rank}"
    return socket.gethostname()


@dataclass(frozen=True)
class Layout:
    """A group's nodes (each a tuple of group ranks, in rank order) and the switch jobs it runs.

    ``jobs[j]`` lists the group ranks that are job ``j``'s workers, in worker order: all ranks for a
    flat group; for a hierarchical one, rail ``j``: local rank ``j`` of every node, in node order.
    """

    nodes: tuple[tuple[int, ...], ...]
    jobs: tuple[tuple[int, ...], ...]

    @property
    def hierarchical(self) -> bool:
        """Whether nodes reduce locally first (a rail a job); a flat layout has one job of every rank."""
        return len(self.jobs) > 1

    def place(self, rank: int) -> tuple[int, int]:
        """``(job, worker)``: which job ``rank`` is a worker of, and its index there."""
        for j, members in enumerate(self.jobs):
            if rank in members:
                return j, members.index(rank)
        raise ValueError(f"rank {rank} is in no job of this layout")

    def node_of(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s node (``rank`` among them)."""
        return next(n for n in self.nodes if rank in n)

    def to_json(self) -> dict[str, list[list[int]]]:
        return {"nodes": [list(n) for n in self.nodes], "jobs": [list(j) for j in self.jobs]}

    @classmethod
    def from_json(cls, obj: Mapping[str, list[list[int]]]) -> Layout:
        return cls(tuple(tuple(n) for n in obj["nodes"]), tuple(tuple(j) for j in obj["jobs"]))

    @classmethod
    def flat(cls, size: int) -> Layout:
        """Every rank a worker of one job (and, as far as this group knows, a node of its own)."""
        return cls(tuple((r,) for r in range(size)), (tuple(range(size)),))

    @classmethod
    def of(cls, identities: list[str], max_workers: int = MAX_WORKERS) -> Layout:
        """The layout of a group whose rank ``r`` runs on node ``identities[r]``; raises when the
        switch cannot hold it, saying what would."""
        size = len(identities)
        by_node: dict[str, list[int]] = {}
        for rank, name in enumerate(identities):
            by_node.setdefault(name, []).append(rank)
        nodes = tuple(tuple(ranks) for ranks in by_node.values())
        widths = {len(n) for n in nodes}
        if len(nodes) in (1, size) or len(widths) > 1:
            if size > max_workers:
                shape = ("its nodes hold " + ", ".join(str(len(n)) for n in nodes) + " ranks, not the same number"
                         if len(widths) > 1 else "every rank is on a node of its own" if len(nodes) == size
                         else "all its ranks are on one node")
                raise ConfigError(
                    f"this process group has {size} ranks, more than the {max_workers} workers a switch job "
                    f"holds, and {shape}: run it as nodes of equal width (torchrun --nnodes, or SWITCHAGG_NODE "
                    f"naming each rank's node), whose ranks reduce locally first so that a job counts nodes")
            return cls(nodes, (tuple(range(size)),))
        if len(nodes) > max_workers:
            raise ConfigError(f"this process group spans {len(nodes)} nodes, more than the {max_workers} workers "
                              f"a switch job holds (one per node in each rail): use at most {max_workers} nodes "
                              "per group")
        width = widths.pop()
        return cls(nodes, tuple(tuple(n[r] for n in nodes) for r in range(width)))
