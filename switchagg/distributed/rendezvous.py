"""How a process group's ranks become a job on the switch, through torch's store alone.

Every rank binds its UDP port and publishes its address; rank 0 picks a free job id and slot
range on the target (or takes those it was given), draws a key, deploys the job through the
target's control plane and publishes it; every rank then builds its client and joins a fresh
session (:mod:`switchagg.session`), so no earlier run's sums can reach this one. Each step ends
with every rank knowing whether every other rank got through it: a failure anywhere is an error
on every rank, saying where and why, and never a rank left waiting.

Rank 0 deploys each job with a lease (``SWITCHAGG_LEASE``) and renews it from a thread of its own
(:class:`Renewal`) until the group is shut down, so the jobs of a program killed before it destroyed
its groups lapse on the switch instead of filling it.

The keys live under the group's own prefix of the store, in a *round* of their own, so a program
that creates its group again on the same store (torchrun's lives as long as the job) starts clean.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import tomllib
import warnings
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from ..client import Client
from ..config import Endpoint, JobConfig, WorkerSpec
from ..errors import ConfigError, JobNotStarted, NoRoom, SwitchAggError
from ..jobs import MIN_SHARED_SLOTS, fit_jobs
from ..targets import Target, TargetOptions, open_target
from ..targets.base import UnsupportedOperation
from ..tree import LeafSpec, TreeConfig
from .topology import Layout, node_identity

_ROOT = "switchagg"
_PICK_TRIES = 8  # fresh picks of a job id and slots when another group took them between status and deploy
_CLOSE_WAIT = timedelta(seconds=10)  # how long rank 0 waits for its peers to close before it undeploys
RENEWALS_PER_LEASE = 3  # renewals within one lease: two may be lost or late before the job lapses


class Renewal:
    """Rank 0's renewals of its group's jobs' leases: a daemon thread renews each job every
    ``lease / RENEWALS_PER_LEASE`` seconds until :meth:`stop` (the group's shutdown). A job whose target keeps
    no leases (it was deployed without one) is dropped from the round; a renewal that fails is said once per
    job, and tried again at the next round (a control port busy for a moment must not cost the job)."""

    def __init__(self, jobs: list[tuple[Target, int]], lease: float) -> None:
        self._jobs = list(jobs)
        self._interval = lease / RENEWALS_PER_LEASE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchagg-renew", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warned: set[int] = set()
        while not self._stop.wait(self._interval):
            for target, job_id in list(self._jobs):
                try:
                    target.renew(job_id)
                except UnsupportedOperation:
                    self._jobs.remove((target, job_id))  # deployed without a lease: nothing lapses there
                except Exception as exc:  # noqa: BLE001 - any fault: said, and tried again next round
                    if job_id not in warned:
                        warned.add(job_id)
                        warnings.warn(f"switchagg: job {job_id}'s lease could not be renewed ({exc}); once it "
                                      "lapses the switch removes the job and this group's sums through it fail",
                                      stacklevel=1)

    def stop(self) -> None:
        """Renew no more (the jobs are about to be removed, or the group failed to start)."""
        self._stop.set()
        self._thread.join()


@dataclass
class Formed:
    """A rank's part of a group's jobs: its client in its job, and on rank 0 the targets it undeploys from.

    ``client`` is None where the group runs without the switch (``fallback`` says why: one rank, or
    no room on the switch), and every call goes to the fallback backend.
    """

    layout: Layout
    config: JobConfig | None
    client: Client | None
    deployed: list[tuple[Target, int]]
    prefix: str
    fallback: str = ""
    renewal: Renewal | None = None  # rank 0's, while its jobs hold leases


def form(store: dist.Store, rank: int, size: int, options: Any, timeout: timedelta) -> Formed:
    """Deploy this group's jobs and start every rank's client in a fresh session; raises on every rank
    if any rank fails (``options`` is a :class:`~switchagg.distributed.options.Options`)."""
    prefix = f"{_ROOT}/{(store.add(f'{_ROOT}/arrivals', 1) - 1) // size}/"
    file_config = options.job_file()
    if size == 1 and file_config is None:
        return Formed(Layout.flat(1), None, None, [], prefix, "a group of one rank has nothing to sum")
    layout = Layout.flat(size) if file_config is not None else _layout(store, prefix, rank, size, options, timeout)
    job, worker_index = layout.place(rank)
    reservation, worker, problem = None, None, ""
    try:
        if file_config is not None:
            _check_file(file_config, size)
            worker = file_config.workers[rank]
        else:
            reservation, worker = _bind(options.rail(job))
    except (SwitchAggError, OSError) as exc:
        problem = str(exc)
    mine = options.rail(job)  # the switch this rank reaches: its leaf, where a job's ranks reach several
    store.set(f"{prefix}worker/{rank}", json.dumps({"error": problem} if problem else
                                                   {**_worker_json(worker), "switch": mine.switch,
                                                    "control": mine.control, "link": _link_json(mine)}))
    deployed: list[tuple[Target, int]] = []
    renewal = None
    if rank == 0:
        deployed, text = _deploy(store, prefix, layout, options, file_config, timeout)
        if deployed and options.lease:
            renewal = Renewal(deployed, options.lease)
        store.set(f"{prefix}jobs", text)
    reply = json.loads(_get(store, f"{prefix}jobs", timeout, "rank 0's jobs"))
    if "error" in reply or "fallback" in reply:
        if reservation is not None:
            reservation.close()
        if "error" in reply:
            raise SwitchAggError(f"switchagg cannot start this process group: {reply['error']}")
        warnings.warn(f"switchagg: this process group of {size} ranks sums through its fallback backend, not the "
                      f"switch: {reply['fallback']}", stacklevel=2)
        return Formed(layout, None, None, [], prefix, reply["fallback"])
    entry = reply["jobs"][job]
    if isinstance(entry, dict):  # a tree: this rank's leaf's job, and its index there
        leaf, worker_index = entry["place"][str(rank)]
        entry = entry["leaves"][leaf]
    config = JobConfig.from_dict(tomllib.loads(entry))
    client = None
    try:
        if reservation is not None:
            reservation.close()  # the client binds the same address next
        client = Client(config, worker_index, start_timeout=options.start_timeout,
                        stall_timeout=options.stall_timeout)
        problem = ""
    except (SwitchAggError, OSError) as exc:
        problem = f"rank {rank}: {exc}"
    formed = Formed(layout, config, client, deployed, prefix, renewal=renewal)
    _agree(store, formed, rank, size, "ready", problem, timeout)
    try:
        client.join(options.start_timeout)  # type: ignore[union-attr]
        problem = ""
    except (SwitchAggError, OSError) as exc:
        problem = f"rank {rank}: {exc}"
    _agree(store, formed, rank, size, "joined", problem, timeout)
    return formed


def _layout(store: dist.Store, prefix: str, rank: int, size: int, options: Any, timeout: timedelta) -> Layout:
    """Every rank names its node; rank 0 lays the group out (:mod:`.topology`) and every rank reads it."""
    store.set(f"{prefix}node/{rank}", node_identity(options.node))
    if rank == 0:
        names = [_get(store, f"{prefix}node/{r}", timeout, f"rank {r}'s node").decode() for r in range(size)]
        try:
            text = json.dumps({"layout": Layout.of(names).to_json()})
        except ConfigError as exc:
            text = json.dumps({"error": str(exc)})
        store.set(f"{prefix}layout", text)
    reply = json.loads(_get(store, f"{prefix}layout", timeout, "rank 0's layout of the group"))
    if "error" in reply:
        raise ConfigError(f"switchagg cannot start this process group: {reply['error']}")
    return Layout.from_json(reply["layout"])


def finish(store: dist.Store, rank: int, size: int, formed: Formed) -> None:
    """Close this rank's client; rank 0 removes the jobs once its peers have closed theirs (or soon after)."""
    if formed.client is None:
        return
    formed.client.close()
    with suppress(RuntimeError):  # the store went first (its host rank exited): the jobs are removed all the same
        store.set(f"{formed.prefix}closed/{rank}", "")
    if not formed.deployed:
        return
    with suppress(RuntimeError):  # a peer that did not close in time: its packets are dropped once the job is gone
        store.wait([f"{formed.prefix}closed/{r}" for r in range(size)], _CLOSE_WAIT)
    _stop_renewing(formed)  # only now: a lease lapsing while the peers close would make the undeploy below fail
    deployed, formed.deployed = formed.deployed, []
    for target, job_id in deployed:
        try:
            target.undeploy(job_id)
        except (SwitchAggError, OSError) as exc:
            warnings.warn(f"switchagg: job {job_id} could not be removed from the switch ({exc}); "
                          "remove it with `switchagg undeploy`", stacklevel=2)


def _agree(store: dist.Store, formed: Formed, rank: int, size: int, step: str, problem: str,
           timeout: timedelta) -> None:
    """Publish this rank's outcome of ``step`` and read every rank's; all raise if any failed."""
    store.set(f"{formed.prefix}{step}/{rank}", problem)
    problems = [_get(store, f"{formed.prefix}{step}/{r}", timeout, f"rank {r}'s start").decode()
                for r in range(size)]
    failed = [p for p in problems if p]
    if failed:
        if formed.client is not None:
            formed.client.close()
        _stop_renewing(formed)
        for target, job_id in formed.deployed:
            with suppress(SwitchAggError, OSError):  # the error below says what went wrong first
                target.undeploy(job_id)
        raise SwitchAggError("switchagg cannot start this process group, so no rank uses it: " + "; ".join(failed))


def _stop_renewing(formed: Formed) -> None:
    if formed.renewal is not None:
        formed.renewal.stop()
        formed.renewal = None


def _get(store: dist.Store, key: str, timeout: timedelta, what: str) -> bytes:
    try:
        store.wait([key], timeout)
    except RuntimeError:
        raise JobNotStarted(f"{what} did not arrive through torch's store within {timeout}: is every rank "
                            "running, and did rank 0 reach the switch's control plane?") from None
    return store.get(key)


def _bind(options: Any) -> tuple[socket.socket, WorkerSpec]:
    """A UDP port on the address this host reaches the switch from, held until the client binds it."""
    switch = Endpoint.parse(options.switch, "SWITCHAGG_SWITCH")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(switch.tuple)  # no packet: it only picks the route, and with it the source address
        host = probe.getsockname()[0]
    except OSError as exc:
        raise OSError(exc.errno, f"no route to the switch at {switch}: {exc.strerror}") from None
    finally:
        probe.close()
    reservation = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    reservation.bind((host, 0))
    address = Endpoint(host, reservation.getsockname()[1])
    return reservation, WorkerSpec(address, options.mac, options.switch_port)


def _worker_json(worker: WorkerSpec) -> dict[str, Any]:
    return {"address": str(worker.address), "mac": worker.mac, "switch_port": worker.switch_port}


def _link_json(options: Any) -> dict[str, Any]:
    """This rank's leaf's link to a tree's spine, for a P4 switch: the leaf's Ethernet address and both ports."""
    return {"mac": options.switch_mac, "uplink_port": options.uplink_port, "spine_port": options.spine_port}


def _check_file(config: JobConfig, size: int) -> None:
    if config.n_workers != size:
        raise ConfigError(f"the job file lists {config.n_workers} workers but the process group has {size} ranks: "
                          "make them match")


def _deploy(store: dist.Store, prefix: str, layout: Layout, options: Any, file_config: JobConfig | None,
            timeout: timedelta) -> tuple[list[tuple[Target, int]], str]:
    """Rank 0: the group's jobs, deployed; returns them and their configs as JSON (or an error, or the
    reason the group sums through its fallback instead)."""
    size = sum(map(len, layout.nodes))
    workers = [json.loads(_get(store, f"{prefix}worker/{r}", timeout, f"rank {r}'s address")) for r in range(size)]
    failed = [f"rank {r}: {w['error']}" for r, w in enumerate(workers) if "error" in w]
    if failed:
        return [], json.dumps({"error": "; ".join(failed)})
    try:
        if file_config is not None:
            target, config = _install(options, replace(file_config, key=secrets.randbits(32), generation=None))
            return [(target, config.job_id)], json.dumps({"jobs": [config.to_toml()]})
        rails = [options.rail(j) for j in range(len(layout.jobs))]
        jobs = [_job(rails[j], [workers[r] for r in members]) for j, members in enumerate(layout.jobs)]
        leaves = [_leaves(rails[j], [workers[r] for r in members]) for j, members in enumerate(layout.jobs)]
        flat = [j for j in range(len(jobs)) if leaves[j] is None]
        placed = dict(zip(flat, _place_and_install([rails[j] for j in flat], [jobs[j] for j in flat]), strict=True))
        deployed = [(t, c.job_id) for t, c in placed.values()]
        entries: dict[int, Any] = {j: c.to_toml() for j, (_, c) in placed.items()}
        try:
            for j in (j for j in range(len(jobs)) if leaves[j] is not None):
                levels, entries[j] = _install_tree(rails[j], jobs[j], leaves[j], layout.jobs[j])
                deployed += levels
        except BaseException:
            _undeploy_quietly(deployed)
            raise
    except NoRoom as exc:
        return [], json.dumps({"fallback": str(exc)})
    except (SwitchAggError, OSError) as exc:
        where = f"the {options.target} switch" if len(layout.jobs) == 1 else f"the {options.target} switches"
        return [], json.dumps({"error": f"rank 0 could not deploy the job on {where}: {exc}"})
    return deployed, json.dumps({"jobs": [entries[j] for j in range(len(jobs))]})


class Leaf(NamedTuple):
    """A leaf of a tree as its ranks name it: its switch and control, the indices of its workers in the job, and
    its link to the spine (:func:`_link_json`, the first of its ranks')."""

    switch: str
    control: str | None
    indices: list[int]
    link: dict[str, Any]


def _leaves(options: Any, workers: list[dict[str, Any]]) -> list[Leaf] | None:
    """Where a job's workers reach different switches (each rank's ``SWITCHAGG_SWITCH``): each switch, its control
    and the indices of its workers, in order: the leaves of a tree under ``options.root``. None where they all
    reach one switch (a flat job). Raises where no root is given, or a leaf's workers are not consecutive."""
    leaves: list[Leaf] = []
    for i, w in enumerate(workers):
        if leaves and leaves[-1].switch == w["switch"]:
            leaves[-1].indices.append(i)
        elif any(leaf.switch == w["switch"] for leaf in leaves):
            raise ConfigError(f"the ranks that reach the switch at {w['switch']} are not consecutive in the job: a "
                              "tree's leaves hold consecutive ranks (give each node's ranks consecutive numbers, "
                              "as torchrun does, and put each rack's nodes next to each other)")
        else:
            leaves.append(Leaf(w["switch"], w["control"], [i], w.get("link") or {}))
    if len(leaves) == 1:
        return None
    if options.root is None:
        raise ConfigError(f"this job's ranks reach {len(leaves)} switches ({', '.join(leaf[0] for leaf in leaves)}): "
                          "set SWITCHAGG_ROOT (and SWITCHAGG_ROOT_CONTROL) to the spine switch that sums them, or "
                          "give every rank the same SWITCHAGG_SWITCH")
    return leaves


def _install_tree(options: Any, job: JobConfig, leaves: list[Leaf],
                  members: tuple[int, ...]) -> tuple[list[tuple[Target, int]], dict[str, Any]]:
    """Deploy ``job`` as a tree: the spine at ``options.root``, a leaf at each of ``leaves``, one job id and
    slot range free on all of them, every level under the spine's generation. Returns each level's target and
    job id, and what every rank of ``members`` needs: each leaf's job, and which leaf and index is whose."""
    links = [options.root_mac, *(leaf.link.get(k) for leaf in leaves for k in ("mac", "uplink_port", "spine_port"))]
    if options.target != "soft" and None in links:
        raise ConfigError(f"a tree on {options.target} switches needs the links' Ethernet addresses and ports, which "
                          "its P4 program writes into packets: set SWITCHAGG_ROOT_MAC (the spine's), and on every "
                          "node SWITCHAGG_SWITCH_MAC (its leaf's), SWITCHAGG_UPLINK_PORT (the leaf's port towards the "
                          "spine) and SWITCHAGG_SPINE_PORT (the spine's port towards the leaf)")
    spec = TreeConfig(job.job_id, job.key, 0, job.slot_count, job.values_per_packet,
                      Endpoint.parse(options.root, "SWITCHAGG_ROOT"),
                      Endpoint.parse(options.root_control, "SWITCHAGG_ROOT_CONTROL") if options.root_control else None,
                      tuple(LeafSpec(Endpoint.parse(leaf.switch, "SWITCHAGG_SWITCH"),
                                     Endpoint.parse(leaf.control, "SWITCHAGG_CONTROL") if leaf.control else None,
                                     tuple(job.workers[i] for i in leaf.indices), leaf.link.get("mac"),
                                     leaf.link.get("uplink_port"), leaf.link.get("spine_port"))
                            for leaf in leaves), job.loss_recovery, options.root_mac)
    for _ in range(_PICK_TRIES):
        keyed = replace(spec, key=secrets.randbits(32))
        place = _free_on_every_level([_level(options, c) for c in keyed.switch_jobs()], options, job.slot_count,
                                     job.least_slots)
        tree = replace(keyed, **place)
        done: list[tuple[Target, int]] = []
        try:
            generation = None
            for config in tree.switch_jobs():  # the spine first; each leaf under the generation it drew
                config = config.with_generation(generation)
                target = _level(options, config)
                drawn = _deploy_leased(target, config, options)
                generation = generation or drawn
                done.append((target, config.job_id))
        except ConfigError as exc:
            _undeploy_quietly(done)
            if options.job_id is None and ("already installed" in str(exc) or "overlap" in str(exc)):
                continue  # another group took the place between our look and our deploy: look again
            raise
        except BaseException:
            _undeploy_quietly(done)
            raise
        place_of = {str(members[i]): [n, local] for n, leaf in enumerate(leaves)
                    for local, i in enumerate(leaf.indices)}
        return done, {"leaves": [c.to_toml() for c in tree.switch_jobs(generation)[1:]], "place": place_of}
    raise SwitchAggError(f"the switches' jobs kept changing while rank 0 looked for a place free on every level of "
                         f"the tree ({_PICK_TRIES} tries): set SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE")


def _level(options: Any, config: JobConfig) -> Target:
    """The target of one level of a tree: the switch ``config`` names, through its own control address."""
    return _open(replace(options, control=None if config.control is None else str(config.control)), config)


def _free_on_every_level(targets: list[Target], options: Any, wanted: int, least: int) -> dict[str, int]:
    """A job id and slot range free on every one of ``targets`` (a tree's levels hold the job at the same slots),
    or those the options give: :func:`_free_places` over the union of what the levels hold."""
    if options.job_id is not None and options.slot_base is not None:
        return {"job_id": options.job_id, "slot_base": options.slot_base}
    installed: dict[int, tuple[int, int]] = {}
    ids: set[int] = set()
    pools = []
    try:
        for target in targets:
            jobs = target.jobs()
            num_slots, max_jobs = target.capacity()
            if max_jobs is not None and len(jobs) >= max_jobs:
                raise NoRoom(f"a switch of the tree runs {len(jobs)} jobs, all its table holds: undeploy one there")
            ids |= set(jobs)
            installed |= {len(installed) + i: place for i, place in enumerate(jobs.values())}
            pools.append(num_slots)
    except UnsupportedOperation as exc:
        raise ConfigError(f"{exc}: give the job's place yourself with SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE") from None
    job_id = options.job_id
    while job_id is None or job_id in ids:
        job_id = 1 + secrets.randbelow(0xFFFF)
    if options.slot_base is not None:
        return {"job_id": job_id, "slot_base": options.slot_base}
    fit = fit_jobs(installed, min(pools), 1, wanted, None, shrink=options.slot_count is None, least=least)
    if fit is None:
        raise NoRoom(f"no slot range of {wanted} (or, shared, of {MIN_SHARED_SLOTS}) is free on every switch of the "
                     "tree: remove jobs nobody uses there (`switchagg status`)")
    size, (base,) = fit
    return {"job_id": job_id, "slot_base": base, "slot_count": size}


def _undeploy_quietly(deployed: list[tuple[Target, int]]) -> None:
    """Remove what a failed deploy installed; the failure itself says what went wrong."""
    for target, job_id in deployed:
        with suppress(SwitchAggError, OSError):
            target.undeploy(job_id)


def _job(options: Any, workers: list[dict[str, Any]]) -> JobConfig:
    """A job of these workers on ``options``' switch, its id, slots and key still to be picked."""
    return JobConfig(
        switch=Endpoint.parse(options.switch, "SWITCHAGG_SWITCH"), job_id=1, key=1, slot_base=0,
        slot_count=options.slots, values_per_packet=options.values_per_packet,
        workers=tuple(WorkerSpec(Endpoint.parse(w["address"], "a worker's address"), w["mac"], w["switch_port"])
                      for w in workers),
        loss_recovery=options.loss_recovery,
        control=Endpoint.parse(options.control, "SWITCHAGG_CONTROL") if options.control else None)


def _install(options: Any, config: JobConfig) -> tuple[Target, JobConfig]:
    """Deploy ``config`` as it is (a job file's)."""
    target = _open(options, config)
    _deploy_leased(target, config, options)
    return target, config


def _deploy_leased(target: Target, config: JobConfig, options: Any) -> int:
    """Deploy ``config`` with the options' lease, or without one where the target keeps none (the P4 targets:
    the job then stays until the group removes it, as it did before leases); returns its generation."""
    if not options.lease:
        return target.deploy(config)
    try:
        return target.deploy(config, lease=options.lease)
    except UnsupportedOperation:  # refused before the target changed anything
        return target.deploy(config)


def _open(options: Any, config: JobConfig) -> Target:
    return open_target(options.target, TargetOptions(config=config, address=options.control,
                                                     device_id=options.device_id))


def _place_and_install(rails: list[Any], jobs: list[JobConfig]) -> list[tuple[Target, JobConfig]]:
    """Deploy ``jobs`` (job ``j`` on rail ``j``'s switch), each switch's share on ids and slots it has free;
    all of them or none."""
    by_switch: dict[tuple[str | None, str | None], list[int]] = {}
    for j, rail in enumerate(rails):
        by_switch.setdefault((rail.switch, rail.control), []).append(j)
    placed: dict[int, tuple[Target, JobConfig]] = {}
    try:
        for indices in by_switch.values():
            pairs = _install_on_one_switch(rails[indices[0]], [jobs[j] for j in indices])
            placed.update(zip(indices, pairs, strict=True))
    except BaseException:
        for target, config in placed.values():
            with suppress(SwitchAggError, OSError):
                target.undeploy(config.job_id)
        raise
    return [placed[j] for j in range(len(jobs))]


def _install_on_one_switch(options: Any, jobs: list[JobConfig]) -> list[tuple[Target, JobConfig]]:
    """Deploy ``jobs`` on one switch, each on a free id and slots (or those the options give)."""
    for _ in range(_PICK_TRIES):
        keyed = [replace(job, key=secrets.randbits(32), generation=None) for job in jobs]
        probe = _open(options, keyed[0])
        placed = [replace(job, **place) for job, place in zip(keyed, _free_places(probe, options, keyed), strict=True)]
        done: list[tuple[Target, JobConfig]] = []
        try:
            for config in placed:
                target = _open(options, config)
                _deploy_leased(target, config, options)
                done.append((target, config))
        except ConfigError as exc:
            for target, config in done:
                with suppress(SwitchAggError, OSError):
                    target.undeploy(config.job_id)
            if options.job_id is None and ("already installed" in str(exc) or "overlap" in str(exc)):
                continue  # another group took the place between our look and our deploy: look again
            raise
        return done
    raise SwitchAggError(f"the switch's jobs kept changing while rank 0 looked for a free place ({_PICK_TRIES} "
                         "tries): set SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE")


def _free_places(target: Target, options: Any, jobs: list[JobConfig]) -> list[dict[str, int]]:
    """Job ids and slot ranges nobody uses on ``target`` for ``jobs``, or those the options give.

    The slots are sized to share the pool (:func:`switchagg.jobs.fit_jobs`) unless
    ``SWITCHAGG_SLOTS`` names a count; with no room the group falls back (:class:`NoRoom`).
    """
    count = len(jobs)
    if options.job_id is not None and options.slot_base is not None:
        return [{"job_id": options.job_id + j, "slot_base": options.slot_base + j * jobs[j].slot_count}
                for j in range(count)]
    try:
        installed = target.jobs()
        num_slots, max_jobs = target.capacity()
    except UnsupportedOperation as exc:
        raise ConfigError(f"{exc}: give the job's place yourself with SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE") from None
    ids: list[int] = []
    for j in range(count):
        job_id = None if options.job_id is None else options.job_id + j
        while job_id is None or job_id in installed or job_id in ids:
            job_id = 1 + secrets.randbelow(0xFFFF)
        ids.append(job_id)
    wanted = jobs[0].slot_count
    if options.slot_base is not None:
        return [{"job_id": ids[j], "slot_base": options.slot_base + j * wanted} for j in range(count)]
    fit = fit_jobs(installed, num_slots, count, wanted, max_jobs, shrink=options.slot_count is None,
                   least=max(job.least_slots for job in jobs))
    free = num_slots - sum(n for _, n in installed.values())
    what = f"{count} jobs" if count > 1 else "a job"
    if fit is None and options.slot_count is not None:
        raise ConfigError(f"no room for {what} of {wanted} slots (SWITCHAGG_SLOTS): the switch has {num_slots} slots, "
                          f"{free} of them free, in {len(installed)} jobs: ask for fewer, or leave SWITCHAGG_SLOTS "
                          "unset and the job takes what is free")
    if fit is None:
        raise NoRoom(f"the switch is full ({len(installed)} jobs, {free} of its {num_slots} slots free): not even "
                     f"{what} of {MIN_SHARED_SLOTS} slots fits; remove jobs nobody uses (`switchagg status`) "
                     "or destroy groups you no longer need")
    size, bases = fit
    return [{"job_id": ids[j], "slot_base": bases[j], "slot_count": size} for j in range(count)]
