"""`switchagg bench` runs end to end on a small tensor and prints its figures, the first K's ratios last."""

from __future__ import annotations

import re

import numpy as np
import pytest

from switchagg.benchmarks.throughput import codec_cpu, codec_speed, copy_speed, run_bench, udp_ceiling
from switchagg.benchmarks.training import run_training_bench
from switchagg.errors import ConfigError
from switchagg.transport import BATCHED_AVAILABLE

pytest.importorskip("torch")  # the gloo baseline


def test_bench_prints_both_ratios_per_k_with_the_first_ks_speed_ratio_last(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    assert run_bench(workers=2, mib=0.25, reps=2, ks=(64, 1024), rounds=2, plot=str(plot)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(bool(re.match(r"round \d: (switchagg|gloo) ", line)) for line in lines) == 6  # two K and gloo, twice
    per_core = r"round \d: switch K=\d+ on 1 core: \d+k packets/s per core, \d+ ns of CPU per packet \(\d+ user \+ \d+ "
    assert sum(bool(re.match(per_core + r"system\)", line)) for line in lines) == 4
    split = r"codec [\d.]+ \+ protocol -?[\d.]+ \+ kernel [\d.]+"  # protocol: user time less an estimate
    assert sum(bool(re.match(rf"round \d: switchagg K=\d+ .*worker CPU [\d.]+ s/GiB \({split}\)", line))
               for line in lines) == 4
    where = re.compile(r"K=(\d+): where the time goes: workers' CPU ([\d.]+) s/GiB \(the median round's\) = "
                       r"codec ([\d.]+) \+ protocol (-?[\d.]+) \+ kernel ([\d.]+): .*; the switch's CPU per packet "
                       r"(\d+) ns = (\d+) user \+ (\d+) system")
    found = {int(m.group(1)): [float(g) for g in m.groups()[1:]] for m in map(where.match, lines) if m}
    assert sorted(found) == [64, 1024]
    for total, codec, protocol, kernel, per_packet, user, system in found.values():
        assert total == pytest.approx(codec + protocol + kernel, abs=0.02) and codec > 0 and kernel >= 0
        assert per_packet == pytest.approx(user + system, abs=1)  # the switch's CPU: clock ticks, maybe none here
    assert any(re.fullmatch(r"K=1024 per round: ratio_vs_gloo [\d.]+ [\d.]+; host_cpu_ratio_vs_gloo [\d.]+ [\d.]+",
                            line) for line in lines)
    assert any(re.fullmatch(r"ratio_vs_gloo_k1024=\d+\.\d{3}", line) for line in lines)
    assert any(re.fullmatch(r"switch_pps_per_core=\d+", line) for line in lines)
    codec = re.compile(r"K=(\d+): .* quantize\+pack ([\d.]+) GB/s, unpack\+dequantize ([\d.]+) GB/s \(([\d.]+)x and "
                       r"([\d.]+)x a plain copy's ([\d.]+) GB/s\); .*")
    speeds = {int(m.group(1)): [float(g) for g in m.groups()[1:]] for m in map(codec.match, lines) if m}
    assert sorted(speeds) == [64, 1024]
    for enc, dec, enc_x, dec_x, copy in speeds.values():  # the ratios are the speeds over the copy's
        assert enc_x == pytest.approx(enc / copy, abs=0.01) and dec_x == pytest.approx(dec / copy, abs=0.01)
    assert any(re.fullmatch(r"K=64: packets/s per worker \d+k out, \d+k in; pps_vs_gso_ceiling=\d+\.\d{3} .*", line)
               for line in lines)
    assert re.fullmatch(r"host_cpu_ratio_vs_gloo=\d+\.\d{3}", lines[-2])
    ratio = float(re.fullmatch(r"ratio_vs_gloo=(\d+\.\d{3})", lines[-1]).group(1))
    assert ratio > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_codec_cpu_times_the_codec_s_loops_over_every_window():
    """The loops leave ``out`` what a quantization round trip gives (so each ran over every window), and take time."""
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    out = np.zeros_like(x)
    assert codec_cpu(x, out, 64, 4, 16) > 0
    assert np.allclose(out, x, atol=1e-5) and out[-1] != 0


def test_codec_speed_runs_every_packet_through_the_stream():
    enc, dec = codec_speed(64, 4, numel=1 << 16)
    assert enc > 0 and dec > 0


def test_copy_speed_times_a_copy():
    assert copy_speed(1 << 16) > 0


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="the ceiling uses the Linux batch calls")
def test_udp_ceiling_moves_datagrams():
    assert udp_ceiling(280, seconds=0.2) > 0


def test_the_loss_bench_refuses_no_rounds_before_it_builds_anything():
    from switchagg.benchmarks.loss import run_loss_bench
    from switchagg.errors import SwitchAggError

    with pytest.raises(SwitchAggError, match="--rounds must be 1 or more, not 0"):
        run_loss_bench(rounds=0)


def test_training_bench_prints_the_step_ratio_and_what_a_rank_receives(capsys):
    """FSDP2's reduce-scatter brings a rank well under what DDP's all-reduce of the same model brings."""
    received = {}
    for kind in ("ddp", "fsdp"):
        assert run_training_bench(kind, workers=2, steps=2, width=512, depth=2) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert re.fullmatch(rf"ratio_vs_gloo_{kind}=\d+\.\d{{3}}", lines[-2])
        received[kind] = float(re.fullmatch(rf"received_vs_gradients_{kind}=(\d+\.\d{{3}})", lines[-1]).group(1))
    assert received["ddp"] > 1.0  # every sum, with headers and the call rounds
    assert received["fsdp"] < 0.75 * received["ddp"], received


def test_training_bench_on_nodes_sends_each_ranks_shard_through_its_rail(capsys):
    """Two nodes of two ranks: each rank sends about half of what it sends as a worker of one flat job."""
    assert run_training_bench("ddp", workers=4, steps=2, width=256, depth=2, nodes=2) == 0
    out = capsys.readouterr().out
    figures = dict(re.findall(r"^(\w+)=(\d+\.\d{3})$", out, re.M))
    assert {"ratio_vs_gloo_ddp_nodes", "ratio_vs_flat_ddp_nodes", "ratio_vs_gloo_ddp"} <= figures.keys(), out
    flat = float(re.search(r"^switchagg: per rank and step through the switch: sent [\d.]+ MiB \(([\d.]+)x", out,
                           re.M).group(1))
    assert 0.4 * flat < float(figures["sent_vs_gradients_ddp_nodes"]) < 0.6 * flat, out
    assert "each rail's 2 ranks" in out
    with pytest.raises(ConfigError, match="--nodes 3"):
        run_training_bench("ddp", workers=4, nodes=3)
