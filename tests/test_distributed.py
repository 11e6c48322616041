"""The torch.distributed backend ``"switchagg"``: ranks in spawned processes, an embedded switch here.

Every test forms its process groups from the ``SWITCHAGG_*`` variables and a TCP store, as torchrun
would: no job file anywhere.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from switchagg import SoftSwitch
from switchagg.distributed import ENV, Options
from switchagg.distributed.rendezvous import RENEWALS_PER_LEASE, _deploy_leased
from switchagg.errors import ConfigError
from switchagg.loopback import free_ports, loopback_job, run_processes
from switchagg.switch.server import NUM_SLOTS
from switchagg.targets.base import Target, UnsupportedOperation
from tests import dist_worker

WORLD = 2


@pytest.fixture
def switch() -> Iterator[tuple[SoftSwitch, dict[str, str]]]:
    """An embedded switch that takes jobs through its control port, and the variables that point at it."""
    (control,) = free_ports(1, socket.SOCK_STREAM)
    sw = SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control)).start()
    yield sw, {ENV["switch"]: f"127.0.0.1:{sw.address[1]}", ENV["control"]: f"127.0.0.1:{control}"}
    sw.stop()
    assert sw.error is None


def spawn(fn, *args, world: int = WORLD, timeout: float = 180.0) -> list:
    (port,) = free_ports(1, socket.SOCK_STREAM)
    return run_processes(fn, world, (world, *args[:1], port, *args[1:]), timeout=timeout)


def inputs(dtype: torch.dtype, n: int, seed: int, world: int = WORLD) -> list[torch.Tensor]:
    return [dist_worker._values(r, n, dtype, seed) for r in range(world)]


def test_collectives_through_the_switch_and_the_fallback(switch):
    sw, env = switch
    sizes = [1, 63, 1000, 4097]  # less than a chunk, ragged chunks, more than one packet's worth per rank
    out = spawn(dist_worker.collectives, env, sizes)
    for i, n in enumerate(sizes):
        for dtype in (torch.int32, torch.float32):
            xs = [x.numpy() for x in inputs(dtype, n * WORLD, i)]
            total = sum(x.astype(np.float64) for x in xs)
            for rank, got in enumerate(out):
                reduced, shard = got[f"all_reduce {dtype} {n}"], got[f"reduce_scatter {dtype} {n}"]
                gathered = got[f"all_gather {dtype} {n}"]
                assert np.array_equal(gathered, np.concatenate([x[:n] for x in xs]))
                if dtype == torch.int32:
                    assert np.array_equal(reduced, sum(xs))
                    assert np.array_equal(shard, sum(xs)[rank * n:(rank + 1) * n])
                else:  # the codec's bound (docs/protocol.md, section 2), with float32's rounding of the sum
                    bound = WORLD * float(max(np.abs(x).max() for x in xs)) * 2.0 ** -22
                    assert np.abs(reduced - total).max() <= bound
                    assert np.abs(shard - total[rank * n:(rank + 1) * n]).max() <= bound
    # The bytes went through the switch for the calls it sums (each rank sent its values whole and received
    # its result: all of it, or its shard), and none for the calls the fallback does.
    through = {f"{kind} {dtype} {n}": (WORLD * n, n if kind == "reduce_scatter" else WORLD * n)
               for n in sizes for dtype in (torch.int32, torch.float32) for kind in ("all_reduce", "reduce_scatter")}
    through.update(avg=(1000, 1000), future=(5, 5))
    for got in out:
        for name, (values_sent, values_received) in through.items():
            sent, received = got["moved"][name]
            assert sent >= 4 * values_sent and received >= 4 * values_received, (name, sent, received)
        for name in got["moved"].keys() - through.keys():
            assert got["moved"][name] == (0, 0), f"{name} went to the switch, not the fallback"
        assert got["moved"].keys() - through.keys() >= {"max", "f64", "broadcast", "objects", "barrier"}
    means = inputs(torch.float32, 1000, 99)
    assert np.allclose(out[0]["avg"], sum(m.numpy() for m in means) / WORLD, rtol=0, atol=1e-5)
    for got in out:
        assert got["job"] == out[0]["job"]
        assert got["max"] == [WORLD - 1.0, 0.0]
        assert got["f64"] == [sum(0.1 * (r + 1) for r in range(WORLD))] * 3  # float64's own sum: the fallback's
        assert got["broadcast"] == [WORLD - 1]
        assert got["objects"] == [{"rank": r} for r in range(WORLD)]
        assert got["future"] == [WORLD] * 5
    assert sw.jobs() == {}, "destroy_process_group removes the job"


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "compiled ddp"])
def test_training_through_the_backend_matches_gloo(switch, kind):
    """DDP with no comm hook, and FSDP2 whose reduce-scatter goes through the switch: gloo's losses,
    within the codec's error; an FSDP rank receives about 1/N of what it sends (its shard's sums)."""
    _, env = switch
    steps = 30
    gloo = spawn(dist_worker.train, env, "gloo", kind, steps)
    ours = spawn(dist_worker.train, env, "switchagg", kind, steps)
    gradient_bytes = 4 * (20 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4)
    for rank in range(WORLD):
        assert np.allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-4, atol=0)
        assert ours[rank]["losses"][-1] < ours[rank]["losses"][0] / 2
        sent, received = ours[rank]["sent"], ours[rank]["received"]
        assert sent > steps * gradient_bytes, "the gradients went through the switch"
        if kind != "fsdp":
            assert received > 0.9 * sent
        else:
            assert received < 0.8 * sent, (sent, received)


def test_fsdp_keeps_its_group_and_sums_through_a_switch_group_beside_it(switch):
    """set_custom_reduce_scatter: FSDP2 over gloo, its gradient shards summed by the switch."""
    _, env = switch
    steps = 20
    gloo = spawn(dist_worker.train, env, "gloo", "fsdp", steps)
    ours = spawn(dist_worker.fsdp_custom, env, steps)
    for rank in range(WORLD):
        assert np.allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-4, atol=0)
        assert ours[rank]["sent"] > steps * 4 * (20 * 64 + 64 * 64 + 64 * 4), "the shards went through the switch"
        assert ours[rank]["received"] < 0.8 * ours[rank]["sent"]


def test_calls_to_the_fallback_never_deadlock_with_gloo_s_worker_thread(switch):
    """torch issues a Python group's inherited collectives holding the GIL, which gloo's worker thread
    needs to free a finished broadcast while it holds the lock the issue takes (group.py)."""
    _, env = switch
    out = spawn(dist_worker.fallback_calls, env, 2000, timeout=120)
    assert out == [{"rounds": 2000, "last": WORLD - 1}] * WORLD


def test_options_need_the_switch_and_check_what_they_are_given():
    with pytest.raises(ConfigError, match="SWITCHAGG_SWITCH"):
        Options.from_env({})
    with pytest.raises(ConfigError, match="SWITCHAGG_VALUES_PER_PACKET = 'many'"):
        Options.from_env({ENV["switch"]: "127.0.0.1:1", ENV["values_per_packet"]: "many"})
    with pytest.raises(ConfigError, match="SWITCHAGG_ALL_GATHER"):
        Options.from_env({ENV["switch"]: "127.0.0.1:1", ENV["all_gather"]: "sometimes"})
    opts = Options.from_env({ENV["switch"]: "127.0.0.1:1", ENV["values_per_packet"]: "256", ENV["slot_count"]: "8"})
    assert (opts.values_per_packet, opts.slots, opts.target) == (256, 8, "soft")


def test_two_groups_on_one_switch_are_two_jobs(switch):
    sw, env = switch
    out = spawn(dist_worker.two_groups, env)
    triangle = WORLD * (WORLD + 1) // 2
    for got in out:
        assert got["jobs"] == out[0]["jobs"] and got["jobs"][0] != got["jobs"][1]
        assert (got["a"], got["b"]) == ([triangle], [100 * triangle])
    assert sw.jobs() == {}


def test_no_switch_is_an_error_on_every_rank_at_init():
    (control, udp) = free_ports(2)
    env = {ENV["switch"]: f"127.0.0.1:{udp}", ENV["control"]: f"127.0.0.1:{control}"}
    out = spawn(dist_worker.init_only, env)
    for got in out:
        assert got["error"].startswith("SwitchAggError: switchagg cannot start this process group")
        assert f"127.0.0.1:{control}" in got["error"], got["error"]


def test_a_refused_job_is_an_error_on_every_rank_at_init(switch):
    sw, env = switch
    out = spawn(dist_worker.init_only, {**env, ENV["slot_count"]: str(NUM_SLOTS + 1)})
    for got in out:
        assert "could not deploy" in got["error"] and "slots" in got["error"], got["error"]
    assert sw.jobs() == {}


def test_a_switch_that_does_not_answer_is_an_error_on_every_rank_and_leaves_no_job(switch):
    sw, env = switch
    (elsewhere,) = free_ports(1)
    out = spawn(dist_worker.init_only, {**env, ENV["switch"]: f"127.0.0.1:{elsewhere}", ENV["start_timeout"]: "1"})
    for got in out:
        assert got["error"].startswith("SwitchAggError: switchagg cannot start this process group"), got["error"]
    assert sw.jobs() == {}


def test_the_demo_trains_through_the_backend_next_to_gloo(capsys):
    from switchagg.ddp_demo import run_training_demo

    assert run_training_demo(workers=2, steps=3) == 0
    out = capsys.readouterr().out
    assert 'init_process_group("switchagg") against gloo' in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2] and all(len(r) == 3 for r in rows)


def _until(condition: Callable[[], bool], what: str, within: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail saying ``what`` did not happen once ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {within:g} s"
        time.sleep(0.05)


def _line(proc: subprocess.Popen, within: float = 120.0) -> str:
    """The next line ``proc`` writes on stdout, failing if none comes within ``within`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], within)
    assert ready, f"rank (pid {proc.pid}) said nothing within {within:g} s"
    return proc.stdout.readline().decode()


def test_a_program_killed_with_sigkill_leaves_no_job_once_its_lease_lapses(switch, tmp_path):
    """A program of two ranks forms a group and is SIGKILLed whole (no destroy, no atexit): rank 0 renewed
    the job while the program lived (it outlived its lease), and the switch removes it once the lease
    lapses unrenewed."""
    sw, env = switch
    (port,) = free_ports(1, socket.SOCK_STREAM)
    lease = 2.0
    environ = {**os.environ, **env, ENV["lease"]: str(lease),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    code = f"import sys; from tests import dist_worker; dist_worker.hold(int(sys.argv[1]), {WORLD}, {port})"
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(WORLD):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code, str(rank)], env=environ, stdout=subprocess.PIPE,
                stderr=(tmp_path / f"rank{rank}.err").open("wb"),
                process_group=0 if rank == 0 else procs[0].pid))
        lines = [_line(p) for p in procs]
        assert len(set(lines)) == 1 and lines[0].startswith("formed job"), lines
        (job_id,) = sw.jobs()
        assert sw.leases()[job_id][0] == lease and sw.owners()[job_id][1] == procs[0].pid
        _until(lambda: sw.lease_counters()["renewed"] > RENEWALS_PER_LEASE or job_id not in sw.jobs(),
               "rank 0 renewed the lease")
        assert job_id in sw.jobs(), "renewed, the job outlives its lease"
    finally:
        if procs:
            os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs:
            p.wait(30)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * WORLD
    _until(lambda: sw.jobs() == {}, "the killed program's job was removed once its lease lapsed")
    assert sw.lease_counters()["expired"] == 1, "removed by its lease, not by the program"


class _NoLeases(Target):
    """A target that keeps no leases, as the P4 ones: it refuses one before it changes anything."""

    name, summary = "no-leases", "a test's"

    def __init__(self) -> None:
        self.deployed: list[int] = []

    @classmethod
    def open(cls, options):
        return cls()

    def deploy(self, job, lease=None):
        if lease is not None:
            raise UnsupportedOperation(self._no_leases())
        self.deployed.append(job.job_id)
        return 1

    def undeploy(self, job_id):
        raise NotImplementedError

    def reset(self, job_id):
        raise NotImplementedError

    def status(self, job_id):
        raise NotImplementedError


def test_the_lease_is_an_option_and_a_target_without_leases_gets_the_job_without_one():
    options = Options.from_env({ENV["switch"]: "127.0.0.1:1", ENV["lease"]: "2.5"})
    assert (options.lease, Options(switch="127.0.0.1:1").lease) == (2.5, 10.0)
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(ConfigError, match="SWITCHAGG_LEASE"):
            Options.from_env({ENV["switch"]: "127.0.0.1:1", ENV["lease"]: bad})
    target, cfg = _NoLeases(), loopback_job(2, switch_port=1)
    _deploy_leased(target, cfg, options)
    assert target.deployed == [cfg.job_id]
    with pytest.raises(UnsupportedOperation, match="keeps no leases: its control plane runs no timer"):
        target.renew(cfg.job_id)
