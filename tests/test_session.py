"""The join handshake (:mod:`switchagg.session`) where earlier runs left state under its tags.

Each rank's :class:`~switchagg.session.Join` runs its phases as the client does (``Client._exchange``: a
one-chunk int32 :class:`~switchagg.protocol.Reduction` on its rung's slot, no call round) against the switch's
reference model, which keeps every copy an earlier run left, finished or half-filled, as a switch that
was never reset does. A run that meets such a copy must refuse the rung on every rank and climb, and must
never take a session generation an earlier run took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from switchagg.payloads import Int32Payloads
from switchagg.protocol import Reduction
from switchagg.session import Join, Phase
from switchagg.switch.model import SwitchModel
from switchagg.window import Window
from switchagg.wire import PacketType, datagram_size, unpack_header

from .simnet import Impairment, Job, SimNet

JOB = Job(n=3, slots=4, k=8, generation=7)


def run_phase(model: SwitchModel, joins: dict[int, Join], ranks: list[int]) -> dict[int, bytes]:
    """Send the current phase of ``ranks``' joins through ``model``, lossless, as ``Client._exchange``
    does; returns the sum of each rank whose sum came back (none, where a rank's peers never sent)."""
    reds, outs = {}, {}
    for rank in ranks:
        phase = joins[rank].phase
        copies = np.zeros(JOB.slots, np.int64)
        copies[phase.slot] = phase.copy
        flat = phase.values.astype(np.int32)
        outs[rank] = np.empty_like(flat)
        reds[rank] = Reduction(replace(JOB.params(rank), generation=phase.generation), Window(JOB.slots),
                               Int32Payloads(flat, outs[rank], JOB.k), n_chunks=1, first_id=0, copies=copies,
                               now=0.0, progress_timeout=5.0, first_slot=phase.slot)
    rows, lengths = np.empty((4, datagram_size(JOB.k)), np.uint8), np.zeros(4, np.uint32)
    for rank, red in reds.items():
        while n := red.emit(rows, lengths):
            for row, length in zip(rows[:n], lengths[:n].tolist(), strict=True):
                for emit in model.process(row[:length].tobytes(), JOB.address(rank)):
                    data = emit.payload()
                    assert unpack_header(data).type == PacketType.RESULT
                    to = next(r for r in reds if JOB.address(r) == emit.dst)
                    reds[to].receive_batch(data, np.zeros(1, np.uint32), np.array([len(data)], np.uint32), 0.0)
    return {rank: outs[rank].astype(">i4").tobytes() for rank, red in reds.items() if red.done}


def exchange(model: SwitchModel, joins: dict[int, Join]) -> dict[int, bytes]:
    """Every rank's current phase, and each rank takes the sum it got (:meth:`Join.take`); returns the sums."""
    sums = run_phase(model, joins, sorted(joins))
    assert sorted(sums) == sorted(joins), "a phase's sum did not come back to every rank"
    for rank, join in joins.items():
        join.take(sums[rank])
    return sums


def model_with_job() -> SwitchModel:
    model = SwitchModel(16)
    model.add_job(JOB.entry())
    return model


def start() -> dict[int, Join]:
    """A run's ranks, each at its first rung (under the installed generation, which a probe tells)."""
    return {r: Join(JOB.generation, r, JOB.n, JOB.k, JOB.slots) for r in range(JOB.n)}


def join_all(model: SwitchModel, joins: dict[int, Join]) -> int:
    """Climb until the ranks agree; returns the session every rank took."""
    while any(j.session is None for j in joins.values()):
        exchange(model, joins)
    sessions = {j.session for j in joins.values()}
    assert len(sessions) == 1, f"the ranks took different sessions: {sessions}"
    return sessions.pop()


def test_a_run_on_a_fresh_switch_joins_at_the_first_rung():
    model = model_with_job()
    joins = start()
    session = join_all(model, joins)
    assert {j.rungs for j in joins.values()} == {0}
    assert session not in (0, JOB.generation)


def test_a_rung_where_an_earlier_run_stopped_after_its_nonces_is_refused_on_every_rank():
    """The earlier run died between its two phases: its finished nonce sum sits under the first rung's
    tag and is served to the new run as a repeat, so no rank finds its own nonce, every rank says no in
    the verdict (fresh: the earlier run never got there) and every rank refuses the rung and climbs."""
    model = model_with_job()
    earlier = start()
    earlier_nonces = exchange(model, earlier)
    joins = start()
    nonces = exchange(model, joins)
    assert nonces == earlier_nonces  # the earlier run's sum, not this run's
    verdicts = exchange(model, joins)
    flags = {np.frombuffer(v, ">u4")[0:2 * JOB.n:2].tolist() == [0] * JOB.n for v in verdicts.values()}
    assert flags == {True}  # every rank said its nonce did not come back
    assert {j.rungs for j in joins.values()} == {1} and all(j.session is None for j in joins.values())
    session = join_all(model, joins)
    assert {j.rungs for j in joins.values()} == {1}
    assert session not in (0, JOB.generation, earlier[0].phase.generation)


def test_a_verdict_an_earlier_run_left_is_never_taken():
    """The earlier run finished its handshake (every rank said yes) and stopped before any call replaced
    slot 0's copies: the new run is served the earlier nonce sum, so its verdict runs under the earlier
    verdict's tag and is served that verdict as a repeat, flags all yes but none of this run's words.
    No rank takes it (the earlier run's session would be this run's too); every rank climbs, and they
    agree on a session of their own."""
    model = model_with_job()
    earlier = start()
    earlier_session = join_all(model, earlier)
    joins = start()
    exchange(model, joins)
    stale = exchange(model, joins)
    for verdict in stale.values():
        assert np.frombuffer(verdict, ">u4")[0:2 * JOB.n:2].tolist() == [1] * JOB.n  # a yes from every rank
    assert all(j.session is None for j in joins.values()) and {j.rungs for j in joins.values()} == {1}
    session = join_all(model, joins)
    assert session != earlier_session


def test_a_verdict_half_filled_by_a_run_that_died_inside_it_is_refused_by_the_ranks_it_lacks():
    """The earlier run died inside its verdict: one rank's verdict was counted, the others' never sent.
    The new run's nonces are served the earlier nonce sum, and its verdict completes the half-filled
    copy: the earlier rank's words stand where the new rank 0's should, so rank 0 cannot find its own,
    and every rank (the others' words came back, and every flag says no) refuses alike."""
    model = model_with_job()
    earlier = start()
    exchange(model, earlier)
    assert run_phase(model, earlier, [0]) == {}  # counted, and waiting for the others
    joins = start()
    exchange(model, joins)
    own = {r: np.asarray(j.phase.values).astype(">i4").tobytes()[8 * r:8 * r + 8] for r, j in joins.items()}
    verdicts = exchange(model, joins)
    assert [verdicts[r][8 * r:8 * r + 8] == own[r] for r in range(JOB.n)] == [False] + [True] * (JOB.n - 1)
    assert {j.rungs for j in joins.values()} == {1}
    join_all(model, joins)


def test_a_rank_that_climbs_ahead_of_its_peers_through_an_earlier_runs_sums_does_not_strand_them():
    """An earlier run finished its handshake and stopped. The new run's rank 0 comes first: the switch
    serves it the earlier sums at once (repeats, no peer needed), so it refuses the rung and sends its
    next rung's nonces before the others have sent their first. Those go to the next rung's slot, so the
    others are still served the earlier sums, follow rank 0 up the same path, and complete its rung with
    it: every rank takes one session, not the earlier run's (a restart whose ranks start apart, as
    processes do)."""
    model = model_with_job()
    earlier = start()
    earlier_session = join_all(model, earlier)
    joins = start()
    first, rest = {0: joins[0]}, {r: j for r, j in joins.items() if r}
    for _ in range(2):  # rank 0 alone: the earlier nonces and verdict, served as repeats
        first[0].take(run_phase(model, first, [0])[0])
    assert first[0].rungs == 1
    assert run_phase(model, first, [0]) == {}  # its next rung's nonces: counted, waiting for its peers
    for _ in range(2):  # the others: the same earlier sums, and the same refusal
        sums = run_phase(model, rest, sorted(rest))
        assert sorted(sums) == sorted(rest)
        for rank, join in rest.items():
            join.take(sums[rank])
    assert {j.rungs for j in joins.values()} == {1}
    assert len({(j.phase.generation, j.phase.slot, j.phase.copy) for j in joins.values()}) == 1
    assert join_all(model, joins) != earlier_session
    assert {j.rungs for j in joins.values()} == {1}


def test_each_rung_has_a_slot_of_its_own_until_the_job_s_slots_run_out():
    """A rung's nonces and verdict share its slot (copies 0 and 1); the next rung moves on, wrapping
    around the job's slots: a run that climbs fewer rungs than the job has slots replaces no copy of
    the rungs it came by."""
    join = Join(JOB.generation, 0, JOB.n, JOB.k, 3)
    seen = []
    for _ in range(8):
        seen.append((join.phase.slot, join.phase.copy))
        join.take(np.zeros(JOB.k, ">i4").tobytes())  # no rank's words: every rung refused
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (0, 0), (0, 1)]


def tag(join: Join) -> tuple[int, int, int]:
    """Where a rank's current phase sums: its generation, slot and copy."""
    return join.phase.generation, join.phase.slot, join.phase.copy


@pytest.mark.parametrize("earlier_runs", [1, 2, 3])
def test_a_rank_that_runs_ahead_after_any_number_of_earlier_runs_waits_where_its_peers_follow(earlier_runs):
    """Earlier runs joined one after another and stopped (each later one climbed past the one before and
    closed). The new run's rank 0 runs every phase the switch answers alone, until one waits for its
    peers; the others, after it, must be served every sum it was and reach that same phase, where all
    complete it and agree on a session no earlier run took."""
    model = model_with_job()
    sessions = [join_all(model, start()) for _ in range(earlier_runs)]
    joins = start()
    first, rest = {0: joins[0]}, {r: j for r, j in joins.items() if r}
    while sums := run_phase(model, first, [0]):
        first[0].take(sums[0])
    while {tag(j) for j in rest.values()} != {tag(first[0])}:
        sums = run_phase(model, rest, sorted(rest))
        assert sorted(sums) == sorted(rest), "rank 0's phase replaced a copy its peers needed"
        for rank, join in rest.items():
            join.take(sums[rank])
    assert join_all(model, joins) not in sessions


def test_runs_that_join_and_stop_one_after_another_climb_one_rung_at_most():
    """A run that climbed closes: it replaces the first rung's verdict, so the next run meets a fresh
    verdict there, refuses and agrees a rung up, instead of following every earlier run's path one rung
    further (which would wrap around the job's slots, where a rank ahead strands its peers again)."""
    model = model_with_job()
    sessions, rungs = [], []
    for _ in range(2 * JOB.slots):
        joins = start()
        sessions.append(join_all(model, joins))
        rungs.append(joins[0].rungs)
    assert rungs == [0] + [1] * (2 * JOB.slots - 1) and len(set(sessions)) == len(sessions)


def test_a_rank_that_lost_the_close_s_sum_still_finds_it_after_its_peers_first_call_began():
    """The close replaces the first rung's verdict (slot 0's copy 1), not its nonces: copy 0 is where the
    run's first call round goes, which the ranks that took the close send at once. A rank whose close sum
    was lost must still be served it, after that call round's part is counted."""
    model = model_with_job()
    join_all(model, start())
    joins = start()
    while (joins[0].rungs, joins[0].phase.slot, joins[0].phase.copy) != (1, 0, 1):  # up to the close, a rung up
        exchange(model, joins)
    sums = run_phase(model, joins, sorted(joins))
    for rank in (0, 2):  # rank 1's sum was lost
        joins[rank].take(sums[rank])
    session = joins[0].session
    call_round = {r: SimpleNamespace(phase=Phase(session, 0, 0, np.zeros(JOB.k, ">i4"))) for r in (0, 2)}
    assert run_phase(model, call_round, [0, 2]) == {}  # counted, waiting for rank 1's
    again = run_phase(model, joins, [1])
    assert again == {1: sums[1]}
    joins[1].take(again[1])
    assert joins[1].session == session


def agreed(joins: dict[int, Join]) -> Callable[[], bool]:
    """Whether every rank of ``joins`` has taken its session, asked when called."""
    return lambda: all(j.session is not None for j in joins.values())


def lossy_join(sim: SimNet, joins: dict[int, Join], ranks: list[int], until: Callable[[], bool]) -> None:
    """Run ``ranks``' joins over ``sim`` (its losses, duplicates and reordering) until ``until()``, as the
    client does: each rank starts its next phase once its last one's sum came back."""
    while not until():
        for rank in ranks:
            w, join = sim.workers[JOB.address(rank)], joins[rank]
            if w.error is not None:
                raise w.error
            if w.red is not None and not w.red.done:
                continue
            if w.red is not None:
                join.take(w.out.astype(">i4").tobytes())
                w.red = None
            if join.session is None:
                phase = join.phase
                copies = np.zeros(JOB.slots, np.int64)
                copies[phase.slot] = phase.copy
                flat = phase.values.astype(np.int32)
                w.out = np.empty_like(flat)
                sim.launch(w, Reduction(replace(JOB.params(rank), generation=phase.generation), w.window,
                                        Int32Payloads(flat, w.out, JOB.k), n_chunks=1, first_id=0, copies=copies,
                                        now=sim.now, progress_timeout=60.0, first_slot=phase.slot))
        sim.run(until=sim.now + 0.05)


@pytest.mark.parametrize("earlier_runs", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_a_restart_whose_ranks_start_apart_joins_through_loss_duplication_and_reordering(earlier_runs, seed):
    """Earlier runs joined one after another and stopped (the second climbed and closed); the new run's
    rank 0 starts alone and runs until the switch has counted a part of its (a phase that waits for its
    peers), and only then do the others start: every datagram may be lost, doubled or overtaken, both
    ways. Every rank must agree on one session, no earlier run's."""
    model = model_with_job()
    bad = Impairment(loss=0.2, dup=0.1, latency=0.001, jitter=0.004)
    sim = SimNet(model, up=bad, down=bad, seed=seed)
    for rank in range(JOB.n):
        sim.add_worker(JOB, rank)
    earlier = set()
    for _ in range(earlier_runs):
        joins = start()
        lossy_join(sim, joins, list(range(JOB.n)), agreed(joins))
        earlier |= {j.session for j in joins.values()}
    assert len(earlier) == earlier_runs

    def counted() -> int:
        return model.counters()["jobs"][JOB.job_id]["contributions"]

    joins, before = start(), counted()
    lossy_join(sim, joins, [0], lambda: counted() > before)
    lossy_join(sim, joins, list(range(JOB.n)), agreed(joins))
    sessions = {j.session for j in joins.values()}
    assert len(sessions) == 1 and not sessions & earlier
