"""Where the switch is and how a process group uses it: from ``SWITCHAGG_*`` variables or ``pg_options``.

Under ``torchrun`` every rank sees the same environment, so the switch's address goes there once;
the rest of a job (the workers' addresses, the job id, the slots, the key) the ranks work out
together through torch's store (:mod:`switchagg.distributed.rendezvous`). A program that prefers to
say it in code passes ``pg_options=switchagg.distributed.Options(...)`` to ``init_process_group``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ..config import LOSS_RECOVERY, Endpoint, JobConfig
from ..errors import ConfigError
from ..wire import MAX_VALUES_PER_PACKET, P4_VALUES_PER_PACKET, default_slot_count

ALL_GATHER = ("delegate", "switch")  # where all_gather_into_tensor runs: the fallback group, or the switch

# Each option's environment variable; parsed by the type of the field's default.
ENV = {
    "switch": "SWITCHAGG_SWITCH",
    "control": "SWITCHAGG_CONTROL",
    "target": "SWITCHAGG_TARGET",
    "config": "SWITCHAGG_CONFIG",
    "values_per_packet": "SWITCHAGG_VALUES_PER_PACKET",
    "slot_count": "SWITCHAGG_SLOTS",
    "job_id": "SWITCHAGG_JOB",
    "slot_base": "SWITCHAGG_SLOT_BASE",
    "loss_recovery": "SWITCHAGG_LOSS_RECOVERY",
    "device_id": "SWITCHAGG_DEVICE_ID",
    "mac": "SWITCHAGG_MAC",
    "switch_port": "SWITCHAGG_SWITCH_PORT",
    "start_timeout": "SWITCHAGG_START_TIMEOUT",
    "stall_timeout": "SWITCHAGG_STALL_TIMEOUT",
    "all_gather": "SWITCHAGG_ALL_GATHER",
    "node": "SWITCHAGG_NODE",
    "lease": "SWITCHAGG_LEASE",
    "root": "SWITCHAGG_ROOT",
    "root_control": "SWITCHAGG_ROOT_CONTROL",
    "root_mac": "SWITCHAGG_ROOT_MAC",
    "switch_mac": "SWITCHAGG_SWITCH_MAC",
    "uplink_port": "SWITCHAGG_UPLINK_PORT",
    "spine_port": "SWITCHAGG_SPINE_PORT",
}
_INTS = {"values_per_packet", "slot_count", "job_id", "slot_base", "device_id", "switch_port", "uplink_port",
         "spine_port"}
_FLOATS = {"start_timeout", "stall_timeout", "lease"}


@dataclass(frozen=True)
class Options:
    """How a ``switchagg`` process group reaches its switch.

    ``switch`` is the switch's UDP address, ``control`` its control plane (the embedded switch's
    control port; BMv2's P4Runtime or Tofino's BfRt address, each with its default), ``target`` which
    kind of switch it is. ``config`` names a job file instead, for those who keep one: its switch,
    job and workers are used as they are (rank i is worker i). The job's id and slots are picked
    from what the switch has free unless given. ``mac`` and ``switch_port`` are this rank's, for the
    P4 targets' tables. ``all_gather``:
    ``"delegate"`` (the fallback group, the faster here: see the README) or ``"switch"``.

    ``node`` names the machine this rank runs on (:mod:`.topology`; by default torchrun's
    ``GROUP_RANK``, else the host name): where a group's ranks share nodes, each node reduces
    locally first and each local rank's *rail* is a switch job of its own, one worker per node.
    ``switch`` and ``control`` may list one address per rail, comma-separated (a node with a NIC per
    rail); rail ``r`` takes the ``r % len``-th.

    ``lease`` (seconds; 0: none) is how long the switch keeps the group's jobs once nobody renews them:
    rank 0 renews them while the group lives, so a program killed before it destroys its groups
    (SIGKILL, SIGTERM, no atexit) leaves its jobs on the switch for about that long, not for ever. A
    target that keeps no leases (the P4 ones) gets none: its jobs stay until removed.

    ``root`` (with ``root_control``) is the spine of a tree (``docs/protocol.md`` section 10): where the
    ranks of a job reach different switches (``switch`` set per node, each its rack's leaf), rank 0
    deploys the job on every leaf and on the spine, which sums the leaves; one address, or one per rail.
    The ranks under one leaf must be consecutive in the job (as torchrun numbers a node's ranks). On a P4
    switch the links between the levels need what the P4 program writes into packets: ``root_mac``, the
    spine's Ethernet address, and per node its leaf's (``switch_mac``), the leaf's port towards the spine
    (``uplink_port``) and the spine's port towards the leaf (``spine_port``).
    """

    switch: str | None = None
    control: str | None = None
    target: str = "soft"
    config: str | None = None
    values_per_packet: int = P4_VALUES_PER_PACKET
    slot_count: int | None = None
    job_id: int | None = None
    slot_base: int | None = None
    loss_recovery: str = "auto"
    device_id: int | None = None
    mac: str | None = None
    switch_port: int | None = None
    start_timeout: float = 60.0
    stall_timeout: float = 5.0
    all_gather: str = "delegate"
    node: str | None = None
    lease: float = 10.0
    root: str | None = None
    root_control: str | None = None
    root_mac: str | None = None
    switch_mac: str | None = None
    uplink_port: int | None = None
    spine_port: int | None = None

    def __post_init__(self) -> None:
        if self.switch is None and self.config is None:
            raise ConfigError("the switchagg backend needs to know where the switch is: set SWITCHAGG_SWITCH "
                              "(its UDP address, e.g. 127.0.0.1:16711) and, for the embedded switch, "
                              "SWITCHAGG_CONTROL (its control port), or SWITCHAGG_CONFIG (a job file)")
        for name in ("switch", "control"):
            given = getattr(self, name)
            if given is not None and not all(_split(given)):
                raise ConfigError(f"{ENV[name]} = {given!r}: give an address, or one per rail separated by commas")
        for address in _split(self.switch):
            Endpoint.parse(address, ENV["switch"])
        for name in ("root", "root_control"):
            for address in _split(getattr(self, name)):
                Endpoint.parse(address, ENV[name])
        if self.control is not None and len(_split(self.control)) not in (1, len(_split(self.switch))):
            raise ConfigError(f"{ENV['control']} lists {len(_split(self.control))} addresses and {ENV['switch']} "
                              f"{len(_split(self.switch))}: give one control address, or one per switch")
        if not 1 <= self.values_per_packet <= MAX_VALUES_PER_PACKET:
            raise ConfigError(f"{ENV['values_per_packet']} = {self.values_per_packet}: use 1..{MAX_VALUES_PER_PACKET}"
                              f" ({P4_VALUES_PER_PACKET} is what a P4 switch sums)")
        if self.loss_recovery not in LOSS_RECOVERY:
            raise ConfigError(f"{ENV['loss_recovery']} = {self.loss_recovery!r}: use one of {', '.join(LOSS_RECOVERY)}")
        if self.all_gather not in ALL_GATHER:
            raise ConfigError(f"{ENV['all_gather']} = {self.all_gather!r}: use one of {', '.join(ALL_GATHER)}")
        if self.start_timeout <= 0 or self.stall_timeout <= 0:
            raise ConfigError(f"{ENV['start_timeout']} and {ENV['stall_timeout']} are seconds, more than 0")
        if not 0 <= self.lease < float("inf"):
            raise ConfigError(f"{ENV['lease']} = {self.lease}: give the seconds a job outlives its group's last "
                              "renewal, more than 0 (0: no lease, the job stays until removed)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Options:
        """The options the ``SWITCHAGG_*`` variables give (:data:`ENV`); unset ones keep their defaults."""
        given: dict[str, Any] = {}
        for f in fields(cls):
            text = environ.get(ENV[f.name])
            if text is None or text == "":
                continue
            try:
                given[f.name] = int(text, 0) if f.name in _INTS else float(text) if f.name in _FLOATS else text
            except ValueError:
                kind = "an integer" if f.name in _INTS else "a number of seconds"
                raise ConfigError(f"{ENV[f.name]} = {text!r}: give {kind}") from None
        return cls(**given)

    def job_file(self) -> JobConfig | None:
        """The job file's config, where ``config`` names one."""
        return JobConfig.from_file(self.config) if self.config else None

    def rail(self, rail: int) -> Options:
        """These options for rail ``rail``'s job: its own switch and control address where several are listed."""
        switches, controls = _split(self.switch), _split(self.control)
        roots, root_controls = _split(self.root), _split(self.root_control)
        return replace(self, switch=switches[rail % len(switches)] if switches else None,
                       control=controls[rail % len(controls)] if controls else None,
                       root=roots[rail % len(roots)] if roots else None,
                       root_control=root_controls[rail % len(root_controls)] if root_controls else None)

    @property
    def slots(self) -> int:
        """The job's slot count: as given, else the default for its K."""
        return self.slot_count or default_slot_count(self.values_per_packet)


def _split(addresses: str | None) -> list[str]:
    """A comma-separated list of addresses (one per rail), each stripped; [] for None."""
    return [] if addresses is None else [a.strip() for a in addresses.split(",")]
