"""Rank bodies for the DDP tests (spawned processes import this module)."""

from __future__ import annotations

import time
import tomllib
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from switchagg import JobConfig
from switchagg.codec import ceil_log2
from switchagg.ddp import SwitchAggState, allreduce_hook


def make_model() -> nn.Module:
    torch.manual_seed(0)  # same start on every rank and in both modes
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 33), nn.Tanh(), nn.Linear(33, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)  # a fixed batch per rank: the loss must fall
    x = torch.randn(64, 20, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def fixed_batch_losses(model: nn.Module, rank: int, steps: int) -> tuple[list[float], torch.Tensor]:
    """``steps`` of SGD on this rank's fixed batch: the losses, and the parameters after them, flat."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x, y = batch(rank, 0)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def checked_hook(record: list):
    """The switchagg hook, with each bucket's result compared to gloo's exact mean."""

    def hook(state, bucket):
        buf = bucket.buffer()
        exact = buf.clone().double()
        dist.all_reduce(exact)
        exact /= state.world_size
        maxabs = buf.abs().max().double()
        dist.all_reduce(maxabs, op=dist.ReduceOp.MAX)
        e = int(torch.frexp(maxabs.float()).exponent)
        n = state.world_size
        bound = 0.5 * 2.0 ** (e - 31 + ceil_log2(n))  # n * 0.5 / s, divided by n for the mean
        sizes = record.setdefault("sizes", set()) if isinstance(record, dict) else None

        def check(fut):
            got = fut.value()
            err = (got.double() - exact).abs()
            ok = bool((err <= bound + exact.abs() * 2.0**-22).all())
            record["ok"] = record.get("ok", True) and ok and got.shape == buf.shape and got.dtype == buf.dtype
            sizes.add(buf.numel())
            return got

        return allreduce_hook(state, bucket).then(check)

    return hook


def train(rank: int, world: int, cfg_toml: str, port: int, steps: int, queue, stop_after: int | None = None,
          go=None, probe_timeout: float = 30.0) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        cfg = JobConfig.from_dict(tomllib.loads(cfg_toml))
        out = {}
        for mode in ("default", "switchagg") if stop_after is None else ("switchagg",):
            model = DDP(make_model(), bucket_cap_mb=0.004)  # several buckets of uneven sizes
            record: dict = {}
            if mode == "switchagg":
                state = SwitchAggState.create(cfg, stall_timeout=2.0, probe_timeout=probe_timeout)
                model.register_comm_hook(state, checked_hook(record) if stop_after is None else allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for step in range(steps):
                if stop_after is not None and step == stop_after:
                    if rank == 1 and go is None:
                        return  # this peer stops; its socket closes with the process
                    if go is not None:
                        queue.put((rank, "ready", None))
                        go.wait(30)
                x, y = batch(rank, step)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                t = time.monotonic()
                try:
                    loss.backward()
                except RuntimeError as exc:
                    queue.put((rank, "failed", (str(exc), time.monotonic() - t)))
                    return
                opt.step()
                losses.append(loss.item())
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[mode] = {"losses": losses, "params": params.numpy(), "ok": record.get("ok"),
                         "buckets": sorted(record.get("sizes", ()))}
            if mode == "switchagg":
                state.close()
        queue.put((rank, "done", out))
    except Exception:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def amp_skip(rank: int, world: int, cfg_toml: str, port: int, steps: int, queue, bad_step: int = 2) -> None:
    """GradScaler under DDP, both modes: rank 0's gradients hold an inf at ``bad_step`` (an fp16
    overflow); every rank must skip that step (its parameters unchanged) and lower the scale."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        cfg = JobConfig.from_dict(tomllib.loads(cfg_toml))
        out = {}
        for mode in ("default", "switchagg"):
            model = DDP(make_model(), bucket_cap_mb=0.004)
            state = None
            if mode == "switchagg":
                state = SwitchAggState.create(cfg, stall_timeout=5.0, probe_timeout=30.0)
                model.register_comm_hook(state, allreduce_hook)
            step_now = [0]
            first = next(model.parameters())
            first.register_hook(lambda g, now=step_now: g * float("inf") if rank == 0 and now[0] == bad_step else g)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            skipped, scales = [], []
            for step in range(steps):
                step_now[0] = step
                x, y = batch(rank, step)
                opt.zero_grad()
                before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
                scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                skipped.append(bool(torch.equal(before, after)))
                scales.append(scaler.get_scale())
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[mode] = {"skipped": skipped, "scales": scales, "params": params.numpy()}
            if state is not None:
                state.close()
        queue.put((rank, "done", out))
    except Exception:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))
