"""Trees (docs/protocol.md section 10) end to end in the simulated network: hosts under leaf switches under a
spine, loss and duplication on every hop, both implementations of the worker's state machine. A tree's sums
are the flat job's of the same ranks, bit for bit: the same integer sum, under the same exponents and headroom.
"""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from switchagg import Client, ConfigError, JobConfig, SoftSwitch, StallError
from switchagg.__main__ import main
from switchagg.config import ParentSpec, parse_toml
from switchagg.errors import CallMismatch, PeerFailed
from switchagg.loopback import free_ports
from switchagg.switch.model import SwitchModel
from switchagg.tree import TreeConfig
from switchagg.wire import unpack_header

from .conftest import run_ranks
from .simnet import IMPLEMENTATIONS, Impairment, Job, SimNet, Worker, tree

LOSSY = {"lossless": Impairment(), "lossy": Impairment(loss=0.05, dup=0.01, jitter=0.0005)}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request) -> str:
    return request.param


def inputs(n: int, size: int, dtype, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-(2**31), 2**31, size, dtype=np.int64).astype(np.int32) for _ in range(n)]
    return [(rng.standard_normal(size) * 10 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(n)]


def run(net: SimNet, workers, xs, collective: str = "allreduce") -> list[np.ndarray]:
    for w, x in zip(workers, xs, strict=True):
        net.start(w, x, collective=collective)
    net.run()
    for w in workers:
        assert w.error is None, w.error
        assert w.red.done
    return [w.out.copy() for w in workers]


def flat(xs, k: int, impl: str, collective: str = "allreduce") -> list[np.ndarray]:
    """The same call on one switch's flat job of every rank, lossless."""
    job = Job(n=len(xs), k=k)
    model = SwitchModel(64)
    model.add_job(job.entry())
    net = SimNet(model, impl=impl)
    return run(net, [net.add_worker(job, r) for r in range(job.n)], xs, collective)


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
@pytest.mark.parametrize("links", sorted(LOSSY))
def test_two_leaves_and_a_spine_sum_as_a_flat_job_does(impl, dtype, links):
    switches: dict = {}
    t = tree(switches, leaves=2, per_leaf=4, k=64)
    net = SimNet(None, LOSSY[links], LOSSY[links], seed=5, impl=impl, switches=switches)
    workers = net.add_tree_workers(t)
    xs = inputs(8, 64 * 9 + 5, dtype)
    got = run(net, workers, xs)
    want = flat(xs, 64, impl)
    for r, out in enumerate(got):
        assert out.tobytes() == want[r].tobytes(), f"rank {r}"
    if dtype == np.int32:
        assert got[0].tolist() == np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32).tolist()
    spine = switches[t.spine].counters()["jobs"][t.spine_entry.job_id]
    leaves = [switches[at].counters()["jobs"][job.job_id] for at, job in zip(t.leaves, t.jobs, strict=True)]
    assert spine["results_multicast"] >= 11 and all(c["partials_up"] == spine["results_multicast"] for c in leaves)
    assert all(c["results_from_parent"] == c["partials_up"] for c in leaves)
    if links == "lossy":
        assert net.dropped > 0 and sum(c["partials_resent"] + c["results_unicast"] for c in leaves) > 0


def test_a_reduce_scatter_in_a_tree_gives_each_rank_its_shard_whole_down_its_branch_alone(impl):
    switches: dict = {}
    t = tree(switches, leaves=3, per_leaf=2, k=16)
    net = SimNet(None, LOSSY["lossy"], LOSSY["lossy"], seed=8, impl=impl, switches=switches)
    workers = net.add_tree_workers(t)
    xs = inputs(6, 6 * 40, np.float32)
    got = run(net, workers, xs, "reduce_scatter")
    want = flat(xs, 16, impl, "reduce_scatter")
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    spine = switches[t.spine].counters()["jobs"][t.spine_entry.job_id]
    assert spine["results_to_owner"] > 0


def test_a_stalled_parent_stalls_every_rank_with_no_partial_handed_out(impl):
    """A spine that never answers: every rank's call stops with an error, and no rank was given a leaf's
    partial sum as its result."""
    switches: dict = {}
    t = tree(switches, leaves=2, per_leaf=2, k=16)
    switches.pop(t.spine)  # its address now leads nowhere: what is sent there is lost
    net = SimNet(None, impl=impl, switches=switches)
    workers = net.add_tree_workers(t)
    for w, x in zip(workers, inputs(4, 40, np.int32), strict=True):
        net.start(w, x, progress_timeout=2.0)
        w.out[:] = 0
    net.run()
    assert all(w.error is not None for w in workers)
    assert all(not w.out.any() for w in workers)


def only_call_rounds_went(net: SimNet) -> bool:
    """Whether every packet the workers sent in their first call was of its call round (ids from 0)."""
    return all(unpack_header(p).chunk < net.workers[at].red.rounds for _, at, p in net.sent_log)


def wide_tree(impl: str, links: str) -> tuple[SimNet, list[Worker]]:
    """32 ranks under 4 leaves at K = 16, 8 slots: the call round's descriptors are 4 chunks, entry j carrying
    those of ranks [8 j, 8 j + 8), so a call round is at least 4 entries."""
    switches: dict = {}
    t = tree(switches, leaves=4, per_leaf=8, k=16, slots=8)
    net = SimNet(None, LOSSY[links], LOSSY[links], seed=3, impl=impl, switches=switches)
    return net, net.add_tree_workers(t)


def paired_after(net: SimNet, workers: list[Worker]) -> None:
    """The calls after one that the call round stopped stay paired: the same call on every rank sums exactly."""
    xs = inputs(len(workers), 16 * 5 + 3, np.int32, seed=4)
    want = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32)
    assert all(np.array_equal(out, want) for out in run(net, workers, xs))


@pytest.mark.parametrize("links", sorted(LOSSY))
def test_a_call_that_differs_on_one_rank_of_more_than_a_chunk_holds_raises_alike_on_every_rank(impl, links):
    """Rank 21, whose descriptor is in the call round's third chunk, calls with 96 values where the others
    call with 32: the first two chunks' sums are what every other rank expects, so a rank that sent data once
    its slot's entry matched would sum a mismatched call. Every rank reads every chunk's sum before it
    decides: no data goes, every rank raises the same CallMismatch naming both calls and takes the same ids
    and slot copies as used (rank 21's call round, 6 entries), and the next call sums exactly."""
    net, workers = wide_tree(impl, links)
    xs = inputs(32, 16 * 2, np.int32)  # 2 chunks: a call round of 4 entries, the descriptors'
    xs[21] = inputs(1, 16 * 6, np.int32)[0]  # 6 chunks: 6 entries
    for w, x in zip(workers, xs, strict=True):
        net.start(w, x)
    net.run()
    assert all(w.error is None and w.red.done for w in workers)
    assert len({w.red.mismatch for w in workers} - {None}) == 1
    assert only_call_rounds_went(net)
    errors = [net.finish(w) for w in workers]
    assert all(isinstance(e, CallMismatch) for e in errors) and len({str(e) for e in errors}) == 1
    assert "rank 20: call #0: 32 int32 values" in str(errors[0]) and "rank 21: call #0: 96 int32" in str(errors[0])
    assert {w.next_id for w in workers} == {6}
    paired_after(net, workers)


@pytest.mark.parametrize("links", sorted(LOSSY))
def test_a_rank_that_fails_a_call_among_more_ranks_than_a_chunk_holds_fails_it_on_every_rank(impl, links):
    """Rank 29 (the call round's last chunk) could not reduce its input: its descriptor says so, and every
    other rank raises the same PeerFailed naming it, no rank having sent data; the next call sums exactly."""
    net, workers = wide_tree(impl, links)
    for w, x in zip(workers, inputs(32, 16 * 3, np.int32), strict=True):
        net.start(w, x, failed=w is workers[29])
    net.run()
    assert all(w.error is None and w.red.done for w in workers)
    assert only_call_rounds_went(net)
    errors = [net.finish(w) for w in workers]
    assert errors[29] is None  # it raises its own error
    others = errors[:29] + errors[30:]
    assert all(isinstance(e, PeerFailed) for e in others) and {str(e) for e in others} == {str(others[0])}
    assert "rank(s) [29]" in str(others[0])
    assert {w.next_id for w in workers} == {4}
    paired_after(net, workers)


STRAGGLE = 0.02  # s: how late the stragglers of big_trees' first call start


def big_trees(loss: Impairment, xs, ys, k: int, slots: int) -> list[float]:
    """32 leaves of 32 workers and a tree of 4 x 8 on the same spine (slots of its own) summing ``xs`` and
    ``ys`` twice under ``loss`` on every hop; checks every rank's sums and returns each call's simulated time
    (the first starts cold, with no round trip known, and waits for stragglers; the second runs on what the
    first taught)."""
    switches: dict = {}
    big = tree(switches, leaves=32, per_leaf=32, k=k, slots=slots, ask_first=True)
    small = tree(switches, leaves=4, per_leaf=8, k=64, slots=8, slot_base=slots, spine_job=101, first_leaf_job=33,
                 leaf_net=2, ask_first=True)
    net = SimNet(None, loss, loss, seed=11, impl="native", switches=switches)
    big_workers, small_workers = net.add_tree_workers(big), net.add_tree_workers(small)
    times = []
    late = set(range(5, 1024, 97))  # stragglers: in the first call, these ranks start 20 ms after the rest
    for call in range(2):
        start = net.now
        workers = list(zip(big_workers + small_workers, xs + ys, strict=True))
        for rank, (w, x) in enumerate(workers):
            if not (call == 0 and rank in late):
                net.start(w, x)
        if call == 0:
            net.run(until=start + STRAGGLE)
            assert not any(w.red.done for w in big_workers if w.red), "no sum finishes while ranks are missing"
            for rank in late:
                net.start(*workers[rank])
        net.run()
        times.append(net.now - start)
        for workers, data in ((big_workers, xs), (small_workers, ys)):
            want = np.sum(np.stack(data).astype(np.int64), axis=0).astype(np.int32)
            for w in workers:
                assert w.error is None and w.red.done, w.error
                assert np.array_equal(w.out, want)
    assert (net.dropped > 100) == (loss.loss > 0)
    return times


def flat_job(loss: Impairment, xs, k: int, slots: int) -> list[float]:
    """The same calls on one switch's job of 32 workers: each call's simulated time."""
    job = Job(n=32, k=k, slots=slots, ask_first=True)
    model = SwitchModel(64)
    model.add_job(job.entry())
    net = SimNet(model, loss, loss, seed=11, impl="native")
    workers = [net.add_worker(job, r) for r in range(32)]
    times = []
    for _ in range(2):
        start = net.now
        run(net, workers, xs[:32])
        times.append(net.now - start)
    return times


def test_1024_workers_under_loss_on_every_hop_sum_exactly_beside_a_second_tree_on_the_spine(capsys):
    """32 leaves of 32 workers at 1% loss on every hop, beside a tree of 4 x 8 on the same spine: every rank of
    both gets the exact int32 sum, twice. At the P4 switch's K = 64 the call round's descriptors, 2 words a
    rank, are 32 chunks: its first 32 entries, on 32 of the 48 slots. Prints the simulated call times against a
    flat job of 32 workers."""
    k, slots = 64, 48  # the spine's pool of 64 slots holds the small tree's 8 too
    xs, ys = inputs(1024, 3 * k, np.int32, seed=12), inputs(32, 64 * 5, np.int32, seed=13)
    loss, lossless = Impairment(loss=0.01, jitter=0.0002), Impairment(jitter=0.0002)
    times = {"tree at 1%": big_trees(loss, xs, ys, k, slots), "tree lossless": big_trees(lossless, xs, ys, k, slots),
             "flat at 1%": flat_job(loss, xs, k, slots), "flat lossless": flat_job(lossless, xs, k, slots)}
    print("simulated ms per call (first, second): " + ", ".join(
        f"{name} {first * 1e3:.1f} {second * 1e3:.1f}" for name, (first, second) in times.items()))
    for i, call in enumerate(("first", "second")):
        print(f"{call} call: tree over flat {times['tree at 1%'][i] / times['flat at 1%'][i]:.2f}x at 1%, "
              f"{times['tree lossless'][i] / times['flat lossless'][i]:.2f}x lossless")


def tree_file(per_leaf: int, leaves: int = 2, k: int = 64, slots: int = 16) -> str:
    """A tree file for a spine and ``leaves`` leaves on loopback, their control ports and workers on free ports."""
    udp, tcp = free_ports(1 + leaves + leaves * per_leaf), free_ports(1 + leaves, socket.SOCK_STREAM)
    workers = iter(udp[1 + leaves:])
    text = (f"[job]\nid = 3\nkey = 0x7ee\nslot_count = {slots}\nvalues_per_packet = {k}\n\n"
            f'[spine]\naddress = "127.0.0.1:{udp[0]}"\ncontrol = "127.0.0.1:{tcp[0]}"\n')
    for leaf in range(leaves):
        names = ", ".join(f'"127.0.0.1:{next(workers)}"' for _ in range(per_leaf))
        text += (f'\n[[leaves]]\naddress = "127.0.0.1:{udp[1 + leaf]}"\ncontrol = "127.0.0.1:{tcp[1 + leaf]}"\n'
                 f"workers = [{names}]\n")
    return text


def test_a_tree_file_gives_every_switch_its_job_and_every_worker_its_leaf(tmp_path):
    path = tmp_path / "tree.toml"
    path.write_text(tree_file(per_leaf=3, leaves=2))
    t = TreeConfig.from_file(path)
    spine, *leaves = t.switch_jobs()
    assert t.ranks == 6 and spine.switch == t.spine and [w.address for w in spine.workers] == [
        leaf.address for leaf in t.leaves]
    assert spine.spans == (3, 3) and spine.parent is None and spine.tree_size == 6
    for i, leaf in enumerate(leaves):
        assert leaf.parent == ParentSpec(t.spine, 3, i, 0x7EE) and leaf.rank_base == 3 * i and leaf.ranks == 6
        assert JobConfig.from_toml(leaf.to_toml()) == leaf  # what deploy sends the switch reads back the same
    assert JobConfig.from_toml(spine.to_toml()) == spine
    cfg, local = t.worker(4)
    assert cfg == leaves[1] and local == 1 and cfg.rank_of(local) == 4


P4_TREE = """[job]
id = 5
key = 0x7ee
slot_count = 16

[spine]
address = "10.80.0.254:16711"
control = "127.0.0.1:9600"
mac = "02:5a:00:00:50:fe"

[[leaves]]
address = "10.81.0.254:16711"
control = "127.0.0.1:9601"
mac = "02:5a:00:00:51:fe"
uplink_port = 2
spine_port = 0
workers = [{ address = "10.81.0.1:40005", mac = "02:5a:00:00:51:01", switch_port = 0 },
           { address = "10.81.0.2:40005", mac = "02:5a:00:00:51:02", switch_port = 1 }]

[[leaves]]
address = "10.82.0.254:16711"
control = "127.0.0.1:9602"
mac = "02:5a:00:00:52:fe"
uplink_port = 1
spine_port = 1
workers = [{ address = "10.82.0.1:40005", mac = "02:5a:00:00:52:01", switch_port = 0 }]
"""


def test_a_tree_file_for_p4_switches_gives_every_level_its_links_and_its_p4runtime_address():
    """Each leaf is the spine's worker at its own Ethernet address and spine port, each leaf's parent the spine at
    the spine's address through the leaf's uplink port; the workers are tables as a job file's; BMv2 reaches each
    level at its control address."""
    from switchagg.targets import TargetOptions, open_target, p4job

    spine, *leaves = TreeConfig.from_dict(parse_toml(P4_TREE, "the tree")).switch_jobs()
    assert [(w.mac, w.switch_port) for w in spine.workers] == [("02:5a:00:00:51:fe", 0), ("02:5a:00:00:52:fe", 1)]
    assert [(leaf.parent.mac, leaf.parent.switch_port) for leaf in leaves] == [("02:5a:00:00:50:fe", 2),
                                                                              ("02:5a:00:00:50:fe", 1)]
    assert [w.switch_port for w in leaves[0].workers] == [0, 1] and leaves[1].rank_base == 2
    for level in (spine, *leaves):
        p4job.check_config(level, trees=True)
        assert open_target("bmv2", TargetOptions(config=level)).grpc_addr == str(level.control)
    assert open_target("bmv2", TargetOptions(config=spine, address="127.0.0.1:1")).grpc_addr == "127.0.0.1:1"
    with pytest.raises(ConfigError, match=r"leaves\[1\].workers\[0\].switch_prt is not a known key"):
        TreeConfig.from_dict(parse_toml(P4_TREE.replace("switch_port = 0 }]", "switch_prt = 0 }]"), "the tree"))


def test_a_leaf_file_names_its_parents_link_for_a_p4_switch_and_a_bad_one_is_refused():
    text = tree_file(per_leaf=2, leaves=2)
    leaf = TreeConfig.from_dict(parse_toml(text, "the tree")).switch_jobs()[1]
    p4 = dataclasses.replace(leaf, parent=dataclasses.replace(leaf.parent, mac="02:00:00:00:00:09", switch_port=9))
    assert JobConfig.from_toml(p4.to_toml()) == p4 and 'mac = "02:00:00:00:00:09"' in p4.to_toml()
    for bad, says in (("mac = \"03:00:00:00:00:09\"", r"parent.mac = .* is a multicast address"),
                      ("switch_port = 512", r"parent.switch_port = 512")):
        with pytest.raises(ConfigError, match=says):
            JobConfig.from_toml(leaf.to_toml().replace("[parent]\n", f"[parent]\n{bad}\n"))


@pytest.mark.parametrize("change, says", [
    (lambda text: text.replace("[spine]", "[spin]"), r"\[spin\] is not a table of a tree file"),
    (lambda text: text.replace("workers = [", "worker = ["), "leaves\\[0\\].worker is not a known key"),
    (lambda text: text.replace("values_per_packet = 64", "values_per_packet = 4").replace("slot_count = 16",
                                                                                          "slot_count = 2"),
     "slot_count = 2 is below the 3 chunks of K = 4 values that two values per rank take for 6 ranks"),
    (lambda text: text + "\n[[leaves]]\naddress = \"127.0.0.1:1\"\nworkers = []\n", "list its workers"),
])
def test_a_tree_file_that_does_not_add_up_says_what_to_fix(change, says):
    with pytest.raises(ConfigError, match=says):
        TreeConfig.from_dict(parse_toml(change(tree_file(per_leaf=3, leaves=2)), "the tree"))


@pytest.mark.parametrize("k", [256, 4], ids=["ranks in a chunk", "ranks in two chunks"])
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_a_tree_of_embedded_switches_on_loopback_sums_as_one_switch_does(tmp_path, dtype, k, capsys):
    """A spine and two leaves, each an embedded switch with its control port, deployed from one tree file by
    `switchagg deploy` (every level under the spine's generation); four clients, two under each leaf, get the
    flat job's sums, bit for bit; `switchagg undeploy` removes the job from every switch. At K = 4 the four
    ranks' two words each (the join's, and every call round's) take two chunks."""
    path = tmp_path / "tree.toml"
    path.write_text(tree_file(per_leaf=2, leaves=2, k=k))
    t = TreeConfig.from_file(path)
    switches = [SoftSwitch(job.switch, control=job.control).start() for job in t.switch_jobs()]
    try:
        assert main(["deploy", "--config", str(path)]) == 0
        assert len({sw.model.jobs[3].generation for sw in switches}) == 1
        xs = inputs(4, 256 * 7 + 3, dtype)
        got = run_ranks(4, lambda r: once(*t.worker(r), xs[r]))
        for out in got:
            assert not isinstance(out, BaseException), out
        want = flat(xs, k, "native")
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
        counters = [sw.model.counters()["jobs"][3] for sw in switches]
        assert counters[0]["results_multicast"] > 0 and counters[0]["contributions"] == 2 * counters[0][
            "results_multicast"]
        assert all(c["partials_up"] == c["results_from_parent"] == counters[0]["results_multicast"]
                   for c in counters[1:])
        capsys.readouterr()
        assert main(["status", "--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.count("of the tree:") == 3 and "leaf 1 of the tree:" in out and "partials_up" in out
        assert main(["reset", "--config", str(path)]) == 1
        assert "reset of a tree: " in capsys.readouterr().err
        assert main(["undeploy", "--config", str(path)]) == 0
        assert all(not sw.model.jobs for sw in switches)
    finally:
        for sw in switches:
            sw.stop()
            assert sw.error is None


def test_a_tree_deploy_that_fails_at_a_level_leaves_no_level_behind_and_undeploy_skips_a_missing_one(tmp_path,
                                                                                                       capsys):
    """Leaf 1's switch is not there: `deploy` fails naming it, and the spine and leaf 0, deployed before it, are
    removed again; `undeploy` removes every level it reaches, says which it could not, and skips one that lacks
    the job."""
    path = tmp_path / "tree.toml"
    path.write_text(tree_file(per_leaf=2, leaves=2))
    t = TreeConfig.from_file(path)
    spine, leaf0, leaf1 = t.switch_jobs()
    switches = [SoftSwitch(job.switch, control=job.control).start() for job in (spine, leaf0)]
    try:
        assert main(["deploy", "--config", str(path)]) == 1
        assert str(t.leaves[1].control) in capsys.readouterr().err
        assert all(not sw.model.jobs for sw in switches)
        for sw, job in zip(switches, (spine, leaf0), strict=True):
            sw.add_job(job)
        assert main(["undeploy", "--config", str(path)]) == 1
        assert "1 level(s) of the tree could not be reached, the rest removed" in capsys.readouterr().err
        assert all(not sw.model.jobs for sw in switches)
        switches.append(SoftSwitch(leaf1.switch, control=leaf1.control).start())
        for sw, job in zip(switches[:2], (spine, leaf0), strict=True):
            sw.add_job(job)
        assert main(["undeploy", "--config", str(path)]) == 0
        out = capsys.readouterr().out
        assert all(not sw.model.jobs for sw in switches) and out.count("removed") == 2 and "skipped: " in out
        assert main(["undeploy", "--config", str(path)]) == 1  # nothing left: an error
        assert "no level of the tree was deployed" in capsys.readouterr().err
    finally:
        for sw in switches:
            sw.stop()


def test_a_tree_file_for_p4_switches_names_what_it_lacks_and_what_is_out_of_range(tmp_path, capsys):
    """Before any switch is touched (these P4Runtime addresses reach nothing)."""
    path = tmp_path / "tree.toml"
    path.write_text(P4_TREE.replace('uplink_port = 1\n', ''))
    assert main(["deploy", "--target", "bmv2", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "add leaves[1].uplink_port to" in err and "[spine] mac" not in err
    path.write_text(tree_file(per_leaf=1, leaves=2))
    assert main(["deploy", "--target", "bmv2", "--config", str(path)]) == 1
    assert "add [spine] mac, leaves[0].mac, leaves[0].uplink_port, leaves[0].spine_port, leaves[0].workers[0].mac, " \
           "leaves[0].workers[0].switch_port, leaves[1].mac" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"leaves\[0\].uplink_port = 512"):
        TreeConfig.from_dict(parse_toml(P4_TREE.replace("uplink_port = 2", "uplink_port = 512"), "the tree"))
    with pytest.raises(ConfigError, match=r"spine.mac = '03:5a:00:00:50:fe' is a multicast address"):
        TreeConfig.from_dict(parse_toml(P4_TREE.replace('"02:5a:00:00:50:fe"', '"03:5a:00:00:50:fe"'), "the tree"))


def test_switchagg_worker_takes_a_tree_file_and_a_rank_of_the_tree(tmp_path, capsys):
    """`switchagg worker --config tree.toml --rank R`: rank R of the tree under its leaf, each sum checked against
    every rank's input, of both leaves."""
    path = tmp_path / "tree.toml"
    path.write_text(tree_file(per_leaf=2, leaves=2))
    switches = [SoftSwitch(job.switch, control=job.control).start() for job in TreeConfig.from_file(path).switch_jobs()]
    try:
        assert main(["deploy", "--config", str(path)]) == 0
        codes = run_ranks(4, lambda r: main(["worker", "--config", str(path), "--rank", str(r), "--size", "3000",
                                             "--rounds", "2"]))
        assert codes == [0, 0, 0, 0]
        assert capsys.readouterr().out.count("within the bound") == 8
        assert all(sw.model.counters()["jobs"][3]["contributions"] for sw in switches)
    finally:
        for sw in switches:
            sw.stop()


def once(cfg, rank, x):
    with Client(cfg, rank) as c:
        return c.allreduce(x)


@pytest.mark.parametrize("dead", ["spine", "leaf 1"])
def test_a_dead_switch_of_a_tree_stops_every_rank_naming_what_it_waits_for(tmp_path, dead, capsys):
    """After a call that works, a switch of the tree stops: every rank's next call raises within its stall
    timeout, no rank gets a partial sum, and the ranks under a live leaf are told that their leaf holds every
    contribution and waits for the spine."""
    path = tmp_path / "tree.toml"
    path.write_text(tree_file(per_leaf=2, leaves=2, k=64))
    t = TreeConfig.from_file(path)
    switches = [SoftSwitch(job.switch, control=job.control).start() for job in t.switch_jobs()]
    clients = [Client(*t.worker(r), stall_timeout=1.0) for r in range(4)]
    try:
        assert main(["deploy", "--config", str(path)]) == 0
        xs = inputs(4, 200, np.int32)
        assert all(np.array_equal(o, sum(xs)) for o in run_ranks(4, lambda r: clients[r].allreduce(xs[r])))
        switches[0 if dead == "spine" else 2].stop()
        outs = [np.full(200, 7, np.int32) for _ in range(4)]
        got = run_ranks(4, lambda r: clients[r].allreduce(xs[r], out=outs[r]))
        assert all(isinstance(g, StallError) for g in got), got
        assert all((o == 7).all() for o in outs)  # nothing was written: no partial handed out
        live = [0, 1] if dead == "leaf 1" else [0, 1, 2, 3]
        for r in live:
            assert f"wait for the sums of the parent switch at {t.spine}" in str(got[r]), got[r]
        if dead == "leaf 1":
            assert all("control port did not answer" in str(got[r]) for r in (2, 3))
    finally:
        for c in clients:
            c.close()
        for sw in switches:
            sw.stop()


@pytest.fixture
def torch_tree():
    """A spine and two leaves, embedded switches with control ports, and each rank's SWITCHAGG_* variables:
    ranks 0 and 1 reach leaf 0, ranks 2 and 3 leaf 1, and SWITCHAGG_ROOT names the spine."""
    pytest.importorskip("torch")
    controls = free_ports(3, socket.SOCK_STREAM)
    switches = [SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", c)).start() for c in controls]
    spine = {"SWITCHAGG_ROOT": f"127.0.0.1:{switches[0].address[1]}",
             "SWITCHAGG_ROOT_CONTROL": f"127.0.0.1:{controls[0]}"}
    env = [{**spine, "SWITCHAGG_SWITCH": f"127.0.0.1:{switches[1 + r // 2].address[1]}",
            "SWITCHAGG_CONTROL": f"127.0.0.1:{controls[1 + r // 2]}"} for r in range(4)]
    yield switches, env
    for sw in switches:
        sw.stop()
        assert sw.error is None


def test_a_torch_group_whose_ranks_reach_two_leaves_sums_through_a_tree_and_removes_every_level(torch_tree):
    from tests import dist_worker
    from tests.test_distributed import inputs, spawn

    switches, env = torch_tree
    out = spawn(dist_worker.tree_group, env, 1000, world=4)
    leaves = [f"127.0.0.1:{sw.address[1]}" for sw in switches[1:]]
    assert [o["switch"] for o in out] == [leaves[0], leaves[0], leaves[1], leaves[1]]
    assert {o["parent"] for o in out} == {env[0]["SWITCHAGG_ROOT"]}
    assert [(o["rank"], o["ranks"]) for o in out] == [(r, 4) for r in range(4)]
    import torch

    total = sum(x.numpy().astype(np.int64) for x in inputs(torch.int32, 4000, 5, 4))
    for rank, o in enumerate(out):
        assert np.array_equal(o["all_reduce"], total[:1000])
        assert np.array_equal(o["reduce_scatter"], total[rank * 1000:(rank + 1) * 1000])
    assert all(sw.jobs() == {} for sw in switches), "destroy_process_group removes the job from every level"


def test_ddp_through_a_tree_trains_as_gloo_does(torch_tree):
    from tests import dist_worker
    from tests.test_distributed import spawn

    switches, env = torch_tree
    steps = 30
    gloo = spawn(dist_worker.train, env, "gloo", "ddp", steps, world=4)
    ours = spawn(dist_worker.train, env, "switchagg", "ddp", steps, world=4)
    for rank in range(4):
        assert np.allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-4, atol=0)
        assert ours[rank]["losses"][-1] < ours[rank]["losses"][0] / 2
        assert ours[rank]["sent"] > steps * 4 * 5700, "the gradients went through the switches"
    assert all(sw.jobs() == {} for sw in switches)


def test_a_jobs_ranks_on_several_switches_need_a_root_and_consecutive_leaves():
    pytest.importorskip("torch")
    from switchagg.distributed import Options
    from switchagg.distributed.rendezvous import _leaves

    def ranks(*switches):
        return [{"switch": s, "control": f"c{s}"} for s in switches]

    flat = Options(switch="127.0.0.1:1")
    assert _leaves(flat, ranks("a", "a", "a")) is None  # one switch: a flat job
    with pytest.raises(ConfigError, match="reach 2 switches .* set SWITCHAGG_ROOT"):
        _leaves(flat, ranks("a", "a", "b"))
    rooted = Options(switch="127.0.0.1:1", root="127.0.0.1:9")
    assert [leaf[:3] for leaf in _leaves(rooted, ranks("a", "a", "b", "b", "c"))] == [
        ("a", "ca", [0, 1]), ("b", "cb", [2, 3]), ("c", "cc", [4])]
    with pytest.raises(ConfigError, match="at a are not consecutive"):
        _leaves(rooted, ranks("a", "b", "a"))


def test_a_tree_on_p4_switches_asks_the_ranks_for_the_links_before_touching_a_switch():
    """A P4 program writes the links' Ethernet addresses and ports into packets: without them rank 0 says which
    variables to set, before it opens any switch (the controls here reach nothing)."""
    pytest.importorskip("torch")
    from switchagg.distributed import Options
    from switchagg.distributed.rendezvous import Leaf, _install_tree

    job = JobConfig.from_toml(TreeConfig.from_dict(parse_toml(P4_TREE, "the tree")).switch_jobs()[1].to_toml())
    link = {"mac": "02:5a:00:00:51:fe", "uplink_port": 2, "spine_port": 0}
    leaves = [Leaf("10.81.0.254:16711", "127.0.0.1:1", [0], link), Leaf("10.82.0.254:16711", "127.0.0.1:2", [1], link)]
    for options, gap in ((Options(switch="10.81.0.254:16711", root="10.80.0.254:16711", target="bmv2"), None),
                         (Options(switch="10.81.0.254:16711", root="10.80.0.254:16711", target="bmv2",
                                  root_mac="02:5a:00:00:50:fe"), "spine_port")):
        gapped = [leaves[0], leaves[1]._replace(link={**link, gap: None})] if gap else leaves
        with pytest.raises(ConfigError, match="set SWITCHAGG_ROOT_MAC .* SWITCHAGG_SPINE_PORT"):
            _install_tree(options, job, gapped, (0, 1))


def test_each_rail_of_nodes_under_two_leaves_is_a_tree_of_its_own(torch_tree):
    """Four nodes of two ranks, nodes 0 and 1 under leaf 0 and nodes 2 and 3 under leaf 1: each node reduces
    locally, and each rail's job (local rank r of every node) is a tree over both leaves."""
    from tests import dist_worker
    from tests.test_distributed import inputs, spawn

    switches, env = torch_tree
    world = 8
    ranks = [{**env[0 if r < 4 else 2], "SWITCHAGG_NODE": f"node{r // 2}"} for r in range(world)]
    out = spawn(dist_worker.tree_group, ranks, 1000, world=world)
    assert [o["ranks"] for o in out] == [4] * world, "a rail's job counts nodes"
    assert [o["rank"] for o in out] == [r // 2 for r in range(world)], "a node's place in its rail's tree"
    assert {o["parent"] for o in out} == {env[0]["SWITCHAGG_ROOT"]}
    import torch

    total = sum(x.numpy().astype(np.int64) for x in inputs(torch.int32, 1000 * world, 5, world))
    for rank, o in enumerate(out):
        assert np.array_equal(o["all_reduce"], total[:1000])
        assert np.array_equal(o["reduce_scatter"], total[rank * 1000:(rank + 1) * 1000])
    assert all(sw.jobs() == {} for sw in switches)


def test_a_run_restarted_under_a_running_tree_gets_its_own_sums_at_every_level(impl):
    """A run's workers stop mid-call, their packets still on every hop; a new run (another session generation,
    the same slots, chunk ids starting over) sums on the same tree: every rank gets its own run's sums, and the
    old run's late partials and results are dropped at each level, never taken for the new run's."""
    switches: dict = {}
    t = tree(switches, leaves=2, per_leaf=3, k=16, slots=4)
    lossy = Impairment(loss=0.05, dup=0.02, jitter=0.002)
    net = SimNet(None, lossy, lossy, seed=21, impl=impl, switches=switches)
    old = net.add_tree_workers(t)
    for w, x in zip(old, inputs(6, 16 * 12, np.int32, seed=1), strict=True):
        net.start(w, x)
    net.run(until=0.004)  # mid-call: partials and results of the old run in flight everywhere
    assert any(not w.red.done for w in old)
    for job in t.jobs:
        job.generation = 8  # the new run's session (every level's tag keeps it apart)
    net.workers.clear()
    new = net.add_tree_workers(t)
    xs = inputs(6, 16 * 12, np.int32, seed=2)
    got = run(net, new, xs)
    want = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32)
    assert all(np.array_equal(g, want) for g in got)
    counters = [sw.counters()["jobs"] for sw in switches.values()]
    assert sum(c[j]["stale"] + c[j]["unexpected_result"] for c in counters for j in c) > 0, \
        "the old run's late packets reached the switches and were dropped there"


def test_tofino_1_refuses_a_level_of_a_tree_and_p4_levels_ask_for_the_parents_link():
    """Tofino 1's program serves no tree (no stages left): a tree's job deployed there would sum its leaf's workers
    and multicast a partial as if it were the result, so it is refused before anything is written. The v1model
    program and Tofino 2's serve one, given where the parent hangs off the switch."""
    from switchagg.config import WorkerSpec
    from switchagg.targets import p4job

    t = TreeConfig.from_dict(parse_toml(tree_file(per_leaf=2, leaves=2), "the tree"))
    for job in t.switch_jobs():
        p4 = dataclasses.replace(job, switch=dataclasses.replace(job.switch, port=16711), workers=tuple(
            WorkerSpec(w.address, "02:00:00:00:00:01", i) for i, w in enumerate(job.workers)))
        with pytest.raises(ConfigError, match="level of a tree .*Tofino 1.*(target tofino2, bmv2 or soft)"):
            p4job.check_config(p4)
        p4job.check_config(dataclasses.replace(p4, parent=None, spans=(), tree_size=0, rank_base=0))
        if p4.parent is None:
            p4job.check_config(p4, trees=True)
            continue
        with pytest.raises(ConfigError, match=r"\[parent\] needs 'mac' and 'switch_port'"):
            p4job.check_config(p4, trees=True)
        p4job.check_config(dataclasses.replace(p4, parent=dataclasses.replace(
            p4.parent, mac="02:00:00:00:00:09", switch_port=9)), trees=True)
