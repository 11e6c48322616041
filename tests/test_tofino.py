"""The Tofino targets: p4/tna compiled for tofino and tofino2 by the open Tofino compiler, its fit, and
the BfRt control plane held to the bfrt.json the compiler wrote.

The compile tests need bf-p4c (README, "Tofino"); they skip elsewhere with the reason, and
scripts/test requires them where it finds the compiler. No Tofino model runs here: the control
plane's calls go to :class:`tests.bfrt_schema.SchemaSession`, which refuses what bf_switchd would
refuse by name, field or width, and keeps what it accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from switchagg.config import Endpoint, ParentSpec
from switchagg.errors import ConfigError, SwitchAggError
from switchagg.jobs import JobCounter
from switchagg.loopback import loopback_job
from switchagg.targets import TARGETS, tofino, tofino_build
from switchagg.wire import MAX_WORKERS, P4_VALUES_PER_PACKET, UDP_PORT

from . import bfrt_schema
from .conftest import need

ROOT = Path(__file__).resolve().parents[1]
CHIPS = [tofino.TofinoTarget, tofino.Tofino2Target]


def p4_job(n: int, *, job_id: int = 1, slot_base: int = 0, slot_count: int = 32, ports: list[int] | None = None):
    """A job for a P4 switch at 10.0.0.254 whose workers hang off ``ports`` (1, 2, .. by default)."""
    cfg = loopback_job(n, values_per_packet=P4_VALUES_PER_PACKET, slot_count=slot_count, slot_base=slot_base,
                       job_id=job_id)
    ports = ports or list(range(1, n + 1))
    workers = tuple(dataclasses.replace(w, address=Endpoint(f"10.0.0.{r + 1}", 40000 + r),
                                        mac=f"02:00:00:00:00:{r + 1:02x}", switch_port=ports[r])
                    for r, w in enumerate(cfg.workers))
    return dataclasses.replace(cfg, switch=Endpoint("10.0.0.254", UDP_PORT), workers=workers)


@pytest.fixture(scope="module", params=CHIPS, ids=lambda t: t.name)
def compiled(request, tmp_path_factory) -> tuple[type[tofino.TofinoTarget], Path]:
    """p4/tna compiled for one chip (once per test run; build/ keeps it between runs)."""
    try:
        tofino_build.compiler()
    except SwitchAggError as exc:
        need("tofino", str(exc))
    target = request.param
    with contextlib.chdir(ROOT):  # a relative folder, as users give it to build-p4
        target.build(Path("build") / "test" / target.name)
    return target, ROOT / "build" / "test" / target.name


@pytest.fixture
def switch(compiled) -> tuple[tofino.TofinoTarget, bfrt_schema.SchemaSession]:
    target, out = compiled
    session = bfrt_schema.SchemaSession(bfrt_schema.load(out / "bfrt.json"))
    return target(session=lambda: session), session


@pytest.mark.tofino
def test_the_program_fits_the_chip(compiled):
    target, out = compiled
    report = target.resources(out)
    stages = tofino_build.stages_used(out)
    assert 0 < stages <= target.chip.stages
    assert f"of {target.chip.stages} MAU stages" in report and "stateful ALUs" in report and "PHV" in report


@pytest.mark.tofino
def test_bf_switchd_s_configuration_names_the_build_by_absolute_paths(compiled):
    """bf_switchd reads relative paths under $SDE_INSTALL: a relative build folder must give absolute ones."""
    _, out = compiled
    conf = json.loads((out / "switchagg.conf").read_text())
    program = conf["p4_devices"][0]["p4_programs"][0]
    files = [program["bfrt-config"]] + [p[k] for p in program["p4_pipelines"] for k in ("context", "config", "path")]
    for f in files:
        assert Path(f).is_absolute() and Path(f).exists(), f


@pytest.mark.tofino
def test_every_name_the_control_plane_uses_is_in_bfrt_json(compiled):
    target, out = compiled
    tables = bfrt_schema.load(out / "bfrt.json")
    for name, (keys, actions) in tofino.tables(target.chip).items():
        assert name in tables, f"{name} is not in {out / 'bfrt.json'}"
        assert sorted(tables[name].keys) == sorted(keys), name
        for action, params in actions.items():
            assert action in tables[name].actions, f"{name} has no action {action}"
            assert set(params) <= set(tables[name].actions[action]), (name, action)


@pytest.mark.tofino
def test_deploy_status_reset_undeploy(switch):
    target, session = switch
    cfg = p4_job(3, job_id=7, slot_base=8)
    generation = target.deploy(cfg)
    status = target.status(7)
    assert (status.installed, status.generation, status.slot_base, status.slot_count, status.n_workers) == (
        True, generation, 8, 32, 3)
    admission = session.entries(tofino.ADMISSION)
    assert sorted(r.data["worker_bit"] for r in admission) == [1, 2, 4]
    assert {r.data["all_workers"] for r in admission} == {7}
    assert {r.data["recirc_port"] for r in admission} == {target.chip.recirculation_port}
    replicas = session.entries(tofino.REPLICA)
    assert sorted((r.data["worker"], r.data["udp_dst"]) for r in replicas) == [(0, 40000), (1, 40001), (2, 40002)]
    (group,) = [r for r in session.entries(tofino.PRE_MGID) if r.key["$MGID"] != tofino.FLOOD_GROUP]
    assert sorted(group.data["$MULTICAST_NODE_ID"]) == sorted(r.key["rid"] for r in replicas)

    assert {session.counters[(tofino.JOB_COUNTERS, (group.key["$MGID"] - 1) * 16 + c)] for c in JobCounter} == {0}
    session.counters[(tofino.JOB_COUNTERS, (group.key["$MGID"] - 1) * 16 + JobCounter.STALE)] = 5
    session.counters[(tofino.JOB_COUNTERS, (group.key["$MGID"] - 1) * 16 + JobCounter.QUERIES)] = 3
    counters = target.status(7).counters
    assert (counters["stale"], counters["queries"]) == (5, 3)

    new = target.reset(7)
    assert new != generation and target.status(7).generation == new
    assert {r.data["generation"] for r in session.entries(tofino.ADMISSION)} == {new}

    target.undeploy(7)
    assert not target.status(7).installed
    for table in (tofino.ADMISSION, tofino.REPLICA):
        assert session.entries(table) == []
    assert [r.key["$MGID"] for r in session.entries(tofino.PRE_MGID)] == [tofino.FLOOD_GROUP]


@pytest.mark.tofino
def test_two_jobs_get_their_own_groups_and_slots_do_not_overlap(switch):
    target, session = switch
    target.deploy(p4_job(2, job_id=1, slot_base=0, ports=[1, 2]))
    target.deploy(p4_job(4, job_id=2, slot_base=32, ports=[3, 4, 5, 6]))
    groups = sorted(r.key["$MGID"] for r in session.entries(tofino.PRE_MGID))
    assert groups == [1, 2, tofino.FLOOD_GROUP]
    assert target.jobs() == {1: (0, 32), 2: (32, 32)}  # where a process group's job would fit
    with pytest.raises(ConfigError, match="overlap"):
        target.deploy(p4_job(2, job_id=3, slot_base=16))
    target.undeploy(1)
    assert target.status(2).installed and target.status(2).n_workers == 4
    assert target.jobs() == {2: (32, 32)}


def leaf_job(n: int, *, job_id: int = 5) -> object:
    """A level of a tree: ``n`` workers (ranks 2 .. n + 1 of n + 6) under a parent at 10.0.1.1 on port 20, as child 1
    of the parent's job 40."""
    up = ParentSpec(Endpoint("10.0.1.1", UDP_PORT), 40, 1, 0xFACE, mac="02:00:00:00:01:01", switch_port=20)
    return dataclasses.replace(p4_job(n, job_id=job_id, slot_base=64), parent=up, rank_base=2, tree_size=n + 6)


@pytest.mark.tofino
def test_a_level_of_a_tree_is_installed_where_the_chip_serves_trees(switch):
    """Tofino 2's program serves a level of a tree (SA_TREES): its workers count the parent as worker n, the
    parent's RESULT has an entry of its own, the partial goes up through an uplink group whose one replica
    egress makes a CONTRIB of the parent's job; undeploy removes all of it. Tofino 1's refuses the level."""
    target, session = switch
    if not target.chip.trees:
        with pytest.raises(ConfigError, match="tree"):
            target.deploy(leaf_job(3))
        assert session.entries(tofino.ADMISSION) == []
        return
    target.deploy(p4_job(2, job_id=1, slot_base=0, ports=[7, 8]))  # a flat job beside it keeps its own rows
    generation = target.deploy(leaf_job(3))
    status = target.status(5)
    assert (status.installed, status.generation, status.n_workers) == (True, generation, 3)
    rows = {(r.key["job"], r.key["type_bit"], r.key["worker"]): r for r in session.entries(tofino.ADMISSION)}
    workers = [rows[(5, 1, w)] for w in range(3)]
    assert {(r.data["all_workers"], r.data["parent_bit"]) for r in workers} == {(0b1111, 0b1000)}
    assert [r.data["other_workers"] for r in workers] == [0b1110, 0b1101, 0b1011]
    assert {(rows[(1, 1, w)].data["all_workers"], rows[(1, 1, w)].data["parent_bit"]) for w in range(2)} == {(3, 0)}
    result = rows[(40, 0, 1)]
    assert result.action == tofino.ADMIT_RESULT
    assert result.key == {"job": 40, "worker": 1, "src_addr": 0x0A000101, "src_port": UDP_PORT, "key": 0xFACE,
                          "type_bit": 0}
    group = workers[0].data["job_index"] + 1
    assert {k: result.data[k] for k in ("job_index", "other_workers", "all_workers", "parent_bit", "job", "key")} == {
        "job_index": group - 1, "other_workers": 0b0111, "all_workers": 0b1111, "parent_bit": 0b1000, "job": 5,
        "key": workers[0].key["key"]}
    (uplink,) = [r for r in session.entries(tofino.PRE_MGID) if r.key["$MGID"] == group | 0x80]
    (rid,) = uplink.data["$MULTICAST_NODE_ID"]
    (node,) = [r for r in session.entries(tofino.PRE_NODE) if r.key["$MULTICAST_NODE_ID"] == rid]
    assert node.data["$DEV_PORT"] == [20]
    (up,) = [r for r in session.entries(tofino.REPLICA) if r.key["rid"] == rid]
    assert up.action == tofino.TO_PARENT
    assert up.data == {"eth_dst": 0x020000000101, "ip_src": 0x0A0000FE, "ip_dst": 0x0A000101, "udp_dst": UDP_PORT,
                       "worker": 1, "job": 40, "key": 0xFACE}

    target.reset(5)  # the parent's entry has no generation: a reset leaves it as it is
    assert {r.action for r in session.entries(tofino.ADMISSION) if r.key["type_bit"] == 0} == {tofino.ADMIT_RESULT}
    target.undeploy(5)
    assert {r.key["job"] for r in session.entries(tofino.ADMISSION)} == {1}
    assert sorted(r.key["$MGID"] for r in session.entries(tofino.PRE_MGID)) == [1, tofino.FLOOD_GROUP]
    assert len(session.entries(tofino.REPLICA)) == 2 and len(session.entries(tofino.PRE_NODE)) == 3  # and flood's


def test_a_level_of_a_tree_leaves_its_parent_a_bit():
    """On a chip that serves trees, a level's parent is worker n: 31 children at most."""
    target = tofino.Tofino2Target(session=lambda: None)
    target.check(leaf_job(MAX_WORKERS - 1))
    with pytest.raises(ConfigError, match=f"at most {MAX_WORKERS - 1}"):
        target.check(leaf_job(MAX_WORKERS))
    with pytest.raises(ConfigError, match="tree"):
        tofino.TofinoTarget(session=lambda: None).check(leaf_job(2))


def test_a_job_across_pipes_is_refused():
    cfg = p4_job(2, ports=[1, tofino.PORTS_PER_PIPE + 1])
    with pytest.raises(ConfigError, match="one pipe"):
        tofino.TofinoTarget(session=lambda: None).deploy(cfg)


def test_each_level_of_a_tree_file_is_reached_at_its_own_control_address():
    """`switchagg deploy --target tofino2 --config tree.toml` takes no --address: each level's [switch] control
    names its switch's BfRt address."""
    from switchagg.targets import TargetOptions

    level = dataclasses.replace(leaf_job(2), control=Endpoint("10.9.0.2", 50052))
    assert tofino.Tofino2Target.open(TargetOptions(config=level)).address == "10.9.0.2:50052"
    assert tofino.Tofino2Target.open(TargetOptions(config=level, address="10.9.0.3:50052")).address == "10.9.0.3:50052"
    no_control = dataclasses.replace(level, control=None)
    assert tofino.Tofino2Target.open(TargetOptions(config=no_control)).address == "127.0.0.1:50052"


def test_a_level_whose_parent_is_on_another_pipe_is_refused():
    """A level's parent's RESULTs take the registers of the pipe they come in on: the workers' pipe, or none."""
    cfg = leaf_job(2)
    cfg = dataclasses.replace(cfg, parent=dataclasses.replace(cfg.parent, switch_port=tofino.PORTS_PER_PIPE + 20))
    with pytest.raises(ConfigError, match="workers and parent are on pipes"):
        tofino.recirculation_port(tofino_build.Chip.TOFINO2, cfg)
    chip = tofino_build.Chip.TOFINO2
    assert tofino.recirculation_port(chip, leaf_job(2)) == chip.recirculation_port


def test_the_recirculation_port_is_the_pipe_s():
    assert tofino.recirculation_port(tofino_build.Chip.TOFINO, p4_job(1, ports=[130])) == 128 + 68
    assert tofino.recirculation_port(tofino_build.Chip.TOFINO2, p4_job(1, ports=[300])) == 256 + 6


def test_without_the_sde_the_error_says_what_to_install(monkeypatch):
    if importlib.util.find_spec("bfrt_grpc") is not None:
        pytest.skip("the SDE's BfRt client is installed here")
    monkeypatch.delenv("SDE_INSTALL", raising=False)
    monkeypatch.delenv("SDE", raising=False)
    with pytest.raises(SwitchAggError, match="SDE_INSTALL"):
        TARGETS["tofino"]("127.0.0.1:1").status(1)
