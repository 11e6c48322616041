"""``switchagg bench``: allreduce through the embedded switch against gloo, measured in one run.

The switch runs as its own process (``switchagg switch``), the workers as
``workers`` processes; then gloo's allreduce of the same tensor among the same
number of processes. Each side gets a warm-up and ``reps`` timed calls; a
call's time is the slowest worker's, and the median call is reported. The two
run back to back for several rounds, and the ratios are the median of the rounds'.
Each round measures switchagg at every packet size asked for: K = 64 (the P4
switch's packet) and K = 16000 (64 KB datagrams, loopback only) by default.

On one machine the switch process competes with the workers for the CPUs, so
two figures are printed per K: ``host_cpu_ratio_vs_gloo`` (worker CPU seconds per GiB
reduced, ours over gloo's; the switch is not counted, on a real deployment it is
hardware) and ``ratio_vs_gloo`` (our throughput over gloo's), the first K's last.
``pps_vs_gso_ceiling`` puts the packets the switch took per second over what one
tight sender and one receiver move on the same loopback at the same size
(:func:`udp_ceiling`), measured in the same run.

**Where the time goes.** Each worker's CPU per GiB is split three ways, per call and then as the
medians: *kernel*, the process's system time (the socket calls' copies and the loopback's delivery);
*codec*, the CPU the codec's own loops (:mod:`switchagg._native`'s propose, quantize_propose and
dequantize, the functions the C stream calls) take on the same tensor in the same worker process, right
after its calls, a window of chunks at a time into and out of a window-sized buffer as the stream does
(:func:`codec_cpu`); *protocol*, the rest of its user time: the stream's schedule, headers, timers and
bookkeeping, the Python around each call and the client's threads. The codec figure is an estimate
(the loops without the stream's per-chunk calls around them), so protocol holds what the stream adds
to them. The switch's CPU per packet is its process's user and system time over the datagrams it
served (its counters), each part apart. Linux splits a process's time into user and system by
sampling at the clock tick (the switch's figures come in ticks too): sound over 64 MiB calls, rough
for small ones.

``switch_cores`` runs the switch on that many cores (``switchagg switch --cores``, steered by
``switch_steer``); each round then also says the switch's packets per second per core (the
packets the workers sent it per second of their calls, over its cores), its CPU per packet, and
each core's share of the packets with how many came in a message steered by another packet's
field (its control port's ``status``). With one job and the default steering by job, one core
serves it all.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..config import JobConfig
from ..errors import SwitchAggError
from ..loopback import free_ports, loopback_job, run_processes, spawn_switch
from ..wire import datagram_size, default_slot_count


def _timed_calls(call, reps: int, warm_up: bool = True) -> dict[str, list[float]]:
    if warm_up:
        call()
    walls, cpus, systems = [], [], []
    for _ in range(reps):
        t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        call()
        walls.append(time.perf_counter() - t)
        d = resource.getrusage(resource.RUSAGE_SELF)
        cpus.append(d.ru_utime + d.ru_stime - c.ru_utime - c.ru_stime)
        systems.append(d.ru_stime - c.ru_stime)
    return {"wall": walls, "cpu": cpus, "system": systems}


def codec_cpu(x: np.ndarray, out: np.ndarray, k: int, n: int, slots: int) -> float:
    """CPU seconds (this thread's) that the codec's loops take on float32 ``x`` and ``out`` in one call of a
    job of ``n`` workers, K = ``k``, ``slots`` slots: what the C stream runs, with its reach into memory.

    The stream proposes the first window's exponents as the call starts, then quantizes data chunk c in
    one loop with the proposal of chunk c + ``slots`` (``sa_quantize_propose``) into the row it sends,
    and dequantizes each sum from the row it received into ``out``. Here the same functions run a
    window (``slots`` chunks) at a time into a window-sized buffer, which stays in the cache as the
    rows do, and back out of it: the same bytes read and written, without the per-chunk calls.
    """
    from .. import _native
    from ..codec import propose_exponents, scale_shift

    window = slots * k
    exps = np.empty(-(-min(window, x.size) // k), np.int8)
    values = np.empty(min(window, x.size), np.uint32)  # the rows' values, big-endian int32 on the wire
    shift = scale_shift(int(propose_exponents(x[:window], k).max()), n)  # any finite one: the loops' speed is one
    start = time.thread_time()
    _native.propose(x[:window], k, exps)
    for a in range(0, x.size, window):
        b = min(a + window, x.size)
        _native.quantize_propose(x[a:b], values[:b - a], shift, x[a + window:b + window])
        _native.dequantize(values[:b - a], out[a:b], shift)
    return time.thread_time() - start


def _switchagg_worker(rank: int, queue, config_toml: str, numel: int, reps: int) -> None:
    import tomllib

    from ..client import Client

    try:
        cfg = JobConfig.from_dict(tomllib.loads(config_toml))
        x = np.random.default_rng(rank).standard_normal(numel).astype(np.float32)
        with Client(cfg, rank) as client:
            out = np.empty_like(x)
            client.allreduce(x, out=out)  # the warm-up, outside the packet counts
            sent, received = client.transport_stats.sent, client.transport_stats.received
            stats = _timed_calls(lambda: client.allreduce(x, out=out), reps, warm_up=False)
            stats["sent"] = client.transport_stats.sent - sent
            stats["received"] = client.transport_stats.received - received
            stats["backend"] = client.backend
            stats["retransmissions"] = client.retransmissions
        k, n = cfg.values_per_packet, len(cfg.workers)
        # the codec's share, on the same bytes in the same process: as many times as there were calls
        stats["codec"] = [codec_cpu(x, out, k, n, cfg.slot_count) for _ in range(reps)]
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


def _summary(per_worker: list[dict], nbytes: int) -> dict[str, float]:
    """Median over calls of the slowest worker's time (``wall``); worker CPU seconds per GiB (``cpu``), and of it
    the kernel's (``system``) and, where measured, the codec's loops' (``codec``): each the median over calls
    of the workers' mean."""
    reps = len(per_worker[0]["wall"])
    out = {"wall": statistics.median(max(w["wall"][i] for w in per_worker) for i in range(reps))}
    for key in ("cpu", "system", "codec"):
        if key in per_worker[0]:
            out[key] = statistics.median(statistics.mean(w[key][i] for w in per_worker)
                                         for i in range(reps)) / (nbytes / 2**30)
    return out


def _start_switch(cfg: JobConfig, workdir: Path, cores: int = 1, steer: str = "job") -> subprocess.Popen:
    proc, _ = spawn_switch(cfg.write(workdir / "job.toml"), workdir / "switch.ready", stdout=subprocess.DEVNULL,
                           switch_args=("--cores", str(cores), "--steer", steer) if cores > 1 else ())
    return proc


def _shard_stats(cfg: JobConfig) -> list[dict[str, int]]:
    """What each of the switch's cores served so far (its control port's ``status``)."""
    from ..switch.control_client import request

    return request(cfg.control, {"op": "status"})["shards"]


def _process_cpu(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds of a process so far (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def codec_speed(k: int, n: int, numel: int = 1 << 24, calls_timed: int = 3) -> tuple[float, float]:
    """GB/s of float32 through the worker's C stream, one core: quantize+pack, unpack+dequantize,
    each the median of ``calls_timed`` calls (as :func:`copy_speed`'s copy is of three: one call of a
    64 MiB tensor is 10-20 ms, which a neighbour on the host could slow by a third).

    The stream writes whole windows of packets per call (header and quantized values straight
    into the rows a socket sends from) and takes whole batches of results back; here each
    packet comes straight back as its own result, as from a switch of one worker. The calls share
    one arena for their per-call arrays, as a client's do (without it each call's arrays are fresh
    pages the kernel zeroes, which is not the codec's time).
    """
    from .. import calls
    from ..payloads import FloatPayloads
    from ..protocol import Arena, NativeReduction, StreamParams, Window
    from ..wire import PacketType, datagram_size

    x = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    out = np.empty_like(x)
    slots = 1024
    size = datagram_size(k)
    rows = np.empty((slots, size), np.uint8)
    offsets = (size * np.arange(slots)).astype(np.uint32)
    lengths = np.full(slots, size, np.uint32)

    row, _ = calls.rows(calls.CallDescriptor(0, numel, "float"), 0, n, k)
    call = (row, row.tobytes())  # the rows come back unsummed, so the call round's echo is what it expects
    arena = Arena()

    def one_call() -> tuple[float, float]:
        t = time.perf_counter()
        payloads = FloatPayloads(x, out, k, n)
        red = NativeReduction(StreamParams(1, 0, 0, 1, n, slots, k), Window(slots, initial=slots), payloads,
                              n_chunks=-(-numel // k), first_id=0, copies=np.zeros(slots, np.int64), now=0.0,
                              progress_timeout=1e9, call=call, arena=arena)
        enc, dec = time.perf_counter() - t, 0.0
        while not red.done:
            t0 = time.perf_counter()
            m = red.emit(rows, lengths)
            t1 = time.perf_counter()
            rows[:m, 1] = PacketType.RESULT
            t2 = time.perf_counter()
            red.receive_batch(rows, offsets[:m], lengths[:m], 0.0)
            dec += time.perf_counter() - t2
            enc += t1 - t0
        return enc, dec

    one_call()  # the first call also faults in out's pages, as a training loop's first step does
    timed = [one_call() for _ in range(calls_timed)]
    enc, dec = (statistics.median(side) for side in zip(*timed, strict=True))
    return x.nbytes / enc / 1e9, x.nbytes / dec / 1e9


def copy_speed(numel: int = 1 << 24) -> float:
    """GB/s of a plain copy of as many float32 on one core (numpy's, into memory already faulted in),
    the median of three: the memory speed the codec's figures are read against, measured in the same
    run (the same box's copy ran at 9-14 GB/s from hour to hour)."""
    x = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    out = np.empty_like(x)
    np.copyto(out, x)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(out, x)
        times.append(time.perf_counter() - t)
    return x.nbytes / statistics.median(times) / 1e9


def udp_ceiling(size: int, *, segmentation: bool | None = None, seconds: float = 1.0) -> float:
    """Datagrams of ``size`` bytes per second that one tight sender moves to one receiver on loopback.

    Both are the C batch calls of :mod:`switchagg._udp` in a loop that does nothing else, on two
    threads (they release the GIL): the most a worker and a switch could hope for at this size.
    """
    import threading

    from ..transport import UdpSocket

    with UdpSocket(("127.0.0.1", 0), batch=1024, segmentation=segmentation) as rx, \
            UdpSocket(("127.0.0.1", 0), peer=rx.address, batch=1024, max_datagram=size,
                      segmentation=segmentation) as tx:
        stop = threading.Event()

        def send() -> None:
            while not stop.is_set():
                tx.send_rows(len(tx.out_rows), size)

        sender = threading.Thread(target=send, daemon=True)
        received, first, last = 0, 0.0, 0.0
        sender.start()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            got = rx.recv_packets(0.05)
            if got and not first:
                first = time.perf_counter()
            elif got:
                received += got
                last = time.perf_counter()
        stop.set()
        sender.join()
    return received / (last - first) if last > first else 0.0


def _measure_switchagg(workers: int, numel: int, reps: int, k: int, slots: int, cores: int = 1,
                       steer: str = "job") -> dict:
    """One run through a fresh embedded switch process: per-call figures, packet rates, the switch's CPU per call
    and what each of its cores served."""
    cfg = loopback_job(workers, values_per_packet=k, slot_count=slots)
    with tempfile.TemporaryDirectory() as tmp:
        switch = _start_switch(cfg, Path(tmp), cores, steer)
        try:
            before = _process_cpu(switch.pid)
            ours = run_processes(_switchagg_worker, workers, (cfg.to_toml(), numel, reps))
            after = _process_cpu(switch.pid)
            shards = _shard_stats(cfg)
        finally:
            switch.terminate()
            switch.wait(10)
    summary = _summary(ours, numel * 4)
    switch_cpu = None if not (before and after) else \
        tuple((b - a) / (reps + 1) for a, b in zip(before, after, strict=True))
    busy = [sum(w["wall"]) for w in ours]  # each worker's time in its timed calls
    pps_out = statistics.mean(w["sent"] / b for w, b in zip(ours, busy, strict=True))
    served = sum(s["datagrams"] for s in shards)
    return {**summary, "switch": switch_cpu, "backend": ours[0]["backend"],
            "resent": sum(w["retransmissions"] for w in ours), "pps_out": pps_out,
            "pps_in": statistics.mean(w["received"] / b for w, b in zip(ours, busy, strict=True)),
            "cores": cores, "pps_per_core": workers * pps_out / cores,
            # the switch's CPU per datagram it served, user and system (the warm-up call's too, as its CPU figure
            # has them)
            "switch_cpu_per_packet": None if not switch_cpu else [c * (reps + 1) / max(served, 1) for c in switch_cpu],
            "shares": [s["datagrams"] / max(served, 1) for s in shards],
            "off_home": sum(s["off_home"] for s in shards) / max(served, 1)}


def _switch_line(run: dict) -> str:
    """A round's figures of the switch's cores: packets per second per core, CPU per packet, each core's share."""
    line = f"{run['pps_per_core'] / 1e3:.0f}k packets/s per core"
    if run["switch_cpu_per_packet"] is not None:
        user, system = run["switch_cpu_per_packet"]
        line += (f", {(user + system) * 1e9:.0f} ns of CPU per packet"
                 f" ({user * 1e9:.0f} user + {system * 1e9:.0f} system)")
    if run["cores"] > 1:
        line += (f", each core's share of the packets {' '.join(f'{x:.0%}' for x in run['shares'])}, "
                 f"{run['off_home']:.1%} in a message steered by another packet's field")
    return line


def _split(run: dict) -> str:
    """A run's worker CPU per GiB in its three parts (the module's doc says what each holds)."""
    protocol = run["cpu"] - run["system"] - run["codec"]
    return f"codec {run['codec']:.2f} + protocol {protocol:.2f} + kernel {run['system']:.2f}"


def _where(runs: list[dict], switch_per_packet: list[list[float]]) -> str:
    """The split of the round whose workers' CPU per GiB is the median (its parts add up to it), and of the
    round whose switch CPU per packet is."""
    middle = sorted(runs, key=lambda x: x["cpu"])[(len(runs) - 1) // 2]
    line = (f"workers' CPU {middle['cpu']:.2f} s/GiB (the median round's) = {_split(middle)}: codec the codec's "
            "loops on the same bytes, protocol the rest of their user time, kernel their system time")
    if switch_per_packet:
        user, system = sorted(switch_per_packet, key=sum)[(len(switch_per_packet) - 1) // 2]
        line += (f"; the switch's CPU per packet {(user + system) * 1e9:.0f} ns = {user * 1e9:.0f} user + "
                 f"{system * 1e9:.0f} system (the median round's: its process's CPU over the datagrams it served)")
    return line


def _measure_gloo(workers: int, numel: int, reps: int) -> dict:
    (port,) = free_ports(1, kind=socket.SOCK_STREAM)
    return _summary(run_processes(_gloo_worker, workers, (workers, port, numel, reps)), numel * 4)


def _progress(total: int):
    """A progress bar on stderr for a terminal (tqdm, from the ``bench`` extra), else nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="run", disable=None, leave=False)


def run_bench(*, workers: int = 4, mib: float = 64, reps: int = 5, ks: Sequence[int] = (64, 16000),
              slots: int | None = None, rounds: int = 3, gloo: bool = True, plot: str | None = None,
              switch_cores: int = 1, switch_steer: str = "job") -> int:
    """Measure gloo and switchagg at each K back to back, ``rounds`` times; print the medians of the rounds' ratios.

    Back to back, because the speed of a shared machine drifts over a minute by more
    than the difference being measured; the ratio of two neighbouring runs drifts less.
    """
    numel = int(mib * 2**20 / 4)
    nbytes = numel * 4
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no idle BLAS threads spinning in the children
    print(f"bench: {workers} workers, {mib:g} MiB float32 ({numel} elements), {rounds} rounds of gloo and "
          f"switchagg at K={', '.join(map(str, ks))} back to back, each a warm-up + {reps} calls (median); "
          f"cores here: {os.cpu_count()}; the switch on {switch_cores} core"
          + (f"s steered by {switch_steer}" if switch_cores > 1 else ""))
    if gloo:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("gloo baseline skipped: torch is not installed (install the 'torch' extra)")
            gloo = False
    slot_counts = {k: slots or default_slot_count(k) for k in ks}
    runs: dict[int, list[dict]] = {k: [] for k in ks}
    bases: list[dict] = []
    bar = _progress(rounds * (len(ks) + gloo))
    for r in range(1, rounds + 1):
        # Alternate which side goes first, so that neither always inherits the other's leftovers.
        order = [*ks, "gloo"] if r % 2 else ["gloo", *ks]
        for side in order:
            if side == "gloo":
                if gloo:
                    bases.append(_measure_gloo(workers, numel, reps))
            else:
                runs[side].append(_measure_switchagg(workers, numel, reps, side, slot_counts[side], switch_cores,
                                                     switch_steer))
            if bar is not None and (side != "gloo" or gloo):
                bar.update()
        if bar is not None:
            bar.clear()
        for k in ks:
            ours = runs[k][-1]
            line = (f"round {r}: switchagg K={k} {ours['wall'] * 1e3:.1f} ms ({nbytes / ours['wall'] / 2**30:.3f} "
                    f"GiB/s), worker CPU {ours['cpu']:.2f} s/GiB ({_split(ours)}), packets/s per "
                    f"worker {ours['pps_out'] / 1e3:.0f}k out {ours['pps_in'] / 1e3:.0f}k in, resent {ours['resent']}")
            if ours["switch"]:
                line += f", switch process {ours['switch'][0] * 1e3:.0f}+{ours['switch'][1] * 1e3:.0f} ms user+system"
            print(line)
            print(f"round {r}: switch K={k} on {ours['cores']} core{'s' if ours['cores'] > 1 else ''}: "
                  f"{_switch_line(ours)}")
        if gloo:
            base = bases[-1]
            print(f"round {r}: gloo {base['wall'] * 1e3:.1f} ms ({nbytes / base['wall'] / 2**30:.3f} GiB/s), "
                  f"worker CPU {base['cpu']:.2f} s/GiB ({base['system']:.2f} in the kernel)")
    if bar is not None:
        bar.close()
    ceilings = {}
    copy = copy_speed()
    for k in ks:
        size = datagram_size(k)
        gso, plain = udp_ceiling(size), udp_ceiling(size, segmentation=False)
        ceilings[k] = gso
        enc, dec = codec_speed(k, workers)
        print(f"K={k}: {slot_counts[k]} slots, transport {runs[k][-1]['backend']}; codec through the worker's "
              f"stream (one core, median of 3 calls): quantize+pack {enc:.2f} GB/s, unpack+dequantize {dec:.2f} GB/s "
              f"({enc / copy:.2f}x and {dec / copy:.2f}x a plain copy's {copy:.2f} GB/s); one sender to "
              f"one receiver, {size}-byte datagrams: {gso / 1e3:.0f}k/s with GSO/GRO, {plain / 1e3:.0f}k/s with "
              f"sendmmsg/recvmmsg")
    for k in ks[::-1]:  # the first K's figures last
        per_core = statistics.median(x["pps_per_core"] for x in runs[k])
        cpu_each = [x["switch_cpu_per_packet"] for x in runs[k] if x["switch_cpu_per_packet"] is not None]
        each = " ".join(f"{x['pps_per_core'] / 1e3:.0f}k" for x in runs[k])
        print(f"K={k}: switch on {switch_cores} core{'s' if switch_cores > 1 else ''}: packets/s per core "
              f"{per_core / 1e3:.0f}k (median of the rounds': {each})"
              + (f", CPU per packet {statistics.median(sum(c) for c in cpu_each) * 1e9:.0f} ns" if cpu_each else ""))
        print(f"K={k}: where the time goes: {_where(runs[k], cpu_each)}")
        print(f"switch_pps_per_core{'' if k == ks[0] else f'_k{k}'}={per_core:.0f}")
        pps = [workers * run["pps_out"] / ceilings[k] for run in runs[k]] if ceilings[k] else []
        print(f"K={k}: packets/s per worker {statistics.median(x['pps_out'] for x in runs[k]) / 1e3:.0f}k out, "
              f"{statistics.median(x['pps_in'] for x in runs[k]) / 1e3:.0f}k in; pps_vs_gso_ceiling="
              f"{statistics.median(pps) if pps else float('nan'):.3f} (the switch's packets in over the ceiling)")
        if gloo:
            speed = [b["wall"] / x["wall"] for b, x in zip(bases, runs[k], strict=True)]
            cpu_ratio = [x["cpu"] / b["cpu"] for b, x in zip(bases, runs[k], strict=True)]
            suffix = "" if k == ks[0] else f"_k{k}"
            print(f"K={k} per round: ratio_vs_gloo {' '.join(f'{x:.3f}' for x in speed)}; "
                  f"host_cpu_ratio_vs_gloo {' '.join(f'{x:.3f}' for x in cpu_ratio)}")
            print(f"host_cpu_ratio_vs_gloo{suffix}={statistics.median(cpu_ratio):.3f}")
            print(f"ratio_vs_gloo{suffix}={statistics.median(speed):.3f}")
    if plot:
        _plot(plot, runs, bases, workers)
        print(f"plot: {plot}", file=sys.stderr)
    return 0


def _plot(path: str, runs: dict[int, list[dict]], bases: list[dict], workers: int) -> None:
    """Each round's ratio to gloo and packet rate per worker, per K, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SwitchAggError("--plot needs matplotlib: pip install 'switchagg[bench]'") from None
    fig, (speed, rate) = plt.subplots(1, 2, figsize=(10, 4))
    for k, per_round in runs.items():
        rounds = range(1, len(per_round) + 1)
        if bases:
            speed.plot(rounds, [b["wall"] / x["wall"] for b, x in zip(bases, per_round, strict=True)], "o-",
                       label=f"K={k}")
        rate.plot(rounds, [x["pps_out"] / 1e3 for x in per_round], "o-", label=f"K={k} out")
        rate.plot(rounds, [x["pps_in"] / 1e3 for x in per_round], "x--", label=f"K={k} in")
    speed.set(title="throughput over gloo's", xlabel="round", ylabel="ratio_vs_gloo")
    rate.set(title=f"packets/s per worker ({workers} workers)", xlabel="round", ylabel="thousand packets/s",
             yscale="log")
    for ax in (speed, rate):
        ax.set_xticks(range(1, len(next(iter(runs.values()))) + 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
