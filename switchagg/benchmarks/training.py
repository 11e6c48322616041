"""``switchagg bench --ddp`` and ``--fsdp``: training steps through the ``switchagg`` backend against gloo.

The same seeded MLP trains on the same fixed batches under both backends, one process group each,
the embedded switch in this process. It prints each backend's median step time (the slowest rank's),
their ratio, and the bytes each rank sent and received per step through the switch: FSDP2's
reduce-scatter brings a rank only its own shard's sums (about 1/N of what DDP's all-reduce brings).

``--nodes M`` puts the ranks on ``M`` nodes (``SWITCHAGG_NODE``): each node reduces locally first and
each rail is a switch job of ``M`` workers. It runs that, the same ranks as one flat job, and gloo,
and prints each one's step time, and the bytes each rank and each rail sends through the switch.
"""

from __future__ import annotations

import socket
import statistics
import time
import traceback
from dataclasses import replace

from ..ddp_demo import mlp, start_rank
from ..loopback import free_ports, run_processes
from ..switch.server import SoftSwitch

WARMUP = 3


def _model(kind: str, width: int, depth: int):
    from torch import nn

    model = mlp(width, depth)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _worker(rank: int, queue, world: int, port: int, backend: str, kind: str, options, steps: int, width: int,
            depth: int, nodes: int = 1) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch import nn

        if options is not None:  # rank r on node r // (world / nodes): one node is the flat job
            options = replace(options, node=f"bench node {rank // (world // nodes)}")
        x, y = start_rank(rank, world, port, backend, options)
        model = _model(kind, width, depth)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        stats = dist.group.WORLD.client.transport_stats if backend == "switchagg" else None
        times, sent, received = [], 0, 0
        for step in range(WARMUP + steps):
            if step == WARMUP and stats is not None:
                sent, received = stats.bytes_sent, stats.bytes_received
            dist.barrier()  # every rank starts the step together: time the step, not the skew
            t = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t)
            if rank == 0:
                queue.put((rank, "progress", (step + 1, WARMUP + steps, f"{kind} {backend:>9}")))
        if stats is not None:
            sent, received = stats.bytes_sent - sent, stats.bytes_received - received
        params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors count their whole size
        dist.destroy_process_group()
        queue.put((rank, "result", {"seconds": statistics.median(times[WARMUP:]), "sent": sent / steps,
                                    "received": received / steps, "params": params}))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_training_bench(kind: str, *, workers: int = 4, steps: int = 10, width: int = 1024, depth: int = 3,
                       values_per_packet: int = 64, nodes: int = 1) -> int:
    """Time ``kind`` ("ddp" or "fsdp") steps through the switch and through gloo; print the figures.
    With ``nodes`` > 1, also the same ranks on that many nodes (a switch job per rail)."""
    from ..distributed import Options
    from ..errors import ConfigError

    if nodes < 1 or workers % nodes or (nodes > 1 and workers == nodes):
        raise ConfigError(f"--nodes {nodes}: give a count that divides --workers {workers} into nodes of two or "
                          "more ranks each")
    runs = {"switchagg": 1, "gloo": 1} if nodes == 1 else {f"switchagg {nodes} nodes": nodes, "switchagg": 1,
                                                           "gloo": 1}
    (control,) = free_ports(1, kind=socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control)) as sw:
        options = Options(switch=f"127.0.0.1:{sw.address[1]}", control=f"127.0.0.1:{control}",
                          values_per_packet=values_per_packet)
        results = {}
        for name, on in runs.items():
            (port,) = free_ports(1, kind=socket.SOCK_STREAM)
            backend = name.split()[0]
            results[name] = run_processes(_worker, workers, (workers, port, backend, kind, options, steps, width,
                                                             depth, on))
    seconds = {name: max(r["seconds"] for r in rs) for name, rs in results.items()}
    base = seconds["gloo"]
    params = results["switchagg"][0]["params"]
    grads = 4 * params
    print(f"{kind.upper()}: {workers} ranks, MLP {depth}x{width} ({params / 1e6:.2f} M parameters, "
          f"{grads / 2**20:.1f} MiB of float32 gradients), K={values_per_packet}, median of {steps} steps after "
          f"{WARMUP} warm-up: " + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in seconds.items()))
    for name, on in runs.items():
        if name == "gloo":
            continue
        sent = statistics.mean(r["sent"] for r in results[name])
        received = statistics.mean(r["received"] for r in results[name])
        rail = f", each rail's {on} ranks {sent * on / 2**20:.2f} MiB" if on > 1 else ""
        print(f"{name}: per rank and step through the switch: sent {sent / 2**20:.2f} MiB ({sent / grads:.2f}x the "
              f"gradients{rail}), received {received / 2**20:.2f} MiB ({received / grads:.2f}x)")
    if nodes > 1:
        hier = f"switchagg {nodes} nodes"
        sent = statistics.mean(r["sent"] for r in results[hier])
        print(f"sent_vs_gradients_{kind}_nodes={sent / grads:.3f}")
        print(f"ratio_vs_gloo_{kind}_nodes={base / seconds[hier]:.3f}")
        print(f"ratio_vs_flat_{kind}_nodes={seconds['switchagg'] / seconds[hier]:.3f}")
    print(f"ratio_vs_gloo_{kind}={base / seconds['switchagg']:.3f}")
    received = statistics.mean(r["received"] for r in results["switchagg"])
    print(f"received_vs_gradients_{kind}={received / grads:.3f}")
    return 0
