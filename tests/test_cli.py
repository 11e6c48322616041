"""The command line: against a running embedded switch, and what it says when something is wrong (one
line on stderr, exit status 1, no traceback)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess

import numpy as np
import pytest

from switchagg import Client
from switchagg.__main__ import build_parser, main
from switchagg.loopback import free_ports, spawn_switch
from switchagg.switch.control_client import request
from switchagg.transport import BATCHED_AVAILABLE

from .conftest import loopback_config, run_ranks


def test_status_names_the_job_its_counters_and_the_switchs_transport(make_job, soft_switch, tmp_path, capsys):
    cfg = make_job(2, k=64)
    path = cfg.write(tmp_path / "job.toml")
    assert main(["status", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"transport {soft_switch.backend})" in out
    assert ("sendmmsg+GSO/recvmmsg+GRO" in out) == BATCHED_AVAILABLE
    assert f"job {cfg.job_id}: generation" in out and "contributions" in out and "malformed" in out
    # the drops outside the data plane: the switch's sockets' and its control port's (this status a request)
    host = out[out.index("the embedded switch's host side"):]
    assert re.search(r"sockets_truncated +0\n", host) and re.search(r"control_requests +1\n", host)


def test_deploy_with_a_lease_then_renew_and_status_shows_every_job_s_lease_and_owner(make_job, soft_switch, tmp_path,
                                                                                      capsys):
    other = make_job(2, k=64)  # installed with no lease, by no process that said so
    cfg = dataclasses.replace(loopback_config(2, switch_port=soft_switch.address[1], k=64,
                                              control=soft_switch.control_address[1]), job_id=7, slot_base=64)
    path = cfg.write(tmp_path / "job.toml")
    assert main(["deploy", "--lease", "30", "--config", str(path)]) == 0
    assert "removed 30 s after its last renewal" in capsys.readouterr().out
    assert main(["renew", "--config", str(path)]) == 0
    assert soft_switch.lease_counters()["renewed"] == 1
    assert main(["status", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    owner = f"{socket.gethostname()} pid {os.getpid()}"
    assert re.search(r"\n  lease +\d+\.\d s left\n  owner +" + re.escape(owner) + "\n", out), out
    table = out[out.index("every job on this switch"):]
    assert f"job {other.job_id}: slots 0..15, 2 workers, lease none (stays until removed)\n" in table
    assert re.search(r"job 7: slots 64\.\.79, 2 workers, lease \d+\.\d s left, owner " + re.escape(owner), table)
    assert main(["status", "--json", "--config", str(path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert 0 < status["lease"] <= 30 and status["owner"] == owner and set(status["switch_jobs"]) == {"1", "7"}
    assert main(["renew", "--config", str(other.write(tmp_path / "other.toml"))]) == 1
    assert "job 1 holds no lease, so there is nothing to renew" in capsys.readouterr().err
    assert main(["deploy", "--target", "bmv2", "--lease", "30", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "the bmv2 target keeps no leases" in err and err.count("\n") == 1


def test_status_json_is_one_object_with_the_job_and_its_counters(make_job, soft_switch, tmp_path, capsys):
    """`status --json` crashed on every target: JobStatus had no to_json."""
    cfg = make_job(2, k=64)
    path = cfg.write(tmp_path / "job.toml")
    assert main(["status", "--json", "--config", str(path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["target"] == "soft" and status["job_id"] == cfg.job_id and status["installed"] is True
    assert status["generation"] == soft_switch.jobs()[cfg.job_id].generation
    assert status["slot_count"] == cfg.slot_count and status["n_workers"] == 2
    assert status["counters"]["contributions"] == 0 and "malformed" in status["global_drops"]
    assert status["transport"] == soft_switch.backend
    other = dataclasses.replace(cfg, job_id=9).write(tmp_path / "other.toml")  # not installed: no counters
    assert main(["status", "--json", "--config", str(other)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["installed"] is False and "generation" not in status and "malformed" in status["global_drops"]


def test_every_control_subcommand_defaults_to_the_embedded_switch(make_job, soft_switch, tmp_path, capsys):
    """`undeploy` and `deploy` defaulted to bmv2, and printed P4Runtime errors against the embedded switch."""
    cfg = make_job(2, k=64)
    path = cfg.write(tmp_path / "job.toml")
    generation = soft_switch.jobs()[cfg.job_id].generation
    assert main(["reset", "--config", str(path)]) == 0
    assert soft_switch.jobs()[cfg.job_id].generation != generation
    assert main(["undeploy", "--config", str(path)]) == 0
    assert cfg.job_id not in soft_switch.jobs()
    assert main(["deploy", "--config", str(path)]) == 0
    assert cfg.job_id in soft_switch.jobs()
    assert "on the soft target" in capsys.readouterr().out
    for command in ("status", "reset", "deploy", "renew", "undeploy"):
        assert build_parser().parse_args([command, "--config", "x"]).target == "soft"


def test_a_change_with_another_key_is_refused_in_one_line(make_job, soft_switch, tmp_path, capsys):
    cfg = make_job(2, k=64)
    path = dataclasses.replace(cfg, key=cfg.key ^ 1).write(tmp_path / "job.toml")
    generation = soft_switch.jobs()[cfg.job_id].generation
    assert main(["reset", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'key' is not job 1's key" in err
    assert soft_switch.jobs()[cfg.job_id].generation == generation


def test_switch_on_a_busy_port_is_a_one_line_error(tmp_path, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        cfg = loopback_config(2, switch_port=busy.getsockname()[1], k=64)
        path = cfg.write(tmp_path / "job.toml")
        before = signal.getsignal(signal.SIGTERM)
        assert main(["switch", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("switchagg switch: cannot bind UDP 127.0.0.1:") and "in use" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) is before  # main() leaves its caller's signal handlers alone


def test_switch_refuses_a_public_control_port_unless_told(tmp_path, capsys):
    cfg = loopback_config(2, switch_port=free_ports(1)[0], k=64)
    path = cfg.write(tmp_path / "job.toml")
    assert main(["switch", "--config", str(path), "--control", "0.0.0.0:16712"]) == 1
    assert "--control-any-address" in capsys.readouterr().err
    assert main(["switch", "--config", str(path), "--control-any-address"]) == 1  # there is no control port
    assert "--control-any-address: this switch has no control port" in capsys.readouterr().err


def test_switch_opens_a_public_control_port_only_with_a_token_it_can_read(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SWITCHAGG_CONTROL_TOKEN", raising=False)
    cfg = loopback_config(2, switch_port=free_ports(1)[0], k=64)
    path = cfg.write(tmp_path / "job.toml")
    public = ["switch", "--config", str(path), "--control", "0.0.0.0:16712", "--control-any-address"]
    assert main(public) == 1
    assert "with no control token: whoever reaches it could install jobs. Set SWITCHAGG_CONTROL_TOKEN" in \
        capsys.readouterr().err
    assert main([*public, "--control-token-file", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "control token file" in err and "cannot read it" in err and err.count("\n") == 1
    assert main(["switch", "--config", str(path), "--control-token-file", str(path)]) == 1
    assert "--control-token-file: this switch has no control port" in capsys.readouterr().err


@pytest.mark.parametrize("cores", [1, 2] if BATCHED_AVAILABLE else [1])
def test_switch_without_a_job_file_takes_jobs_through_its_control_port(tmp_path, capsys, cores):
    assert main(["switch", "--address", "127.0.0.1:1"]) == 1
    assert "with no --config, give --address" in capsys.readouterr().err
    udp, control = free_ports(1)[0], free_ports(1, socket.SOCK_STREAM)[0]
    proc, _ = spawn_switch(None, tmp_path / "ready.json",
                           switch_args=("--address", f"127.0.0.1:{udp}", "--control", f"127.0.0.1:{control}",
                                        "--cores", str(cores)))
    try:
        cfg = loopback_config(2, switch_port=udp, control=control, k=64)
        path = cfg.write(tmp_path / "job.toml")
        assert main(["deploy", "--config", str(path)]) == 0
        results = run_ranks(2, lambda r: Client(cfg, r).allreduce(np.full(100, r + 1, dtype=np.int32)))
        assert all(np.array_equal(res, np.full(100, 3)) for res in results)
        capsys.readouterr()
        assert main(["status", "--json", "--config", str(path)]) == 0
        assert json.loads(capsys.readouterr().out)["counters"]["results_multicast"] > 0
        status = request(cfg.control, {"op": "status"})
        assert status["cores"] == cores and sum(s["datagrams"] for s in status["shards"]) > 0
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="several cores need Linux's batched sockets")
def test_switch_on_two_cores_says_so_and_how_it_steers(tmp_path):
    cfg = loopback_config(2, switch_port=free_ports(1)[0], k=64)
    path = cfg.write(tmp_path / "job.toml")
    proc, ready = spawn_switch(path, tmp_path / "ready.json", switch_args=("--cores", "2", "--steer", "slot"),
                               stdout=subprocess.PIPE, text=True)
    proc.terminate()
    out = proc.communicate(timeout=10)[0]
    assert ready["address"] == ["127.0.0.1", cfg.switch.port]
    assert ", 2 cores steered by slot)" in out


def test_a_bad_config_is_one_line_and_exit_status_1(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(loopback_config(2, switch_port=16711, k=64).to_toml().replace("values_per_packet = 64",
                                                                                  "valeus_per_packet = 64"))
    assert main(["status", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"switchagg status: {path}: job.valeus_per_packet is not a known key: "
                   "did you mean values_per_packet?\n")


@pytest.mark.parametrize(("tail", "message"), [
    ("# caf\xe9".encode("latin-1"), "is not UTF-8 text"),
    (b"x = " + b"[" * 1000 + b"]" * 1000, "nests arrays or tables too deep to read"),
    (b"x = " + b"9" * 5000, "holds a number too long to read"),
], ids=["latin-1", "nested", "5000-digits"])
def test_a_job_file_the_parser_cannot_read_is_one_line_and_exit_status_1(tmp_path, capsys, tail, message):
    path = tmp_path / "job.toml"
    path.write_bytes(loopback_config(2, switch_port=16711, k=64).to_toml().encode() + tail)
    for argv in (["status", "--config", str(path)], ["switch", "--config", str(path)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"switchagg {argv[0]}: job file {path} {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(("argv", "message"), [
    (["status", "--device-id", "1"], "--device-id: the embedded switch has no device id"),
    (["deploy", "--pipeline", "build/bmv2"], "--pipeline: the embedded switch runs no P4 program"),
    (["deploy", "--target", "tofino", "--pipeline", "build/tofino"], "--pipeline: bf_switchd loads the program"),
    (["bench", "--loss", "--mib", "1"], "--mib: `switchagg bench --loss` does not use it"),
    (["bench", "--loss", "--workers", "3"], "--workers: `switchagg bench --loss` does not use it"),
    (["bench", "--ddp", "--rounds", "2", "--plot", "x.png"],
     "--rounds, --plot: `switchagg bench --ddp` does not use them"),
    (["bench", "--loss-rates", "1"], "--loss-rates: `switchagg bench (throughput)` does not use it"),
    (["bench", "--loss-runs", "8"], "--loss-runs: `switchagg bench (throughput)` does not use it"),
    (["switch", "--slots", "0"], "--slots 0: a switch has 1..65536 slots"),
    (["switch", "--cores", "0"], "--cores 0: the switch runs on 1..64 cores"),
    (["switch", "--steer", "slot"], "--steer: a switch on one core steers nothing"),
    (["bench", "--switch-steer", "job"], "--switch-steer: a switch on one core steers nothing"),
    (["bench", "--loss", "--switch-cores", "2"], "--switch-cores: `switchagg bench --loss` does not use it"),
    (["bench", "--ddp", "--switch-steer", "slot"], "--switch-steer: `switchagg bench --ddp` does not use it"),
    (["bench", "--switch-cores", "65"], "--switch-cores 65: the switch runs on 1..64 cores"),
    (["bench", "--link-rate", "500", "--slots", "3"], "--slots: `switchagg bench --link-rate` does not use it"),
    (["bench", "--link-rate", "500", "--loss-rates", "1"],
     "--loss-rates: `switchagg bench --link-rate` does not use it"),
    (["bench", "--link-loss", "1"], "--link-loss: `switchagg bench (throughput)` does not use it"),
    (["bench", "--loss", "--link-burst", "2"], "--link-burst: `switchagg bench --loss` does not use it"),
    (["bench", "--ddp", "--workers", "2", "3"], "--workers 2 3: only `switchagg bench --link-rate` takes several"),
    (["bench", "--link-rate", "500", "--values-per-packet", "400"], "--values-per-packet 400: the bed's links carry"),
    (["bench", "--link-rate", "500", "--link-burst", "3"], "--link-burst 3: give a run of 1 or more packets, with"),
    (["bench", "--tree", "2x4", "--rounds", "2", "--mib", "1"], "--rounds, --mib: `switchagg bench --tree` does not"),
    (["bench", "--loss", "--tree-loss", "1"], "--tree-loss: `switchagg bench --loss` does not use it"),
    (["bench", "--tree", "5x8"], "--tree 5x8: 40 ranks, but the flat job the bench compares the tree with holds "
                                 "at most 32"),
    (["bench", "--tree", "2x4", "--tree-loss", "120"], "--tree-loss 120: a loss rate is a percentage from 0 to 99.9"),
])
def test_flags_a_mode_ignores_are_refused(make_job, tmp_path, capsys, argv, message):
    path = make_job(2, k=64).write(tmp_path / "job.toml")
    if argv[0] in ("status", "deploy", "switch"):
        argv = [*argv, "--config", str(path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_takes_one_mode():
    for modes in (["--loss", "--ddp"], ["--loss", "--link-rate", "500"], ["--tree", "2x4", "--loss"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *modes])


def test_every_flag_has_a_help_text_and_every_target_flag_says_its_default():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, sub in commands.choices.items()
               for a in sub._actions if a.option_strings and not a.help]
    assert missing == []
    for name in ("status", "reset", "deploy", "renew", "undeploy"):
        (target,) = [a for a in commands.choices[name]._actions if a.dest == "target"]
        assert "default: soft" in target.help
