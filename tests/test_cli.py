"""The command line against a running embedded switch."""

from __future__ import annotations

from switchagg.__main__ import main
from switchagg.transport import BATCHED_AVAILABLE


def test_status_names_the_job_its_counters_and_the_switchs_transport(make_job, soft_switch, tmp_path, capsys):
    cfg = make_job(2, k=64)
    path = cfg.write(tmp_path / "job.toml")
    assert main(["status", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"transport {soft_switch.backend})" in out
    assert ("sendmmsg+GSO/recvmmsg+GRO" in out) == BATCHED_AVAILABLE
    assert f"job {cfg.job_id}: generation" in out and "contributions" in out and "malformed" in out
