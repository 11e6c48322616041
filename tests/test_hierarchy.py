"""A node's ranks reduce locally first, one switch job per rail (NCCL CollNet's shape), and groups share
the switch's slots: the layout, the slot fitting, and whole groups in spawned processes whose
``SWITCHAGG_NODE`` puts them on nodes."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from switchagg import SoftSwitch
from switchagg.distributed.topology import Layout, node_identity
from switchagg.errors import ConfigError
from switchagg.jobs import MIN_SHARED_SLOTS, fit_jobs
from switchagg.loopback import free_ports
from tests import dist_worker
from tests.test_distributed import inputs, spawn, switch  # noqa: F401 - the fixture

# ---- the layout ----------------------------------------------------------------------------------


def test_ranks_on_nodes_of_equal_width_make_one_job_per_rail():
    layout = Layout.of(["b", "a", "b", "a", "c", "c"])  # nodes in the order of their lowest rank
    assert layout.nodes == ((0, 2), (1, 3), (4, 5))
    assert layout.jobs == ((0, 1, 4), (2, 3, 5)) and layout.hierarchical
    assert [layout.place(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    assert layout.node_of(3) == (1, 3)
    assert Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize("names", [["a"] * 5, list("abcde"), list("aabbb")])
def test_one_node_a_node_each_or_uneven_nodes_are_one_flat_job(names):
    layout = Layout.of(names)
    assert layout.jobs == (tuple(range(5)),) and not layout.hierarchical


def test_the_limits_name_the_way_around_them():
    assert Layout.of([str(r // 17) for r in range(34)]).jobs[16] == (16, 33)  # 34 ranks: 17 rails of 2 nodes
    with pytest.raises(ConfigError, match="33 ranks, more than the 32 workers.*one node.*torchrun --nnodes"):
        Layout.of(["a"] * 33)
    with pytest.raises(ConfigError, match="not the same number"):
        Layout.of(["a"] * 17 + ["b"] * 16 + ["c"])
    with pytest.raises(ConfigError, match="spans 33 nodes"):
        Layout.of([str(r // 2) for r in range(66)])


def test_the_node_is_the_option_then_torchruns_node_rank_then_the_host():
    assert node_identity("rack1/n7", {"GROUP_RANK": "3"}) == "rack1/n7"
    assert node_identity(None, {"GROUP_RANK": "3"}) != node_identity(None, {"GROUP_RANK": "4"})
    assert node_identity(None, {}) == socket.gethostname()


def test_options_give_each_rail_its_switch():
    from switchagg.distributed import Options

    opts = Options(switch="10.0.0.1:1,10.0.1.1:1", control="10.0.0.1:2,10.0.1.1:2")
    assert [(opts.rail(r).switch, opts.rail(r).control) for r in range(3)] == [
        ("10.0.0.1:1", "10.0.0.1:2"), ("10.0.1.1:1", "10.0.1.1:2"), ("10.0.0.1:1", "10.0.0.1:2")]
    assert Options(switch="10.0.0.1:1,10.0.1.1:1", control="10.0.0.9:2").rail(1).control == "10.0.0.9:2"
    with pytest.raises(ConfigError, match="one per switch"):
        Options(switch="10.0.0.1:1,10.0.1.1:1", control="a:1,b:2,c:3")
    with pytest.raises(ConfigError, match="one per rail"):
        Options(switch="10.0.0.1:1,")


# ---- sharing the pool ----------------------------------------------------------------------------


def test_jobs_take_a_window_while_as_much_stays_free_then_halve_then_fall_back():
    installed: dict[int, tuple[int, int]] = {}
    sizes = []
    while (fit := fit_jobs(installed, 4096, 1, 1024)) is not None:
        size, (base,) = fit
        assert all(base + size <= b or b + n <= base for b, n in installed.values()), "no overlap"
        installed[len(installed)] = (base, size)
        sizes.append(size)
    assert sizes == [1024, 1024, 1024, 512, 256, 128, 64, 32, 16, 16]
    assert sum(sizes) == 4096 and sizes[-1] == MIN_SHARED_SLOTS


def test_a_shared_job_is_never_shrunk_below_its_own_floor():
    """A job of many ranks needs two blocks of its call round's chunks (JobConfig.least_slots: 512 ranks of
    K = 64 take 16 a block, 32 in all); shrunk to the pool's floor of 16 it would be refused by its own config,
    so the pool sizes it no smaller than its floor, and where that does not fit it falls back."""
    from switchagg.config import Endpoint, JobConfig, WorkerSpec

    wide = JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 1024, 64,
                     tuple(WorkerSpec(Endpoint("127.0.0.1", 1000 + r)) for r in range(8)), tree_size=512)
    assert wide.least_slots == 32 > MIN_SHARED_SLOTS
    assert fit_jobs({1: (0, 4060)}, 4096, 1, 1024) == (16, [4060])  # unfloored: what leaves as many free
    assert fit_jobs({1: (0, 4060)}, 4096, 1, 1024, least=wide.least_slots) == (32, [4060])
    assert fit_jobs({1: (0, 4070)}, 4096, 1, 1024, least=wide.least_slots) is None


def test_rails_share_the_pool_evenly_and_a_given_count_is_not_shrunk():
    size, bases = fit_jobs({1: (0, 100)}, 4096, 17, 1024)
    assert size == 64 and len(set(bases)) == 17 and min(bases) >= 100
    assert fit_jobs({1: (0, 4000)}, 4096, 1, 1024, shrink=False) is None
    assert fit_jobs({1: (0, 3000)}, 4096, 1, 1024, shrink=False) == (1024, [3000])
    assert fit_jobs({1: (0, 16)}, 1024, 2, 1024, max_jobs=2) is None  # the job table is full


# ---- whole groups --------------------------------------------------------------------------------


def _nodes(env: dict[str, str], node_of: list[int]) -> list[dict[str, str]]:
    return [{**env, "SWITCHAGG_NODE": f"node{n}"} for n in node_of]


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 1, 0, 1]], ids=["contiguous", "interleaved"])
def test_a_group_on_two_nodes_sums_through_one_job_per_rail(switch, node_of):  # noqa: F811
    sw, env = switch
    world, sizes = 4, [1, 5, 1000, 4097]
    out = spawn(dist_worker.hierarchical, _nodes(env, node_of), sizes, world=world)
    nodes = tuple(tuple(r for r in range(world) if node_of[r] == n) for n in (0, 1))
    assert out[0]["layout"] == {"nodes": [list(n) for n in nodes], "jobs": [[nodes[0][0], nodes[1][0]],
                                                                            [nodes[0][1], nodes[1][1]]]}
    assert [len(j) for j in out[0]["switch_jobs"]] == [2] and {o["workers"] for o in out} == {2}, "a rail a job"
    assert len({o["job"] for o in out}) == 2
    for i, n in enumerate(sizes):
        for dtype in (torch.int32, torch.float32, torch.float16, torch.bfloat16):
            xs = [x.float().numpy().astype(np.float64) for x in inputs(dtype, n * world, i, world)]
            total = sum(xs)
            for rank, got in enumerate(out):
                reduced, shard = got[f"all_reduce {dtype} {n}"], got[f"reduce_scatter {dtype} {n}"]
                mine = total[rank * n:(rank + 1) * n]
                if dtype == torch.int32:
                    assert np.array_equal(reduced, total[:n]) and np.array_equal(shard, mine)
                    continue
                # The codec's bound over the 2 nodes' exact partial sums, then the dtype's own rounding
                partial = max(np.abs(sum(xs[r] for r in node)).max() for node in nodes)
                eps = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
                bound = 2 * partial * 2.0 ** -22 + np.abs(total).max() * eps
                assert np.abs(reduced - total[:n]).max() <= bound, (dtype, n)
                assert np.abs(shard - mine).max() <= bound, (dtype, n)
    means = sum(m.numpy().astype(np.float64) for m in inputs(torch.float32, 1000, 99, world)) / world
    avg_rows = sum(m.numpy().astype(np.float64) for m in inputs(torch.float32, 10 * world, 98, world)) / world
    for rank, got in enumerate(out):
        assert np.abs(got["avg"] - means).max() < 1e-4
        assert np.abs(got["avg_shard"] - avg_rows[rank * 10:(rank + 1) * 10]).max() < 1e-4
        assert got["in_flight"] == [sum(range(world)) + world * i for i in range(6)]
        assert got["max"] == world - 1
        assert got["sent"] > 4 * 4097 * 3 / 2, "each rank sent about its shard of every call through the switch"
    assert sw.jobs() == {}, "destroy_process_group removes every rail's job"


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 0, 0, 0]], ids=["two nodes", "flat"])
def test_a_failed_call_raises_on_every_rank_and_the_next_call_is_paired(switch, node_of):  # noqa: F811
    """``dist.all_reduce`` raises the call's error (torch's own Work over a Future would not); with two
    nodes, rank 3 fails its own call, rank 1 (its rail's other worker) learns it from the switch's call
    round, and ranks 0 and 2, whose rail summed fine, from their node's gather."""
    _, env = switch
    hierarchical = node_of == [0, 0, 1, 1]
    out = spawn(dist_worker.failing_rail, _nodes(env, node_of), hierarchical, world=4)
    last = ["ValueError", "RuntimeError" if hierarchical else "ValueError"]
    assert [o["errors"] for o in out] == [["PeerFailed"] * 2, ["PeerFailed"] * 2, ["PeerFailed"] * 2, last], out
    for o in out:
        assert o["after"] == [4] * 10 and o["nan"] and o["finite"] == 4.0


def test_two_hundred_live_groups_share_the_switch_and_every_sum_is_right(switch):  # noqa: F811
    """torch programs make many groups (DeviceMesh, HSDP, new_subgroups): the first take the switch's
    slots as they share them, the rest sum through the fallback; none fails."""
    sw, env = switch
    out = spawn(dist_worker.many_groups, env, 200, timeout=600)
    assert sw.jobs() == {}
    for got in out:
        assert got["sums"] == [[3 * (i + 1)] for i in range(200)]
    on_switch = [p for p in out[0]["places"][:200] if p is not None]
    assert len(on_switch) == 9 and sum(n for _, n in on_switch) == 4096 - 1024, on_switch  # the world has 1024


def test_groups_share_the_switch_and_those_that_find_it_full_sum_through_the_fallback():
    (control,) = free_ports(1, socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control), num_slots=256) as sw:
        env = {"SWITCHAGG_SWITCH": f"127.0.0.1:{sw.address[1]}", "SWITCHAGG_CONTROL": f"127.0.0.1:{control}"}
        out = spawn(dist_worker.many_groups, env, 6)
        assert sw.jobs() == {}
    for got in out:
        assert got["sums"] == [[3 * (i + 1)] for i in range(6)], "every group's sums are right, on the switch or not"
    places = out[0]["places"]
    on_switch = [p for p in places[:6] if p is not None]
    # The world group took 128 of the 256 slots; each group after it half of what was left, down to 16
    assert [n for _, n in on_switch] == [64, 32, 16, 16] and places[4:6] == [None] * 2, places
    assert "one rank" in places[6]


def test_hsdp_on_a_2d_mesh_sums_through_the_switch_on_both_dimensions(switch):  # noqa: F811
    """DeviceMesh makes a subgroup per row and column, each a job of its own beside the world's."""
    _, env = switch
    gloo = spawn(dist_worker.hsdp, env, "gloo", 10, world=4)
    ours = spawn(dist_worker.hsdp, env, "switchagg", 10, world=4)
    for rank in range(4):
        assert np.allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-4, atol=0)
        assert ours[rank]["sent"] > 10 * 4 * (20 * 64 + 64 * 4) / 2, "the shards went through the switch"


def test_each_rail_may_have_a_switch_of_its_own(switch):  # noqa: F811
    """Nodes with a NIC per rail: SWITCHAGG_SWITCH and SWITCHAGG_CONTROL list one address per rail."""
    first, env = switch
    (control,) = free_ports(1, socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control)) as second:
        env = {"SWITCHAGG_SWITCH": f"{env['SWITCHAGG_SWITCH']},127.0.0.1:{second.address[1]}",
               "SWITCHAGG_CONTROL": f"{env['SWITCHAGG_CONTROL']},127.0.0.1:{control}"}
        out = spawn(dist_worker.hierarchical, _nodes(env, [0, 0, 1, 1]), [1000], world=4)
        assert second.jobs() == {}
    assert [len(j) for j in out[0]["switch_jobs"]] == [1, 1], "rail 0's job on the first switch, rail 1's on the second"
    total = sum(x.numpy().astype(np.int64) for x in inputs(torch.int32, 4000, 0, 4))
    assert all(np.array_equal(o["all_reduce torch.int32 1000"], total[:1000]) for o in out)
    assert first.jobs() == {}
