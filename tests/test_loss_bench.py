"""The loss bench: its sequences and figures, and (as root, in namespaces) its beds' drop rules and offloads."""

from __future__ import annotations

import os
import re
import socket
import struct

import numpy as np
import pytest

from switchagg.benchmarks.loss import (
    GSO,
    RANDOM_MAX,
    SWITCH_IP,
    Bed,
    Calls,
    Row,
    call_slowdowns,
    call_times,
    dropped_datagrams,
    growing_calls,
    missing,
    random_calls,
    run_length,
    run_loss_bench,
    tables,
)
from switchagg.errors import SwitchAggError

from .conftest import need

WORKER_IP = "10.81.0.1"  # worker 0's address in a bed


def test_the_loss_bench_random_sequence_is_seeded_and_its_slowdowns_are_per_call():
    calls = random_calls()
    assert calls == random_calls() and len({f for _, f in calls}) == 2
    assert all(1 <= n <= RANDOM_MAX for n, _ in calls)
    marks = [{"random_marks": np.array([0.0, 1.0, 3.0])}, {"random_marks": np.array([0.5, 1.5, 2.0])}]
    assert list(call_times(marks, "random")) == [1.0, 1.5]  # the last rank's end of one call to its end of the next
    median, p99, worst, total = call_slowdowns(np.array([1.0, 2.0, 9.0]), np.array([1.0, 1.0, 1.0]))
    assert (median, worst, total) == (2.0, 9.0, 4.0) and 2.0 < p99 < 9.0


def test_the_growing_sequence_doubles_from_one_value_to_the_largest_twice_in_both_types():
    calls = growing_calls()
    sizes = [1 << b for b in range(19)]
    assert sizes[-1] == RANDOM_MAX and [n for n, _ in calls] == sizes + sizes
    assert [f for _, f in calls] == [i % 2 == 1 for i in range(38)]  # int32 first, then in turn
    assert all({f for n, f in calls if n == size} == {False, True} for size in sizes)  # each size in both


def test_the_loss_bench_refuses_a_run_length_or_rate_it_cannot_make_before_it_builds_anything():
    for runs, rates, message in (((0,), (0.0,), "--loss-runs 0: give run lengths"),
                                 (("burst",), (0.0,), "--loss-runs burst: give run lengths"),
                                 ((1,), (0.0, 120.0), "--loss-rates 120: a loss rate is a percentage from 0 to 99.9")):
        with pytest.raises(SwitchAggError, match=message):
            run_loss_bench(runs=runs, rates=rates)


def _row(runs: int | str, length: float | None, rate: float, finished: int = 1, failed: int = 0) -> Row:
    calls = Calls(1.0, 1.5, 1.2, 3.0, 4.0)
    return Row("resend", runs, length, rate, 0.5, 2.0, 1.8, 2.2, 10, 0, 40, True,
               {"random": calls, "growing": calls}, finished, failed)


def test_the_tables_print_the_run_length_next_to_the_rate_and_name_each_bed_in_the_summary():
    table = {(7, "resend", runs): [_row(runs, length if rate else None if runs == GSO else length, rate)
                                   for rate in (0.0, 5.0)]
             for runs, length in ((1, 1.0), (8, 8.0), (GSO, 41.26))}
    out = tables(table, rounds=1)
    headers = [line for line in out.splitlines() if line.startswith("workers")]
    assert len(headers) == 3 and all("  recovery  runs  run_len  loss%  " in h for h in headers), out
    rows = re.findall(r"^ +7 +resend +(\S+) +(\S+) +([\d.]+) ", out, re.M)
    expect = [("1", "1", "0"), ("1", "1", "5"), ("8", "8", "0"), ("8", "8", "5"), ("gso", "-", "0"),
              ("gso", "41.3", "5")]
    assert rows == expect * 3, out  # the loss table, the random sequence's and the growing one's
    assert "slowdown_at_max_loss=7w-resend:2.00 7w-resend-runs8:2.00 7w-resend-gso:2.00" in out
    assert "growing_at_max_loss=7w-resend:total 1.50 p99 3.00 " in out


def test_a_row_says_how_many_of_its_runs_failed():
    out = tables({(7, "resend", 64): [_row(64, 64.0, 1.0, finished=2, failed=1), _row(64, 64.0, 5.0, 0, 3)]}, 3)
    assert re.findall(r"  (yes, 1 failed|failed)$", out, re.M) == ["yes, 1 failed", "failed"], out


def test_the_plot_draws_each_run_length_and_the_failed_ones(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from switchagg.benchmarks import loss

    drawn = []
    monkeypatch.setattr(loss, "_plot_failed", lambda ax, x, color: drawn.append(x))
    table = {(7, "resend", runs): [_row(runs, length, 0.0), _row(runs, length, 5.0, finished=0, failed=1)]
             for runs, length in ((1, 1.0), (64, 64.0))}
    loss._plot(str(tmp_path / "loss.png"), table)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and drawn == [1.0, 64.0] * 3  # a cross a panel


def test_a_gso_drop_counts_the_datagrams_its_bytes_held():
    assert dropped_datagrams(GSO, 2, 2 * (28 + 64 * 280), 64) == 128  # two super-packets of 64
    assert dropped_datagrams(8, 16, 16 * 308, 64) == 16  # without offloads a packet is a datagram
    assert run_length(GSO, 128, 2) == 64.0 and run_length(GSO, 0, 0) is None and run_length(8, 0, 0) == 8.0


@pytest.fixture
def bed_of():
    """A bed of one worker, under a prefix of this process's (a bench running beside the tests keeps its beds)."""
    need("netns", missing())
    from switchagg import netns

    prefix = f"salt{os.getpid()}"

    def make(offloads: bool) -> Bed:
        return Bed(1, offloads=offloads, prefix=prefix)

    yield make
    for ns in netns.namespaces(prefix):
        netns.delete_namespace(ns)


def _udp(ns: str, address: tuple[str, int]) -> socket.socket:
    from switchagg import netns

    s = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: every datagram sent here fits
    s.bind(address)
    s.settimeout(10)  # a datagram that never comes fails the test instead of hanging it
    return s


def _marker(tx: socket.socket, rx: socket.socket) -> None:
    """A datagram the drop rules let through, sent and received: the path (its neighbour entry too) is up,
    and whatever went the same way before it has met the rules."""
    tx.sendto(b"marker", rx.getsockname())
    assert rx.recv(64) == b"marker"


@pytest.mark.netns
def test_a_run_bed_drops_runs_of_exactly_n_packets_at_the_rate(bed_of):
    bed = bed_of(offloads=False)
    n, period = 8, 160  # 8 in a row at 5%
    bed.impair(n, 5.0, dup=0)
    switch, tx = _udp(bed.ns(None), (SWITCH_IP, 16711)), _udp(bed.ns(0), (WORKER_IP, 45000))
    _marker(tx, _udp(bed.ns(None), (SWITCH_IP, 16712)))
    sent = 3 * period + 1  # the last passes
    for seq in range(sent):
        tx.sendto(seq.to_bytes(4, "big"), (SWITCH_IP, 16711))
    arrived: set[int] = set()
    while sent - 1 not in arrived:
        arrived.add(int.from_bytes(switch.recv(64), "big"))
    lost = sorted(set(range(sent)) - arrived)
    assert lost == [s for p in range(3) for s in range(p * period + period - n, (p + 1) * period)], lost
    assert bed.drops()[0] == len(lost)


@pytest.mark.netns
def test_the_gso_bed_passes_a_segmented_send_whole_each_way_and_counts_its_datagrams(bed_of):
    bed = bed_of(offloads=True)
    bed.impair(GSO, 50.0, dup=0)  # half the switchagg packets dropped and counted, each way
    switch, worker = _udp(bed.ns(None), (SWITCH_IP, 16711)), _udp(bed.ns(0), (WORKER_IP, 45000))
    switch_marks, worker_marks = _udp(bed.ns(None), (SWITCH_IP, 16712)), _udp(bed.ns(0), (WORKER_IP, 45001))
    _marker(worker_marks, switch_marks)
    _marker(switch_marks, worker_marks)
    segment = [(socket.SOL_UDP, 103, struct.pack("=H", 280))]  # UDP_SEGMENT, as switchagg.transport sends
    for _ in range(20):  # all 40 pass at 50% once in 2**40 runs
        worker.sendmsg([os.urandom(64 * 280)], segment, 0, (SWITCH_IP, 16711))
        switch.sendmsg([os.urandom(64 * 280)], segment, 0, (WORKER_IP, 45000))
    _marker(worker_marks, switch_marks)
    _marker(switch_marks, worker_marks)
    packets, nbytes = bed.drops()
    dropped = dropped_datagrams(GSO, packets, nbytes, 64)
    assert 0 < packets < 40 and dropped == 64 * packets  # a link without its offloads would cut each into 64
    assert run_length(GSO, dropped, packets) == 64.0


@pytest.mark.netns
def test_the_loss_bench_reports_each_bed_with_its_run_length(capsys):
    need("netns", missing())
    assert run_loss_bench(worker_counts=(2,), rates=(0.0, 1.0), recoveries=("resend",), runs=(8, GSO)) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +2 +resend +(\S+) +(\S+) +([\d.]+) +[\d.]+ +[\d.]+ +- +\d+ +\d+ +(\d+) .* (yes|NO)$",
                      out, re.M)
    assert [r[0] for r in rows] == ["8", "8", GSO, GSO] and all(r[4] == "yes" for r in rows), out
    assert rows[1][1] == "8" and int(rows[1][3]) > 0 and int(rows[3][3]) > 0, out
    assert rows[2][1] == "-" and float(rows[3][1]) > 8, out  # the gso bed's drops took super-packets
    assert re.search(r"^2 workers, resend, 1% loss, runs gso \([\d.]+ datagrams a drop\), round 1:", out, re.M), out
    # each sequence's slowest call says what its ranks resent and asked in it: a slow call that resent nothing
    # waited for the host, not for a recovery
    slowest = re.findall(r"^  (random|growing) sequence [\d.]+ s \([\d.]+x\), .* ms, resent (\d+), asked (\d+)\)$",
                         out, re.M)
    assert [name for name, _, _ in slowest] == ["random", "growing"] * 4, out


@pytest.mark.netns
def test_a_bench_takes_down_the_beds_of_dead_benches_only():
    need("netns", missing())
    from switchagg import netns
    from switchagg.benchmarks.loss import PREFIX, own_prefix

    dead, alive = f"{PREFIX}{2**22 + 1}-sw", f"{PREFIX}1-sw"  # above any pid_max; init's, which lives
    for ns in (dead, alive):
        netns.add_namespace(ns)
    try:
        assert own_prefix() == f"{PREFIX}{os.getpid()}"
        assert netns.namespaces(f"{PREFIX}{2**22 + 1}-") == [] and netns.namespaces(alive) == [alive]
    finally:
        for ns in (dead, alive):
            netns.delete_namespace(ns)


@pytest.mark.netns
@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_run_is_reported_and_the_bench_goes_on(capsys, monkeypatch, failing):
    """A run whose call stalls leaves its row failed and the exit status 1; a failed lossless run leaves
    the rates after it without a baseline, failed too."""
    need("netns", missing())
    from switchagg.benchmarks import loss

    real, calls = loss._run, []

    def run(*args):
        calls.append(args)
        if len(calls) == failing:
            raise SwitchAggError("loss bench worker 1 failed: Traceback ...\nStallError: no result for 30.0 s")
        return real(*args)

    monkeypatch.setattr(loss, "_run", run)
    assert run_loss_bench(worker_counts=(2,), rates=(0.0, 1.0), recoveries=("resend",)) == 1
    out = capsys.readouterr().out
    line = re.search(r"^2 workers, resend, (\S+)% loss, runs 1, round 1: FAILED \(StallError: no result for 30.0 s\)"
                     r"(.*)$", out, re.M)
    assert line and line[1] == ("0" if failing == 1 else "1"), out
    assert line[2] == (", so no lossless time for the rates after it" if failing == 1 else ""), out
    verdicts = re.findall(r"^ +2 +resend +1 +1 +([\d.]+) .*  (yes|NO|failed)$", out, re.M)
    assert verdicts == ([("0", "failed"), ("1", "failed")] if failing == 1 else [("0", "yes"), ("1", "failed")]), out
    assert len(calls) == failing  # the bench went on after a lossy run failed; it had nothing to compare with after


@pytest.mark.netns
def test_a_run_past_the_limit_fails_and_the_bench_goes_on(capsys, monkeypatch):
    need("netns", missing())
    from switchagg.benchmarks import loss

    monkeypatch.setattr(loss, "RUN_LIMIT", 0.01)  # no job's workers start that fast
    assert run_loss_bench(worker_counts=(2,), rates=(0.0, 1.0), recoveries=("resend",), runs=(1, 8)) == 1
    out = capsys.readouterr().out
    assert len(re.findall(r"^2 workers, resend, 0% loss, runs (1|8), round 1: FAILED \(loss bench worker 0 had not "
                          r"finished after 0.01 s\), so no lossless time", out, re.M)) == 2, out
