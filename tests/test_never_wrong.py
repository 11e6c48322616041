"""Never a wrong sum (issue 27): a restarted job, one rank's bad input, mismatched calls (allreduces and
reduce-scatters), a prompt close.

Each case once handed a rank a value that was not the sum (or hung), on the embedded switch with
two ranks and K = 64, through the public API.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from switchagg import Client, QuantizationError
from switchagg import client as client_module
from switchagg.config import Endpoint
from switchagg.errors import CallMismatch, ClosedError, PeerFailed
from switchagg.window import Window
from switchagg.wire import PacketType, unpack_header

from .conftest import calls_on_ranks, run_ranks


def allreduce(x, **kw):
    return lambda c: c.allreduce(x, **kw)


def test_a_restarted_job_never_gets_the_last_runs_sums(make_job, soft_switch):
    """New clients of the same job, the switch still running and never reset, sum their own values:
    each run joins its peers in a fresh session, whose tags no earlier run used."""
    cfg = make_job(2, k=64, slot_count=16)
    first = calls_on_ranks(cfg, [[allreduce(np.ones(1000, np.float32))]] * 2)
    assert all(np.all(o[0] == 2.0) for o in first)
    second = calls_on_ranks(cfg, [[allreduce(np.full(1000, 5.0, np.float32))]] * 2)
    assert all(np.all(o[0] == 10.0) for o in second)
    counters = soft_switch.counters()["jobs"][cfg.job_id]
    assert counters["results_unicast"] == 0  # nothing of the first run was served as a repeat


def test_a_restart_whose_first_rank_climbs_the_earlier_runs_join_alone_strands_no_peer(make_job, soft_switch):
    """The earlier run joined and stopped before any call replaced its join's copies. The next run's rank 0
    comes alone: the switch serves it the earlier nonces and verdict as repeats, so it refuses that rung
    and waits at the next, which the switch has counted, before rank 1 starts. Rank 1 must still be
    served the earlier sums, follow rank 0 up, and both join one session of their own and sum in it
    (with every rung on slot 0, rank 0's next nonces replaced the copy rank 1 needed: both timed out)."""
    cfg = make_job(2, k=64, slot_count=16)

    def join(rank: int) -> int:
        with Client(cfg, rank, start_timeout=10, stall_timeout=3) as c:
            return c.join()

    earlier = run_ranks(2, join)
    assert len(set(earlier)) == 1 and isinstance(earlier[0], int)
    before = dict(soft_switch.counters()["jobs"][cfg.job_id])
    later: list[object] = [None, None]

    def join_and_sum(rank: int) -> None:
        try:
            with Client(cfg, rank, start_timeout=10, stall_timeout=3) as c:
                later[rank] = c.join(), c.allreduce(np.full(100, rank + 1, np.int32))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            later[rank] = exc

    first = threading.Thread(target=join_and_sum, args=(0,), daemon=True)
    first.start()
    deadline = time.monotonic() + 60
    while True:  # rank 0 was served the earlier rung (2 repeats) and its next rung's nonces were counted
        now = soft_switch.counters()["jobs"][cfg.job_id]
        if (now["results_unicast"] - before["results_unicast"] >= 2
                and now["contributions"] - before["contributions"] >= 1):
            break
        assert first.is_alive() and time.monotonic() < deadline, f"rank 0 never climbed alone: {later[0]!r}"
        time.sleep(0.01)
    second = threading.Thread(target=join_and_sum, args=(1,), daemon=True)
    second.start()
    for thread in (first, second):
        thread.join(60)
        assert not thread.is_alive(), "a rank hung"
    assert all(isinstance(result, tuple) for result in later), later
    sessions = {session for session, _ in later}
    assert len(sessions) == 1 and sessions != set(earlier)
    assert all(np.all(out == 3) for _, out in later)


def test_a_restart_after_a_longer_run_is_not_dropped_as_stale(make_job):
    """The earlier run went further (its chunk ids are newer than a new run's first ones)."""
    cfg = make_job(2, k=64, slot_count=4)
    calls_on_ranks(cfg, [[allreduce(np.ones(64 * 40, np.int32))] * 5] * 2)
    again = calls_on_ranks(cfg, [[allreduce(np.full(64 * 3, 7, np.int32))]] * 2)
    assert all(np.all(o[0] == 14) for o in again)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_value_reaches_every_rank_and_the_next_calls_stay_paired(make_job, bad):
    """Rank 0's tensor holds an inf or NaN in call 1 (an fp16 overflow under AMP): every rank gets it in
    that chunk's positions, finite sums elsewhere, and call 2 sums call 2's values."""
    cfg = make_job(2, k=64, slot_count=8)
    x0 = np.ones(640, np.float32)
    x0[70] = bad  # chunk 1 of 10
    per_rank = [[allreduce(x0), allreduce(np.full(640, 100.0, np.float32))],
                [allreduce(np.ones(640, np.float32)), allreduce(np.full(640, 100.0, np.float32))]]
    out = calls_on_ranks(cfg, per_rank)
    for first, second in out:
        assert not np.isfinite(first[64:128]).any()
        if np.isnan(bad):
            assert np.isnan(first[70])
        else:
            assert first[70] == bad
        assert np.all(first[:64] == 2.0) and np.all(first[128:] == 2.0)
        assert np.all(second == 200.0)


def test_non_finite_can_raise_on_every_rank_for_the_same_call(make_job):
    cfg = make_job(2, k=64, slot_count=8)
    x0 = np.ones(100, np.float32)
    x0[3] = np.inf
    per_rank = [[allreduce(x0), allreduce(np.full(10, 3.0, np.float32))],
                [allreduce(np.ones(100, np.float32)), allreduce(np.full(10, 3.0, np.float32))]]
    for first, second in calls_on_ranks(cfg, per_rank, nonfinite="raise"):
        assert isinstance(first, QuantizationError)
        assert np.all(second == 6.0)


def test_one_ranks_unusable_input_fails_that_call_on_every_rank(make_job):
    """Rank 0 passes a dtype that cannot be reduced: it raises its own error, rank 1 a PeerFailed, for
    the same call, and the next call sums what both pass next."""
    cfg = make_job(2, k=64, slot_count=8)
    per_rank = [[allreduce(np.ones(10, np.int64)), allreduce(np.full(10, 20, np.int32))],
                [allreduce(np.ones(10, np.int32)), allreduce(np.full(10, 20, np.int32))]]
    (mine, after0), (theirs, after1) = calls_on_ranks(cfg, per_rank)
    assert isinstance(mine, TypeError) and "dtype" in str(mine)
    assert isinstance(theirs, PeerFailed) and "[0]" in str(theirs)
    assert np.all(after0 == 40) and np.all(after1 == 40)


@pytest.mark.parametrize("calls", [
    ((1000, np.float32, "sum"), (1001, np.float32, "sum")),  # lengths
    ((1000, np.float32, "sum"), (1000, np.int32, "sum")),  # kinds
    ((1000, np.float32, "sum"), (1000, np.float32, "mean")),  # ops
    ((64 * 20, np.float32, "sum"), (64 * 3, np.float32, "sum")),  # call rounds of different sizes
    ((0, np.float32, "sum"), (5, np.float32, "sum")),  # an empty call against one that is not
], ids=["length", "kind", "op", "rounds", "empty"])
def test_mismatched_calls_raise_on_every_rank_and_the_next_calls_stay_paired(make_job, calls):
    cfg = make_job(2, k=64, slot_count=8)
    per_rank = [[allreduce(np.ones(size, dtype), op=op), allreduce(np.full(300, 4, np.int32))]
                for size, dtype, op in calls]
    out = calls_on_ranks(cfg, per_rank)
    for first, second in out:
        assert isinstance(first, CallMismatch), first
        assert "rank 0" in str(first) and "rank 1" in str(first)
        assert np.all(second == 8)


@pytest.mark.parametrize("calls", [
    (("allreduce", 1000), ("reduce_scatter", 1000)),  # the collective
    (("reduce_scatter", 1000), ("reduce_scatter", 1002)),  # lengths
    (("reduce_scatter", 64 * 40), ("reduce_scatter", 64 * 4)),  # call rounds of different sizes
    (("reduce_scatter", 0), ("allreduce", 0)),  # empty calls
], ids=["collective", "length", "rounds", "empty"])
def test_a_reduce_scatter_against_another_call_raises_on_every_rank_and_the_next_calls_stay_paired(make_job, calls):
    """A rank's allreduce never sums with another's reduce-scatter of the same tensor (one would get the
    others' values back where it expected a shard, the others a shard's worth of sums), nor do
    reduce-scatters of different lengths (each rank's shard would be a different slice)."""
    cfg = make_job(2, k=64, slot_count=8)
    per_rank = [[lambda c, collective=collective, size=size: getattr(c, collective)(np.ones(size, np.float32)),
                 lambda c: c.reduce_scatter(np.full(300, 4, np.int32))] for collective, size in calls]
    for first, second in calls_on_ranks(cfg, per_rank):
        assert isinstance(first, CallMismatch), first
        assert "reduce_scatter" in str(first) and "rank 0" in str(first) and "rank 1" in str(first)
        assert second.shape == (150,) and np.all(second == 8)


def test_a_skipped_call_is_a_mismatch_not_a_shifted_sum(make_job):
    """Calls of equal length and kind at different places in the sequence never sum."""
    cfg = make_job(2, k=64, slot_count=8)
    x = np.ones(100, np.float32)
    out = calls_on_ranks(cfg, [[lambda c: c.submit(lambda: setattr(c, "_seq", c._seq + 1)).result(),
                                allreduce(x)], [lambda c: None, allreduce(x)]])
    assert isinstance(out[0][1], CallMismatch) and isinstance(out[1][1], CallMismatch)
    assert "call #1" in str(out[0][1]) and "call #0" in str(out[0][1])


HOUR = 3600.0  # longer than any test runs: a timer this long never ends a wait here


@pytest.fixture
def timers_off(monkeypatch) -> None:
    """The client's own timers (a wait's wake, a probe's resend) an hour long: a call that ends while they
    are ended because of close."""
    monkeypatch.setattr(client_module, "_WAKE", HOUR)
    monkeypatch.setattr(client_module, "_PROBE_EVERY", HOUR)


def assert_closes_promptly(client: Client, waiting: Callable[[], None]) -> None:
    """A call starts; once ``waiting`` returns (a sign from outside that the call waits), close() returns
    and the call fails because the client closed while it ran. Every timer of the call is an hour long,
    so a close that waits for one hangs, and fails here."""
    future = client.allreduce_async(np.ones(10, np.float32))
    waiting()
    closer = threading.Thread(target=client.close, daemon=True)  # a close that hangs fails the test, not the run
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close() did not end the call waiting"
    with pytest.raises(ClosedError, match="closed during this call"):
        future.result(timeout=0)


def test_close_returns_promptly_during_the_start_up_probe(timers_off, make_job):
    """No switch answers this job (its address is a socket that only listens): once the listener has
    the call's probe, close() (what Ctrl-C inside ``with Client(...)`` runs) ends the call and returns."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(60)
        silent = replace(make_job(2, k=64), switch=Endpoint(*listener.getsockname()))

        def waiting() -> None:
            assert unpack_header(listener.recv(2048)).type == PacketType.PROBE

        assert_closes_promptly(Client(silent, 0, start_timeout=HOUR), waiting)


def test_close_returns_promptly_during_a_call_waiting_for_a_peer(timers_off, make_job, soft_switch):
    """Rank 1 never comes: rank 0's first call waits for it in the join's first sum (in the C loop, with
    its round-trip timeout an hour long) once the switch has counted rank 0's part, until close() ends it."""
    cfg = make_job(2, k=64)
    client = Client(cfg, 0, start_timeout=HOUR, stall_timeout=HOUR)
    client.window = Window(cfg.slot_count, min_rto=HOUR, initial_rto=HOUR, max_rto=HOUR)

    def waiting() -> None:  # the switch counted rank 0's contribution: it waits for rank 1's
        deadline = time.monotonic() + 60
        while not soft_switch.counters()["jobs"][cfg.job_id]["contributions"]:
            assert time.monotonic() < deadline, "rank 0's contribution never reached the switch"
            time.sleep(0.01)

    assert_closes_promptly(client, waiting)


def test_no_future_is_left_unresolved_when_submit_races_close(make_job):
    cfg = make_job(1, k=64)
    def submit_many(client, futures):
        for _ in range(50):
            try:
                futures.append(client.submit(lambda: 1))
            except ClosedError:
                return

    for _ in range(20):
        client = Client(cfg, 0)
        futures = []
        t = threading.Thread(target=submit_many, args=(client, futures))
        t.start()
        client.close()
        t.join()
        for f in futures:
            f.exception(timeout=2)  # resolved: a result or an error, never a wait
