"""`switchagg bench` runs end to end on a small tensor and prints its figures, the ratios last."""

from __future__ import annotations

import re

import pytest

from switchagg.bench import run_bench

pytest.importorskip("torch")  # the gloo baseline


def test_bench_prints_both_ratios_with_the_speed_ratio_last(capsys):
    assert run_bench(workers=2, mib=0.25, reps=2, k=1024, slots=4, rounds=2) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("round ") for line in lines) == 4  # switchagg and gloo, each round
    assert re.fullmatch(r"per round: ratio_vs_gloo [\d.]+ [\d.]+; host_cpu_ratio_vs_gloo [\d.]+ [\d.]+", lines[-3])
    assert re.fullmatch(r"host_cpu_ratio_vs_gloo=\d+\.\d{3}", lines[-2])
    ratio = float(re.fullmatch(r"ratio_vs_gloo=(\d+\.\d{3})", lines[-1]).group(1))
    assert ratio > 0
