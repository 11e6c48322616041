"""``switchagg bench``: allreduce through the embedded switch against gloo, measured in one run.

The switch runs as its own process (``switchagg switch``), the workers as
``workers`` processes; then gloo's allreduce of the same tensor among the same
number of processes. Each side gets a warm-up and ``reps`` timed calls; a
call's time is the slowest worker's, and the median call is reported. The two
run back to back for several rounds, and the ratios are the median of the rounds'.

On one machine the switch process competes with the workers for the CPUs, so
two figures are printed: ``host_cpu_ratio_vs_gloo`` (worker CPU seconds per GiB
reduced, ours over gloo's; the switch is not counted, on a real deployment it is
hardware) and, last, ``ratio_vs_gloo`` (our throughput over gloo's).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from .config import JobConfig
from .local import free_ports, loopback_job, run_processes


def _timed_calls(call, reps: int) -> dict[str, list[float]]:
    call()  # warm-up
    walls, cpus, systems = [], [], []
    for _ in range(reps):
        t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        call()
        walls.append(time.perf_counter() - t)
        d = resource.getrusage(resource.RUSAGE_SELF)
        cpus.append(d.ru_utime + d.ru_stime - c.ru_utime - c.ru_stime)
        systems.append(d.ru_stime - c.ru_stime)
    return {"wall": walls, "cpu": cpus, "system": systems}


def _switchagg_worker(rank: int, queue, config_toml: str, numel: int, reps: int) -> None:
    import tomllib

    from .client import Client

    try:
        cfg = JobConfig.from_dict(tomllib.loads(config_toml))
        x = np.random.default_rng(rank).standard_normal(numel).astype(np.float32)
        with Client(cfg, rank) as client:
            out = np.empty_like(x)
            stats = _timed_calls(lambda: client.allreduce(x, out=out), reps)
            stats["backend"] = client.backend
            stats["retransmissions"] = client.retransmissions
        queue.put((rank, "result", stats))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def _gloo_worker(rank: int, queue, world: int, port: int, numel: int, reps: int) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        x = torch.from_numpy(np.random.default_rng(rank).standard_normal(numel).astype(np.float32))
        buf = x.clone()

        def call() -> None:
            buf.copy_(x)
            dist.all_reduce(buf)

        stats = _timed_calls(call, reps)
        dist.destroy_process_group()
        queue.put((rank, "result", stats))
    except Exception:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def _summary(per_worker: list[dict], nbytes: int) -> tuple[float, float, float]:
    """Median over calls of the slowest worker's time; worker CPU seconds per GiB, and the kernel's part."""
    reps = len(per_worker[0]["wall"])
    wall = statistics.median(max(w["wall"][i] for w in per_worker) for i in range(reps))
    cpu, system = (statistics.median(statistics.mean(w[key][i] for w in per_worker) for i in range(reps))
                   for key in ("cpu", "system"))
    return wall, cpu / (nbytes / 2**30), system / (nbytes / 2**30)


def _start_switch(cfg: JobConfig, workdir: Path) -> subprocess.Popen:
    path = cfg.write(workdir / "job.toml")
    proc = subprocess.Popen([sys.executable, "-m", "switchagg", "switch", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("switchagg switch on"):
            return proc
    raise RuntimeError(f"the switch process did not start (exit {proc.wait()})")


def _process_cpu(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds of a process so far (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def codec_speed(numel: int = 1 << 24, k: int = 16000, n: int = 4) -> tuple[float, float]:
    """GB/s of float32 for quantize+pack and for unpack+dequantize, one core.

    Each packet is encoded into one reused buffer and decoded from it, as a client encodes into
    the row a packet is sent from.
    """
    from .payloads import FloatPayloads
    from .wire import VALUE_DTYPE

    x = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    out = np.empty_like(x)
    wire = np.empty(k, VALUE_DTYPE)
    t = time.perf_counter()
    p = FloatPayloads(x, out, k, n)
    enc = time.perf_counter() - t
    dec = 0.0
    for d, e in enumerate(p.proposals()):
        t0 = time.perf_counter()
        p.encode(d, int(e), wire)
        t1 = time.perf_counter()
        p.decode(d, int(e), wire)
        dec += time.perf_counter() - t1
        enc += t1 - t0
    return x.nbytes / enc / 1e9, x.nbytes / dec / 1e9


def transport_speed(packets: int = 200_000, k: int = 64) -> dict[str, float]:
    """Datagrams per second sent on loopback: batched sendmmsg against one sendto a datagram."""
    import socket

    from .transport import UdpSocket
    from .wire import datagram_size

    payload = bytes(datagram_size(k))
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    rates = {}
    for batched in (True, False):
        with UdpSocket(("127.0.0.1", 0), peer=sink.getsockname(), batched=batched) as s:
            msgs = [((payload,), None)] * s.batch
            t = time.perf_counter()
            for _ in range(packets // s.batch):
                s.send(msgs)
            rates[s.backend] = packets // s.batch * s.batch / (time.perf_counter() - t)
    plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    addr = sink.getsockname()
    t = time.perf_counter()
    for _ in range(packets):
        plain.sendto(payload, addr)
    rates["sendto"] = packets / (time.perf_counter() - t)
    plain.close()
    sink.close()
    return rates


def _measure_switchagg(workers: int, numel: int, reps: int, k: int, slots: int) -> dict:
    """One run through a fresh embedded switch process: per-call figures, and the switch's CPU per call."""
    cfg = loopback_job(workers, values_per_packet=k, slot_count=slots)
    with tempfile.TemporaryDirectory() as tmp:
        switch = _start_switch(cfg, Path(tmp))
        try:
            before = _process_cpu(switch.pid)
            ours = run_processes(_switchagg_worker, workers, (cfg.to_toml(), numel, reps))
            after = _process_cpu(switch.pid)
        finally:
            switch.terminate()
            switch.wait(10)
    wall, cpu, system = _summary(ours, numel * 4)
    switch_cpu = None if not (before and after) else \
        tuple((b - a) / (reps + 1) for a, b in zip(before, after, strict=True))
    return {"wall": wall, "cpu": cpu, "system": system, "switch": switch_cpu, "backend": ours[0]["backend"],
            "resent": sum(w["retransmissions"] for w in ours)}


def _measure_gloo(workers: int, numel: int, reps: int) -> dict:
    (port,) = free_ports(1, kind=1)
    wall, cpu, system = _summary(run_processes(_gloo_worker, workers, (workers, port, numel, reps)), numel * 4)
    return {"wall": wall, "cpu": cpu, "system": system}


def run_bench(*, workers: int = 4, mib: float = 64, reps: int = 5, k: int = 16000, slots: int = 16,
              rounds: int = 3, gloo: bool = True) -> int:
    """Measure switchagg and gloo back to back, ``rounds`` times; print the median of the rounds' ratios.

    Back to back, because the speed of a shared machine drifts over a minute by more
    than the difference being measured; the ratio of two neighbouring runs drifts less.
    """
    numel = int(mib * 2**20 / 4)
    nbytes = numel * 4
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads spinning in the children
    print(f"bench: {workers} workers, {mib:g} MiB float32 ({numel} elements), {rounds} rounds of switchagg "
          f"and gloo back to back, each a warm-up + {reps} calls (median); cores here: {os.cpu_count()}")
    if gloo:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("gloo baseline skipped: torch is not installed (install the 'torch' extra)")
            gloo = False
    speed, cpu_ratio = [], []
    for r in range(1, rounds + 1):
        # Alternate which side goes first, so that neither always inherits the other's leftovers.
        base = _measure_gloo(workers, numel, reps) if gloo and r % 2 == 0 else None
        ours = _measure_switchagg(workers, numel, reps, k, slots)
        if gloo and base is None:
            base = _measure_gloo(workers, numel, reps)
        line = (f"round {r}: switchagg {ours['wall'] * 1e3:.1f} ms ({nbytes / ours['wall'] / 2**30:.3f} GiB/s), "
                f"worker CPU {ours['cpu']:.2f} s/GiB ({ours['system']:.2f} in the kernel), "
                f"resent {ours['resent']}")
        if ours["switch"]:
            line += f", switch process {ours['switch'][0] * 1e3:.0f}+{ours['switch'][1] * 1e3:.0f} ms user+system"
        print(line)
        if base is not None:
            print(f"round {r}: gloo {base['wall'] * 1e3:.1f} ms ({nbytes / base['wall'] / 2**30:.3f} GiB/s), "
                  f"worker CPU {base['cpu']:.2f} s/GiB ({base['system']:.2f} in the kernel)")
            speed.append(base["wall"] / ours["wall"])
            cpu_ratio.append(ours["cpu"] / base["cpu"])
    print(f"switchagg: K={k}, {slots} slots, transport {ours['backend']}; the switch process shares the cores")
    enc, dec = codec_speed(k=k, n=workers)
    print(f"codec (one core): quantize+pack {enc:.2f} GB/s, unpack+dequantize {dec:.2f} GB/s")
    rates = transport_speed()
    print("transport, 280-byte datagrams sent per second: "
          + ", ".join(f"{name} {rate / 1e3:.0f}k" for name, rate in rates.items()))
    if gloo:
        print(f"per round: ratio_vs_gloo {' '.join(f'{x:.3f}' for x in speed)}; "
              f"host_cpu_ratio_vs_gloo {' '.join(f'{x:.3f}' for x in cpu_ratio)}")
        print(f"host_cpu_ratio_vs_gloo={statistics.median(cpu_ratio):.3f}")
        print(f"ratio_vs_gloo={statistics.median(speed):.3f}")
    return 0
