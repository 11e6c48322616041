"""`switchagg bench --tree`: its LEAVESxWORKERS, its table's verdict, and one small run end to end on a routed bed
with loss on every hop (the bed needs root, ip, nft, ethtool and torch: required where CI found them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchagg.benchmarks import trees
from switchagg.errors import ConfigError

from .conftest import need
from .test_link_bench import _shows_quotient


@pytest.mark.parametrize(("shape", "message"), [
    ("2y4", "--tree '2y4': write LEAVESxWORKERS"),
    ("2x", "--tree '2x': write LEAVESxWORKERS"),
    ("-1x4", "--tree '-1x4': write LEAVESxWORKERS"),
    ("0x4", "--tree 0x4: a switch has 1..32 children; give 1..32 leaves and 1..32 workers a leaf"),
    ("1x33", "--tree 1x33: a switch has 1..32 children"),
    ("5x8", "--tree 5x8: 40 ranks, but the flat job the bench compares the tree with holds at most 32 (one "
            "switch's bitmap): give at most 32 leaves x workers"),
])
def test_a_shape_the_bench_cannot_build_says_what_to_write(shape, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        trees.parse_shape(shape)


def test_a_shape_is_leaves_then_workers_a_leaf():
    assert trees.parse_shape("2x4") == (2, 4) and trees.parse_shape("32x1") == (32, 1)
    assert trees.parse_shape("4x8") == (4, 8)  # 32 ranks: K = 64's most


@pytest.mark.parametrize(("given", "message"), [
    ({"rates": ()}, "--tree-loss: give one or more loss rates"),
    ({"rates": (0.0, 100.0)}, "--tree-loss 100: a loss rate is a percentage from 0 to 99.9"),
    ({"reps": 0}, "--reps 0: give 1 or more values a call and 1 or more reps"),
    ({"link_rate": 0.5}, "--link-rate 0.5: give the links' rate in Mbit/s, 1 to 100000"),
])
def test_the_bench_refuses_what_it_cannot_run_before_it_builds_anything(given, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        trees.run_tree_bench(**{"shape": "2x2", **given})


def _run(ms: float, exact: bool = True, floats: tuple[str, ...] = ("a", "a")) -> trees.Run:
    return trees.Run(ms, 3, 5, exact, [[f] for f in floats])


@pytest.mark.parametrize(("row", "wrong"), [
    (trees.Row(1.0, _run(2.0), _run(1.0), _run(4.0)), []),
    (trees.Row(1.0, _run(2.0, exact=False), _run(1.0), _run(4.0)), ["tree's int32 sums"]),
    (trees.Row(1.0, _run(2.0), _run(1.0), _run(4.0, exact=False)), ["gloo's int32 sums"]),
    (trees.Row(1.0, _run(2.0, floats=("a", "b")), _run(1.0, floats=("a", "b")), _run(4.0)),
     ["the ranks' float32 sums differ"]),
    (trees.Row(1.0, _run(2.0), _run(1.0, floats=("b", "b")), _run(4.0)),
     ["the tree's float32 sums are not the flat job's"]),
])
def test_a_row_says_which_sums_came_out_wrong_and_the_table_says_sums_wrong(row, wrong):
    assert row.wrong() == wrong
    text = trees.table([row], "2x2")
    assert ("SUMS WRONG" in text) == bool(wrong)
    assert "tree_over_flat=2x2-1pct:2.000" in text and "gloo_over_tree=2x2-1pct:2.000" in text


@pytest.fixture
def prefix():
    """This process's beds' prefix: none of its namespaces left, whatever the test did."""
    need("netns", trees.missing())
    from switchagg import netns

    mine = f"{trees.PREFIX}{os.getpid()}-"
    yield mine
    assert netns.namespaces(mine) == []


def _rows(out: str) -> dict[float, list[str]]:
    found = re.findall(r"^ +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +(\d+) +(\d+) +(\d+) +"
                       r"(yes|SUMS WRONG)$", out, re.M)
    return {float(r[0]): list(r[1:]) for r in found}


@pytest.mark.netns
def test_the_bench_runs_a_tree_a_flat_job_and_gloo_under_loss_on_every_hop_and_leaves_nothing(prefix, capsys):
    assert trees.run_tree_bench(shape="2x2", rates=(0.0, 5.0), values=20011, reps=2) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert sorted(rows) == [0.0, 5.0], out
    for rate, (tree, flat, gloo, over_flat, gloo_over, tree_resent, flat_resent, tree_dropped, flat_dropped,
               exact) in rows.items():
        tree_ms, flat_ms, gloo_ms = float(tree), float(flat), float(gloo)
        assert _shows_quotient(float(over_flat), tree_ms, flat_ms, 0.01, 0.01), out
        assert _shows_quotient(float(gloo_over), gloo_ms, tree_ms, 0.01, 0.01), out
        assert exact == "yes", out
        lossy = rate > 0  # at 0% the rules run and drop nothing
        assert (int(tree_dropped) > 0, int(flat_dropped) > 0) == (lossy, lossy), out
        # a busy machine's late replies are resent at 0% too (the bench's 2x4 tree: thousands on two cores)
        assert not lossy or (int(tree_resent) > 0 and int(flat_resent) > 0), out
    assert rows[0.0][2] == rows[5.0][2]  # gloo's one run, in every row
    assert re.search(r"^tree_over_flat=2x2-0pct:[\d.]+ 2x2-5pct:[\d.]+$", out, re.M), out
    assert re.search(r"^gloo_over_tree=2x2-0pct:[\d.]+ 2x2-5pct:[\d.]+$", out, re.M), out
    assert "SUMS WRONG" not in out


@pytest.mark.netns
def test_a_bench_stopped_mid_run_removes_its_namespaces_and_its_processes(prefix, monkeypatch):
    """Ctrl-C (or SIGTERM, which the bench turns into it) after the bed and the workers are up: nothing is left."""
    from switchagg import netns

    started = []

    def interrupted(bed, workers, *args):
        started.extend(workers.procs)
        assert sorted(netns.namespaces(prefix)) == sorted(bed.namespaces())  # 1 spine, 2 leaves, 4 workers
        raise KeyboardInterrupt

    monkeypatch.setattr(trees, "_rate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trees.run_tree_bench(shape="2x2", rates=(1.0,), values=64, reps=1)
    assert len(started) == 4 and all(p.poll() is not None for p in started)


@pytest.mark.netns
def test_shaped_links_are_every_link_of_the_bed_uplinks_too(prefix, monkeypatch):
    """--tree-link-rate: tbf at the rate on both ends of every worker's link and every leaf's uplink (12 ends for a
    2x2 tree), before any side runs."""
    from switchagg.benchmarks.links import qdisc_stats

    seen = {}

    def inspected(bed, *args):
        seen.update({(ns, dev): qdisc_stats(ns, dev)["rate"] for ns, dev in bed.links()})
        raise KeyboardInterrupt

    monkeypatch.setattr(trees, "_rate", inspected)
    with pytest.raises(KeyboardInterrupt):
        trees.run_tree_bench(shape="2x2", rates=(0.0,), values=64, reps=1, link_rate=300)
    assert len(seen) == 2 * 2 + 2 * 4 and set(seen.values()) == {300e6 / 8}


@pytest.mark.netns
def test_a_bench_sent_sigterm_removes_its_namespaces():
    need("netns", trees.missing())
    from switchagg import netns

    proc = subprocess.Popen([sys.executable, "-m", "switchagg", "bench", "--tree", "1x2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    mine = f"{trees.PREFIX}{proc.pid}-"
    try:
        deadline = time.monotonic() + 30
        while f"{mine}w1" not in netns.namespaces(mine):  # the last namespace the bed makes
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        time.sleep(0.5)  # its workers starting up
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert "KeyboardInterrupt" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert netns.namespaces(mine) == []
