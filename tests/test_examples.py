"""The examples run as their docstrings say: torchrun (DDP and FSDP2), Lightning and accelerate, against
a switch that takes jobs through its control port. Lightning and accelerate come with the `examples`
extra; without them their tests skip."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchagg.config import Endpoint
from switchagg.distributed import ENV, Options
from switchagg.loopback import free_ports, spawn_switch
from switchagg.switch.control_client import request

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port"]


@pytest.fixture
def env(tmp_path) -> Iterator[dict[str, str]]:
    udp, control = free_ports(1)[0], free_ports(1, socket.SOCK_STREAM)[0]
    proc, _ = spawn_switch(None, tmp_path / "ready.json", stdout=subprocess.DEVNULL,
                           switch_args=("--address", f"127.0.0.1:{udp}", "--control", f"127.0.0.1:{control}"))
    yield dict(os.environ, SWITCHAGG_SWITCH=f"127.0.0.1:{udp}", SWITCHAGG_CONTROL=f"127.0.0.1:{control}",
               PYTHONPATH=str(ROOT))
    proc.terminate()
    proc.wait(10)


def run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def datagrams_served(env: dict[str, str]) -> int:
    """What the switch has served since it started (its shards' datagrams), asked on its control port."""
    status = request(Endpoint.parse(env["SWITCHAGG_CONTROL"], "control"), {"op": "status"})
    return sum(shard["datagrams"] for shard in status["shards"])


@pytest.mark.parametrize("mode", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_script_trains_through_the_switch(env, mode):
    """The losses fall, and the gradients went through the switch: every step, each rank sent at least a
    datagram per K of the model's parameters (DDP's buckets, FSDP's reduce-scatters), which gloo would not."""
    steps = 60
    (port,) = free_ports(1, socket.SOCK_STREAM)
    before = datagrams_served(env)
    out = run([*TORCHRUN, str(port), "examples/train.py", "--steps", str(steps), *mode], env)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    params = sum(p.numel() for p in example.net().parameters())
    per_step = math.ceil(params / Options.from_env({ENV["switch"]: env["SWITCHAGG_SWITCH"]}).values_per_packet)
    assert datagrams_served(env) - before >= WORLD * steps * per_step


def test_lightning_ddp_on_cpu(env):
    pytest.importorskip("lightning", reason="Lightning comes with the examples extra: "
                                           "pip install 'switchagg[examples]'")
    run([sys.executable, "examples/lightning_ddp.py"], env)


def test_accelerate_on_cpu(env):
    pytest.importorskip("accelerate", reason="accelerate comes with the examples extra: "
                                             "pip install 'switchagg[examples]'")
    (port,) = free_ports(1, socket.SOCK_STREAM)
    out = run([*TORCHRUN, str(port), "examples/accelerate_train.py"], env)
    assert "process group backend: switchagg" in out, out


def two_nodes(per_node: int, script: list[str], env: dict[str, str], logs: Path) -> list[str]:
    """``script`` under two torchrun agents on this machine, ``--nnodes 2``: each its own node (GROUP_RANK).
    Their output goes to files in ``logs`` (a pipe left unread while the other agent is waited for could fill)."""
    (port,) = free_ports(1, socket.SOCK_STREAM)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]
    outs, agents = [], []
    for node in (0, 1):
        out, err = (open(logs / f"{port}-{node}.{s}", "w+") for s in ("out", "err"))  # noqa: SIM115 - closed below
        outs.append((out, err))
        agents.append(subprocess.Popen([*argv, "--node-rank", str(node), *script], cwd=ROOT, env=env, text=True,
                                       stdout=out, stderr=err))
    texts = []
    for agent, (out, err) in zip(agents, outs, strict=True):
        agent.wait(timeout=300)
        out.seek(0)
        err.seek(0)
        texts.append(out.read())
        assert agent.returncode == 0, err.read()[-3000:]
        out.close()
        err.close()
    return texts


@pytest.mark.parametrize("mode", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_on_two_nodes_reduces_in_each_node_first_and_trains_as_gloo_does(env, mode, tmp_path):
    """Two torchrun agents, two ranks each: each rail a switch job of two workers (one per node). The
    baseline is the same four ranks under one agent, one flat job, whose training matches gloo's
    (tests/test_distributed.py); the script under gloo itself aborts a rank at its exit now and then
    on this two-core box ("terminate called without an active exception", in torch's teardown)."""
    script = ["examples/train.py", "--steps", "40", *mode]
    ours = two_nodes(2, script, env, tmp_path)[0]
    (port,) = free_ports(1, socket.SOCK_STREAM)
    flat = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port),
                *script], env)
    assert "switch jobs: 2 rails of 2 nodes" in ours and "switch jobs" not in flat, (ours, flat)
    losses, expected = ([float(x) for x in re.findall(r"loss (\d+\.\d+)", out)] for out in (ours, flat))
    assert len(losses) == 2 and losses[-1] < losses[0], ours
    assert losses == pytest.approx(expected, rel=1e-3), (ours, flat)
