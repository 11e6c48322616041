"""A two-level tree of BMv2 switches (docs/protocol.md section 10): two leaves of four workers each and a
spine, every level deployed over P4Runtime from one tree file (`switchagg deploy --target bmv2`),
switchagg.Client workers in namespaces allreducing through all three, with and without nftables loss and
duplication on the hosts' links. Required where CI found root and the toolchain.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bmv2_env.testbed import TreeBed, missing_prerequisites
from switchagg import netns
from switchagg.__main__ import main
from switchagg.tree import TreeConfig

from .conftest import need
from .impair import nft_impair
from .netns_worker import check_sums

pytestmark = pytest.mark.bmv2
ROOT = Path(__file__).resolve().parents[1]
LEAVES, PER_LEAF, ROUNDS, SIZE = 2, 4, 2, 2000
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    need("bmv2", missing_prerequisites())
    with TreeBed(LEAVES, PER_LEAF, prefix="sat") as bed:
        where = tmp_path_factory.mktemp("tree")
        tree_path = where / "tree.toml"
        tree_path.write_text(bed.tree_file(slot_count=32))
        assert main(["deploy", "--target", "bmv2", "--config", str(tree_path)]) == 0
        t = TreeConfig.from_file(tree_path)
        spine, *leaves = t.switch_jobs()
        paths = [cfg.write(where / f"leaf{i}.toml") for i, cfg in enumerate(leaves)]
        yield bed, spine, leaves, paths, tree_path


def run(bed: TreeBed, paths: list[Path], out: Path) -> dict[int, dict]:
    """Every worker of every leaf allreduces ROUNDS times; what each got, by tree rank."""
    out.mkdir()
    procs = {}
    for i, (leaf, path) in enumerate(zip(bed.leaf, paths, strict=True)):
        for local in range(PER_LEAF):
            rank = i * PER_LEAF + local
            procs[rank] = leaf.exec(local, [sys.executable, "-m", "tests.netns_worker", str(path), str(local),
                                            str(out / f"{rank}.npz"), str(ROUNDS), str(SIZE)],
                                    cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    for p in procs.values():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return {rank: dict(np.load(out / f"{rank}.npz")) for rank in procs}


def test_two_leaves_and_a_spine_of_bmv2_sum_eight_workers_exactly_even_with_loss(tree, tmp_path):
    """Every rank gets the sum of all eight, bit for bit the same; under 5% loss and 5% duplication on every
    host's link the same values again; each level counted its part: the spine summed two partials a chunk and
    sent each leaf its result, each leaf sent up every partial it finished and took every result once."""
    from switchagg.targets import bmv2

    bed, spine, leaves, paths, _ = tree
    ranks = LEAVES * PER_LEAF
    clean = run(bed, paths, tmp_path / "clean")
    check_sums(clean, ranks, ROUNDS, SIZE)
    top = bmv2.Bmv2Target(bed.spine.grpc_addr).status(spine.job_id).counters
    below = [bmv2.Bmv2Target(leaf.grpc_addr).status(cfg.job_id).counters
             for leaf, cfg in zip(bed.leaf, leaves, strict=True)]
    assert top["results_multicast"] > 0 and top["contributions"] == LEAVES * top["results_multicast"]
    for c in below:
        assert c["partials_up"] == c["results_from_parent"] == top["results_multicast"]
        # a result the leaf did not await answers a partial child 0's early repeat sent up again (the spine
        # answers a partial it finished from its stored result): no other comes down a lossless uplink
        assert c["results_multicast"] == 0 and c["unexpected_result"] <= c["partials_resent"]

    for leaf in bed.leaf:
        for h in range(PER_LEAF):
            nft_impair(leaf.host(h), loss=5, dup=5, dup_to=leaf.switch_ip)
    try:
        lossy = run(bed, paths, tmp_path / "lossy")
    finally:
        for leaf in bed.leaf:
            for h in range(PER_LEAF):
                netns.sh("nft", "delete", "table", "ip", "sa", ns=leaf.host(h), check=False)
    assert sum(int(r["timeouts"]) for r in lossy.values()) > 0
    for r in range(ranks):
        for key in clean[r]:
            if key not in ("timeouts", "backend"):
                assert np.array_equal(clean[r][key], lossy[r][key]), (r, key)


def test_the_tree_files_levels_have_one_generation_and_undeploy_leaves_no_entry_of_the_job(tree, capsys):
    """`status` shows every level, all under the spine's generation; `undeploy` removes each level's entries
    (admission, the parent's, owner branches, replicas, groups): the tree deploys again on every switch."""
    from switchagg.targets import bmv2

    bed, spine, leaves, _, tree_path = tree
    switches = [bed.spine, *bed.leaf]
    generations = {bmv2.Bmv2Target(sw.grpc_addr).status(spine.job_id).generation for sw in switches}
    assert len(generations) == 1
    assert main(["status", "--target", "bmv2", "--config", str(tree_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"job {spine.job_id}: generation {generations.pop()}") == 1 + LEAVES
    assert "spine of the tree" in out and "leaf 1 of the tree" in out and "partials_up" in out
    assert main(["undeploy", "--target", "bmv2", "--config", str(tree_path)]) == 0
    for sw in switches:  # no entry of the job is left (the L2 entries of its hosts stay, as for a flat job)
        with bmv2.P4RuntimeSession(sw.grpc_addr) as sh:
            for table in (bmv2.ADMISSION, bmv2.REPLICA, *bmv2.BRANCHES):
                assert list(sh.TableEntry(table).read()) == [], table
    assert main(["deploy", "--target", "bmv2", "--config", str(tree_path)]) == 0
    assert all(bmv2.Bmv2Target(sw.grpc_addr).jobs() == {spine.job_id: (spine.slot_base, spine.slot_count)}
               for sw in switches)


def test_a_torch_group_whose_ranks_reach_two_bmv2_leaves_deploys_a_tree_trains_and_removes_it(tmp_path):
    """init_process_group("switchagg") on BMv2, each node's SWITCHAGG_SWITCH its rack's leaf and SWITCHAGG_ROOT
    the spine, with the links' addresses and ports (SWITCHAGG_ROOT_MAC, _SWITCH_MAC, _UPLINK_PORT,
    _SPINE_PORT): rank 0 deploys every level over P4Runtime, the four ranks sum and train DDP through the tree,
    and destroy_process_group removes every level. torch's store and gloo cross a management network."""
    need("bmv2", missing_prerequisites())
    pytest.importorskip("torch")
    from switchagg.targets import bmv2

    from .nsforward import NamespaceForwarder

    leaves, per_leaf = 2, 2
    with TreeBed(leaves, per_leaf, prefix="sau", subnet=90, mgmt=True) as bed:
        switches = [bed.spine, *bed.leaf]
        ns0 = bed.leaf[0].host(0)
        ports = [int(sw.grpc_addr.rpartition(":")[2]) for sw in switches]
        forwarders = [NamespaceForwarder(ns0, ("127.0.0.1", port)) for port in ports]
        for f in forwarders:
            f.__enter__()
        try:
            def env(leaf: int, h: int) -> dict[str, str]:
                sw = bed.leaf[leaf]
                return dict(ENV, SWITCHAGG_TARGET="bmv2", SWITCHAGG_SWITCH=f"{sw.switch_ip}:16711",
                            SWITCHAGG_CONTROL=f"127.0.0.1:{forwarders[1 + leaf].port}", SWITCHAGG_SLOTS="32",
                            SWITCHAGG_MAC=sw.host_mac(h), SWITCHAGG_SWITCH_PORT=str(h),
                            SWITCHAGG_NODE=f"node{leaf * per_leaf + h}", SWITCHAGG_ROOT=f"{bed.spine.switch_ip}:16711",
                            SWITCHAGG_ROOT_CONTROL=f"127.0.0.1:{forwarders[0].port}",
                            SWITCHAGG_ROOT_MAC=bed.spine.switch_mac, SWITCHAGG_SWITCH_MAC=sw.switch_mac,
                            SWITCHAGG_UPLINK_PORT=str(per_leaf), SWITCHAGG_SPINE_PORT=str(leaf),
                            GLOO_SOCKET_IFNAME="mgmt0")

            world = leaves * per_leaf
            master = f"{bed.leaf[0].mgmt_ip(0)}:29519"
            procs = [bed.leaf[r // per_leaf].exec(
                r % per_leaf, [sys.executable, "-m", "tests.bmv2_backend_worker", str(r), str(world), master,
                               str(tmp_path / f"{r}.npz")], cwd=ROOT, env=env(r // per_leaf, r % per_leaf),
                stderr=subprocess.PIPE, text=True) for r in range(world)]
            for p in procs:
                _, err = p.communicate(timeout=300)
                assert p.returncode == 0, err[-3000:]
        finally:
            for f in forwarders:
                f.__exit__(None, None, None)
        runs = [np.load(tmp_path / f"{r}.npz") for r in range(world)]
        expected = np.arange(3000, dtype=np.int32) * sum(range(1, world + 1))
        for r in runs:
            assert np.array_equal(r["ints"], expected)
            assert np.array_equal(r["params"], runs[0]["params"])
            assert r["losses"][-1] < r["losses"][0]
        assert {int(r["job"]) for r in runs} == {int(runs[0]["job"])}  # one job id at every level
        assert [int(r["leaf"]) for r in runs] == [r // per_leaf for r in range(world)]  # each rank's leaf's job
        for sw in switches:  # destroy_process_group removed every level
            assert bmv2.Bmv2Target(sw.grpc_addr).jobs() == {}
