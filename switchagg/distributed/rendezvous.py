"""How a process group's ranks become a job on the switch, through torch's store alone.

Every rank binds its UDP port and publishes its address; rank 0 picks a free job id and slot
range on the target (or takes those it was given), draws a key, deploys the job through the
target's control plane and publishes it; every rank then builds its client and joins a fresh
session (:mod:`switchagg.session`), so no earlier run's sums can reach this one. Each step ends
with every rank knowing whether every other rank got through it: a failure anywhere is an error
on every rank, saying where and why, and never a rank left waiting.

The keys live under the group's own prefix of the store, in a *round* of their own, so a program
that creates its group again on the same store (torchrun's lives as long as the job) starts clean.
"""

from __future__ import annotations

import json
import secrets
import socket
import tomllib
import warnings
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..client import Client
from ..config import Endpoint, JobConfig, WorkerSpec
from ..errors import ConfigError, JobNotStarted, SwitchAggError
from ..targets import Target, TargetOptions, open_target
from ..targets.base import UnsupportedOperation

_ROOT = "switchagg"
_PICK_TRIES = 8  # fresh picks of a job id and slots when another group took them between status and deploy
_CLOSE_WAIT = timedelta(seconds=10)  # how long rank 0 waits for its peers to close before it undeploys


@dataclass
class Formed:
    """A rank's part of a deployed job: its client, and on rank 0 the target it undeploys from."""

    config: JobConfig
    client: Client
    target: Target | None
    prefix: str


def form(store: dist.Store, rank: int, size: int, options: Any, timeout: timedelta) -> Formed:
    """Deploy this group's job and start every rank's client in a fresh session; raises on every rank
    if any rank fails (``options`` is a :class:`~switchagg.distributed.options.Options`)."""
    prefix = f"{_ROOT}/{(store.add(f'{_ROOT}/arrivals', 1) - 1) // size}/"
    file_config = options.job_file()
    reservation, worker, problem = None, None, ""
    try:
        if file_config is not None:
            _check_file(file_config, size)
            worker = file_config.workers[rank]
        else:
            reservation, worker = _bind(options)
    except (SwitchAggError, OSError) as exc:
        problem = str(exc)
    store.set(f"{prefix}worker/{rank}", json.dumps({"error": problem} if problem else _worker_json(worker)))
    target = None
    if rank == 0:
        target, text = _deploy(store, prefix, size, options, file_config, timeout)
        store.set(f"{prefix}job", text)
    reply = json.loads(_get(store, f"{prefix}job", timeout, "rank 0's job"))
    if "error" in reply:
        if reservation is not None:
            reservation.close()
        raise SwitchAggError(f"switchagg cannot start this process group: {reply['error']}")
    config = JobConfig.from_dict(tomllib.loads(reply["config"]))
    client = None
    try:
        if reservation is not None:
            reservation.close()  # the client binds the same address next
        client = Client(config, rank, start_timeout=options.start_timeout, stall_timeout=options.stall_timeout)
        problem = ""
    except (SwitchAggError, OSError) as exc:
        problem = f"rank {rank}: {exc}"
    formed = Formed(config, client, target, prefix)  # type: ignore[arg-type]
    _agree(store, formed, rank, size, "ready", problem, timeout)
    try:
        client.join(options.start_timeout)  # type: ignore[union-attr]
        problem = ""
    except (SwitchAggError, OSError) as exc:
        problem = f"rank {rank}: {exc}"
    _agree(store, formed, rank, size, "joined", problem, timeout)
    return formed


def finish(store: dist.Store, rank: int, size: int, formed: Formed) -> None:
    """Close this rank's client; rank 0 removes the job once its peers have closed theirs (or soon after)."""
    formed.client.close()
    with suppress(RuntimeError):  # the store went first (its host rank exited): the job is removed all the same
        store.set(f"{formed.prefix}closed/{rank}", "")
    if formed.target is None:
        return
    with suppress(RuntimeError):  # a peer that did not close in time: its packets are dropped once the job is gone
        store.wait([f"{formed.prefix}closed/{r}" for r in range(size)], _CLOSE_WAIT)
    try:
        formed.target.undeploy(formed.config.job_id)
    except (SwitchAggError, OSError) as exc:
        warnings.warn(f"switchagg: job {formed.config.job_id} could not be removed from the switch ({exc}); "
                      "remove it with `switchagg undeploy`", stacklevel=2)
    formed.target = None


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
        if formed.target is not None:
            with suppress(SwitchAggError, OSError):  # the error below says what went wrong first
                formed.target.undeploy(formed.config.job_id)
        raise SwitchAggError("switchagg cannot start this process group, so no rank uses it: " + "; ".join(failed))


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


def _check_file(config: JobConfig, size: int) -> None:
    if config.n_workers != size:
        raise ConfigError(f"the job file lists {config.n_workers} workers but the process group has {size} ranks: "
                          "make them match")


def _deploy(store: dist.Store, prefix: str, size: int, options: Any, file_config: JobConfig | None,
            timeout: timedelta) -> tuple[Target | None, str]:
    """Rank 0: the job, deployed; returns the target and the job's JSON (or an error, as JSON)."""
    workers = [json.loads(_get(store, f"{prefix}worker/{r}", timeout, f"rank {r}'s address")) for r in range(size)]
    failed = [f"rank {r}: {w['error']}" for r, w in enumerate(workers) if "error" in w]
    if failed:
        return None, json.dumps({"error": "; ".join(failed)})
    try:
        target, config = _install(options, file_config, workers)
    except (SwitchAggError, OSError) as exc:
        return None, json.dumps({"error": f"rank 0 could not deploy the job on the {options.target} switch: {exc}"})
    return target, json.dumps({"config": config.to_toml()})


def _install(options: Any, file_config: JobConfig | None, workers: list[dict[str, Any]]) -> tuple[Target, JobConfig]:
    """Deploy the job: the file's as it is (a fresh key aside), or one built here on a free id and slots."""
    base = file_config or JobConfig(
        switch=Endpoint.parse(options.switch, "SWITCHAGG_SWITCH"), job_id=1, key=1, slot_base=0,
        slot_count=options.slots, values_per_packet=options.values_per_packet,
        workers=tuple(WorkerSpec(Endpoint.parse(w["address"], "a worker's address"), w["mac"], w["switch_port"])
                      for w in workers),
        loss_recovery=options.loss_recovery,
        control=Endpoint.parse(options.control, "SWITCHAGG_CONTROL") if options.control else None)
    for _ in range(_PICK_TRIES):
        config = replace(base, key=secrets.randbits(32), generation=None)
        target = open_target(options.target, TargetOptions(config=config, address=options.control,
                                                           device_id=options.device_id))
        if file_config is None:
            config = replace(config, **_free_place(target, options, config.slot_count))
            target = open_target(options.target, TargetOptions(config=config, address=options.control,
                                                               device_id=options.device_id))
        try:
            target.deploy(config)
        except ConfigError as exc:
            if file_config is None and options.job_id is None and ("already installed" in str(exc)
                                                                   or "overlap" in str(exc)):
                continue  # another group took the place between our look and our deploy: look again
            raise
        return target, config
    raise SwitchAggError(f"the switch's jobs kept changing while rank 0 looked for a free place ({_PICK_TRIES} "
                         "tries): set SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE")


def _free_place(target: Target, options: Any, slot_count: int) -> dict[str, int]:
    """A job id and slot base nobody uses on ``target``, or those the options give."""
    if options.job_id is not None and options.slot_base is not None:
        return {"job_id": options.job_id, "slot_base": options.slot_base}
    try:
        installed = target.jobs()
    except UnsupportedOperation as exc:
        raise ConfigError(f"{exc}: give the job's place yourself with SWITCHAGG_JOB and SWITCHAGG_SLOT_BASE") from None
    job_id = options.job_id
    while job_id is None or job_id in installed:
        job_id = 1 + secrets.randbelow(0xFFFF)
    base = options.slot_base
    if base is None:
        base = 0
        for start, count in sorted(installed.values()):
            if base + slot_count <= start:
                break
            base = max(base, start + count)
    return {"job_id": job_id, "slot_base": base}
