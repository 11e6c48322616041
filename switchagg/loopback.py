"""Jobs on this machine: a loopback config on free ports, a switch process, and worker processes.

The demo, the benchmarks and the tests use these to stand up a whole job with
nothing but Python.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queues
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import Endpoint, JobConfig, WorkerSpec
from .wire import default_slot_count


def free_ports(n: int, kind: int = socket.SOCK_DGRAM, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports the kernel just handed out (and took back) on ``host``."""
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_job(n_workers: int, *, values_per_packet: int = 8192, slot_count: int | None = None,
                 slot_base: int = 0, job_id: int = 1, key: int = 0x5EED5EED, switch_port: int | None = None,
                 control_port: int | None = None) -> JobConfig:
    """A job whose switch and workers all live on 127.0.0.1 (slots: :func:`~switchagg.wire.default_slot_count`).

    The workers get free ports. The switch gets free ones too (UDP and control) unless ``switch_port``
    names the one of a switch already running; its control port is then ``control_port``, if any.
    """
    if switch_port is None:
        switch_port, *workers = free_ports(n_workers + 1)
        (control_port,) = free_ports(1, socket.SOCK_STREAM)
    else:
        workers = free_ports(n_workers)
    return JobConfig(
        switch=Endpoint("127.0.0.1", switch_port),
        control=Endpoint("127.0.0.1", control_port) if control_port else None, job_id=job_id, key=key,
        slot_base=slot_base, slot_count=slot_count or default_slot_count(values_per_packet),
        values_per_packet=values_per_packet, workers=tuple(WorkerSpec(Endpoint("127.0.0.1", p)) for p in workers))


def spawn_switch(config: Path | None, ready_file: Path, *, prefix: Sequence[str] = (), timeout: float = 30.0,
                 switch_args: Sequence[str] = (), **popen: Any) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start ``switchagg switch --config config`` (after ``prefix``, e.g. ``ip netns exec NS``; config None
    and ``switch_args`` such as ``--address``, ``--control``: a switch that takes jobs later) and wait
    until it says where it listens, in ``ready_file``; returns the process and what it wrote there."""
    ready_file.unlink(missing_ok=True)
    job = ["--config", str(config)] if config is not None else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "switchagg", "switch", *job, *switch_args,
                             "--ready-file", str(ready_file)], **popen)
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0] if popen.get("stdout") == subprocess.PIPE else ""
            raise RuntimeError(f"the switch process did not come up (exit {proc.wait()}): {out or ''}"[-2000:])
        time.sleep(0.02)
    return proc, json.loads(ready_file.read_text())


def run_processes(target: Callable[..., Any], n: int, args: tuple = (), timeout: float = 600.0) -> list[Any]:
    """Run ``target(rank, queue, *args)`` in ``n`` spawned processes; collect what each puts last.

    A process that dies or overruns ``timeout`` turns into a RuntimeError for the
    caller, so a broken worker never hangs the command.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, queue, *args), daemon=True) for rank in range(n)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n:
            try:
                rank, kind, value = queue.get(timeout=0.5)
            except queues.Empty:  # nothing yet: check on the processes
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"worker processes {dead or 'all'} stopped without a result"
                                       f"{'' if dead else f' within {timeout:.0f} s'}") from None
                continue
            if kind == "progress":
                _show_progress(value)
            elif kind == "error":
                raise RuntimeError(f"worker {rank} failed: {value}")
            else:
                results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if _progress["shown"]:
            sys.stderr.write("\n")
            _progress["shown"] = False
    return [results[r] for r in range(n)]


_progress = {"shown": False}


def _show_progress(value: tuple[int, int, str]) -> None:
    """Draw a one-line progress bar on stderr (only on a terminal)."""
    done, total, label = value
    if not sys.stderr.isatty():
        return
    width = 30
    fill = int(width * done / max(total, 1))
    sys.stderr.write(f"\r{label} [{'#' * fill}{' ' * (width - fill)}] {done}/{total}")
    sys.stderr.flush()
    _progress["shown"] = True
