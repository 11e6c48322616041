"""The join handshake (:mod:`switchagg.session`) where earlier runs left state under its tags.

Each rank's :class:`~switchagg.session.Join` runs its phases as the client does (``Client._exchange``: an
int32 :class:`~switchagg.protocol.Reduction` of a chunk per slot of its rung's block, no call round) against
the switch's reference model, which keeps every copy an earlier run left, finished or half-filled, as a
switch that was never reset does. A run that meets such a copy must refuse the rung on every rank and climb,
and must never take a session generation an earlier run took. Every test runs with every rank's words in
one chunk (``narrow``) and with more ranks than a chunk holds (``wide``: each phase three chunks, which an
earlier run may have left fresh, finished or half-filled each on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
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

from .simnet import Impairment, Job, SimNet, Worker, tree

# 3 ranks' words in one chunk of K = 8, 4 rungs' slots; 10 ranks' in three chunks, a block of 3 slots a rung,
# and as many rungs' blocks in 12 slots
JOBS = {"narrow": Job(n=3, slots=4, k=8, generation=7), "wide": Job(n=10, slots=12, k=8, generation=7)}


@pytest.fixture(params=sorted(JOBS))
def job(request) -> Job:
    return JOBS[request.param]


def chunks(job: Job) -> int:
    """Chunks of a phase: as many as the ranks' two words each fill."""
    return -(-2 * job.ranks // job.k)


def copies_of(phase: Phase, slots: int, k: int) -> np.ndarray:
    """Each slot's copy for the phase's Reduction: the phase's copy on its slots, as ``Client._exchange`` sets."""
    copies = np.zeros(slots, np.int64)
    copies[phase.slot:phase.slot + phase.values.size // k] = phase.copy
    return copies


def run_phase(model: SwitchModel, job: Job, joins: dict[int, Join], ranks: list[int],
              only: Collection[int] | None = None) -> dict[int, bytes]:
    """Send the current phase of ``ranks``' joins through ``model``, lossless, as ``Client._exchange``
    does; returns the sum of each rank whose sum came back (none, where a rank's peers never sent).
    ``only``: the chunk ids that reach the switch (the others are lost on the way, every time)."""
    reds, outs = {}, {}
    for rank in ranks:
        phase = joins[rank].phase
        flat = phase.values.astype(np.int32)
        outs[rank] = np.empty_like(flat)
        reds[rank] = Reduction(replace(job.params(rank), generation=phase.generation), Window(job.slots),
                               Int32Payloads(flat, outs[rank], job.k), n_chunks=flat.size // job.k, first_id=0,
                               copies=copies_of(phase, job.slots, job.k), now=0.0, progress_timeout=5.0,
                               first_slot=phase.slot)
    rows, lengths = np.empty((4, datagram_size(job.k)), np.uint8), np.zeros(4, np.uint32)
    for rank, red in reds.items():
        while n := red.emit(rows, lengths):
            for row, length in zip(rows[:n], lengths[:n].tolist(), strict=True):
                if only is not None and unpack_header(row[:length].tobytes()).chunk not in only:
                    continue
                for emit in model.process(row[:length].tobytes(), job.address(rank)):
                    data = emit.payload()
                    assert unpack_header(data).type == PacketType.RESULT
                    to = next(r for r in reds if job.address(r) == emit.dst)
                    reds[to].receive_batch(data, np.zeros(1, np.uint32), np.array([len(data)], np.uint32), 0.0)
    return {rank: outs[rank].astype(">i4").tobytes() for rank, red in reds.items() if red.done}


def exchange(model: SwitchModel, job: Job, joins: dict[int, Join]) -> dict[int, bytes]:
    """Every rank's current phase, and each rank takes the sum it got (:meth:`Join.take`); returns the sums."""
    sums = run_phase(model, job, joins, sorted(joins))
    assert sorted(sums) == sorted(joins), "a phase's sum did not come back to every rank"
    for rank, join in joins.items():
        join.take(sums[rank])
    return sums


def model_with(job: Job) -> SwitchModel:
    model = SwitchModel(16)
    model.add_job(job.entry())
    return model


def start(job: Job) -> dict[int, Join]:
    """A run's ranks, each at its first rung (under the installed generation, which a probe tells)."""
    return {r: Join(job.generation, r, job.n, job.k, job.slots) for r in range(job.n)}


def join_all(model: SwitchModel, job: Job, joins: dict[int, Join]) -> int:
    """Climb until the ranks agree; returns the session every rank took."""
    while any(j.session is None for j in joins.values()):
        exchange(model, job, joins)
    sessions = {j.session for j in joins.values()}
    assert len(sessions) == 1, f"the ranks took different sessions: {sessions}"
    return sessions.pop()


def test_a_run_on_a_fresh_switch_joins_at_the_first_rung(job):
    model = model_with(job)
    joins = start(job)
    session = join_all(model, job, joins)
    assert {j.rungs for j in joins.values()} == {0}
    assert session not in (0, job.generation)


def test_a_rung_where_an_earlier_run_stopped_after_its_nonces_is_refused_on_every_rank(job):
    """The earlier run died between its two phases: its finished nonce sum sits under the first rung's
    tag and is served to the new run as a repeat, so no rank finds its own nonce, every rank says no in
    the verdict (fresh: the earlier run never got there) and every rank refuses the rung and climbs."""
    model = model_with(job)
    earlier = start(job)
    earlier_nonces = exchange(model, job, earlier)
    joins = start(job)
    nonces = exchange(model, job, joins)
    assert nonces == earlier_nonces  # the earlier run's sum, not this run's
    verdicts = exchange(model, job, joins)
    flags = {np.frombuffer(v, ">u4")[0:2 * job.n:2].tolist() == [0] * job.n for v in verdicts.values()}
    assert flags == {True}  # every rank said its nonce did not come back
    assert {j.rungs for j in joins.values()} == {1} and all(j.session is None for j in joins.values())
    session = join_all(model, job, joins)
    assert {j.rungs for j in joins.values()} == {1}
    assert session not in (0, job.generation, earlier[0].phase.generation)


def test_a_verdict_an_earlier_run_left_is_never_taken(job):
    """The earlier run finished its handshake (every rank said yes) and stopped before any call replaced
    slot 0's copies: the new run is served the earlier nonce sum, so its verdict runs under the earlier
    verdict's tag and is served that verdict as a repeat, flags all yes but none of this run's words.
    No rank takes it (the earlier run's session would be this run's too); every rank climbs, and they
    agree on a session of their own."""
    model = model_with(job)
    earlier = start(job)
    earlier_session = join_all(model, job, earlier)
    joins = start(job)
    exchange(model, job, joins)
    stale = exchange(model, job, joins)
    for verdict in stale.values():
        assert np.frombuffer(verdict, ">u4")[0:2 * job.n:2].tolist() == [1] * job.n  # a yes from every rank
    assert all(j.session is None for j in joins.values()) and {j.rungs for j in joins.values()} == {1}
    session = join_all(model, job, joins)
    assert session != earlier_session


def test_a_verdict_half_filled_by_a_run_that_died_inside_it_is_refused_by_the_ranks_it_lacks(job):
    """The earlier run died inside its verdict: one rank's verdict was counted, the others' never sent.
    The new run's nonces are served the earlier nonce sum, and its verdict completes the half-filled
    copy: the earlier rank's words stand where the new rank 0's should, so rank 0 cannot find its own,
    and every rank (the others' words came back, and every flag says no) refuses alike."""
    model = model_with(job)
    earlier = start(job)
    exchange(model, job, earlier)
    assert run_phase(model, job, earlier, [0]) == {}  # counted, and waiting for the others
    joins = start(job)
    exchange(model, job, joins)
    own = {r: np.asarray(j.phase.values).astype(">i4").tobytes()[8 * r:8 * r + 8] for r, j in joins.items()}
    verdicts = exchange(model, job, joins)
    assert [verdicts[r][8 * r:8 * r + 8] == own[r] for r in range(job.n)] == [False] + [True] * (job.n - 1)
    assert {j.rungs for j in joins.values()} == {1}
    join_all(model, job, joins)


def test_a_nonce_chunk_an_earlier_run_left_finished_beside_fresh_ones_makes_every_rank_refuse():
    """Wide phases, whose chunks an earlier run may have left each in another state: the earlier run died
    inside its nonces, where only the third chunk (ranks 8 and 9) was finished. The new run's nonces are
    served that chunk as a repeat and sum the others afresh, so ranks 8 and 9 find an earlier nonce and the
    others their own: each of the two says no, and every rank refuses the rung, the ranks whose chunks were
    all yes too. The run climbs and agrees on one session."""
    job = JOBS["wide"]
    model = model_with(job)
    assert run_phase(model, job, start(job), list(range(job.n)), only={2}) == {}  # chunks 0 and 1 were lost
    joins = start(job)
    exchange(model, job, joins)
    verdicts = exchange(model, job, joins)
    assert {np.frombuffer(v, ">u4")[0:2 * job.n:2].tolist() == [1] * 8 + [0] * 2 for v in verdicts.values()} == {True}
    assert {j.rungs for j in joins.values()} == {1} and all(j.session is None for j in joins.values())
    join_all(model, job, joins)
    assert {j.rungs for j in joins.values()} == {1}


def test_a_rank_that_climbs_ahead_of_its_peers_through_an_earlier_runs_sums_does_not_strand_them(job):
    """An earlier run finished its handshake and stopped. The new run's rank 0 comes first: the switch
    serves it the earlier sums at once (repeats, no peer needed), so it refuses the rung and sends its
    next rung's nonces before the others have sent their first. Those go to the next rung's slots, so the
    others are still served the earlier sums, follow rank 0 up the same path, and complete its rung with
    it: every rank takes one session, not the earlier run's (a restart whose ranks start apart, as
    processes do)."""
    model = model_with(job)
    earlier = start(job)
    earlier_session = join_all(model, job, earlier)
    joins = start(job)
    first, rest = {0: joins[0]}, {r: j for r, j in joins.items() if r}
    for _ in range(2):  # rank 0 alone: the earlier nonces and verdict, served as repeats
        first[0].take(run_phase(model, job, first, [0])[0])
    assert first[0].rungs == 1
    assert run_phase(model, job, first, [0]) == {}  # its next rung's nonces: counted, waiting for its peers
    for _ in range(2):  # the others: the same earlier sums, and the same refusal
        sums = run_phase(model, job, rest, sorted(rest))
        assert sorted(sums) == sorted(rest)
        for rank, join in rest.items():
            join.take(sums[rank])
    assert {j.rungs for j in joins.values()} == {1}
    assert len({(j.phase.generation, j.phase.slot, j.phase.copy) for j in joins.values()}) == 1
    assert join_all(model, job, joins) != earlier_session
    assert {j.rungs for j in joins.values()} == {1}


def test_each_rung_has_a_block_of_slots_of_its_own_until_the_job_s_slots_run_out(job):
    """A rung's nonces and verdict share its block of slots, one per chunk of a phase (copies 0 and 1);
    the next rung moves on to the next block, wrapping around the job's slots: a run that climbs fewer
    rungs than the job has blocks replaces no copy of the rungs it came by. Slots past the last whole
    block stay unused: blocks never overlap."""
    size = chunks(job)
    join = Join(job.generation, 0, job.n, job.k, 3 * size + size - 1)  # 3 blocks, and a block's room less one
    seen = []
    for _ in range(8):
        seen.append((join.phase.slot, join.phase.copy))
        assert join.phase.values.size == size * job.k
        join.take(np.zeros(size * job.k, ">i4").tobytes())  # no rank's words: every rung refused
    blocks = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (0, 0), (0, 1)]
    assert seen == [(block * size, copy) for block, copy in blocks]


def test_a_join_whose_chunks_the_slots_cannot_hold_says_what_to_change():
    with pytest.raises(ValueError, match="take 3 chunks of K = 8 values, a slot each, but the job has 2 slots: give "
                                         "it at least 3, or a larger K"):
        Join(7, 0, 10, 8, 2)


def tag(join: Join) -> tuple[int, int, int]:
    """Where a rank's current phase sums: its generation, first slot and copy."""
    return join.phase.generation, join.phase.slot, join.phase.copy


@pytest.mark.parametrize("earlier_runs", [1, 2, 3])
def test_a_rank_that_runs_ahead_after_any_number_of_earlier_runs_waits_where_its_peers_follow(job, earlier_runs):
    """Earlier runs joined one after another and stopped (each later one climbed past the one before and
    closed). The new run's rank 0 runs every phase the switch answers alone, until one waits for its
    peers; the others, after it, must be served every sum it was and reach that same phase, where all
    complete it and agree on a session no earlier run took."""
    model = model_with(job)
    sessions = [join_all(model, job, start(job)) for _ in range(earlier_runs)]
    joins = start(job)
    first, rest = {0: joins[0]}, {r: j for r, j in joins.items() if r}
    while sums := run_phase(model, job, first, [0]):
        first[0].take(sums[0])
    while {tag(j) for j in rest.values()} != {tag(first[0])}:
        sums = run_phase(model, job, rest, sorted(rest))
        assert sorted(sums) == sorted(rest), "rank 0's phase replaced a copy its peers needed"
        for rank, join in rest.items():
            join.take(sums[rank])
    assert join_all(model, job, joins) not in sessions


def test_runs_that_join_and_stop_one_after_another_climb_one_rung_at_most(job):
    """A run that climbed closes: it replaces the first rung's verdict, so the next run meets a fresh
    verdict there, refuses and agrees a rung up, instead of following every earlier run's path one rung
    further (which would wrap around the job's blocks of slots, where a rank ahead strands its peers again)."""
    model = model_with(job)
    runs = 2 * (job.slots // chunks(job))
    sessions, rungs = [], []
    for _ in range(runs):
        joins = start(job)
        sessions.append(join_all(model, job, joins))
        rungs.append(joins[0].rungs)
    assert rungs == [0] + [1] * (runs - 1) and len(set(sessions)) == len(sessions)


def test_a_rank_that_lost_the_close_s_sum_still_finds_it_after_its_peers_first_call_began(job):
    """The close replaces the first rung's verdict (its block's copy 1), not its nonces: copy 0 is where the
    run's first call round goes, which the ranks that took the close send at once. A rank whose close sum
    was lost must still be served it, after that call round's part is counted."""
    model = model_with(job)
    join_all(model, job, start(job))
    joins = start(job)
    while (joins[0].rungs, joins[0].phase.slot, joins[0].phase.copy) != (1, 0, 1):  # up to the close, a rung up
        exchange(model, job, joins)
    sums = run_phase(model, job, joins, sorted(joins))
    others = [r for r in joins if r != 1]
    for rank in others:  # rank 1's sum was lost
        joins[rank].take(sums[rank])
    session = joins[0].session
    round_values = np.zeros(chunks(job) * job.k, ">i4")  # the call round's entries on the first rung's block
    call_round = {r: SimpleNamespace(phase=Phase(session, 0, 0, round_values)) for r in others}
    assert run_phase(model, job, call_round, others) == {}  # counted, waiting for rank 1's
    again = run_phase(model, job, joins, [1])
    assert again == {1: sums[1]}
    joins[1].take(again[1])
    assert joins[1].session == session


def agreed(joins: dict[int, Join]) -> Callable[[], bool]:
    """Whether every rank of ``joins`` has taken its session, asked when called."""
    return lambda: all(j.session is not None for j in joins.values())


def lossy_join(sim: SimNet, workers: dict[int, Worker], joins: dict[int, Join], ranks: list[int],
               until: Callable[[], bool]) -> None:
    """Run ``ranks``' joins over ``sim`` (its losses, duplicates and reordering) until ``until()``, as the
    client does: each rank starts its next phase once its last one's sum came back."""
    while not until():
        for rank in ranks:
            w, join = workers[rank], joins[rank]
            if w.error is not None:
                raise w.error
            if w.red is not None and not w.red.done:
                continue
            if w.red is not None:
                join.take(w.out.astype(">i4").tobytes())
                w.red = None
            if join.session is None:
                phase = join.phase
                flat = phase.values.astype(np.int32)
                w.out = np.empty_like(flat)
                sim.launch(w, Reduction(replace(w.job.params(w.rank), generation=phase.generation), w.window,
                                        Int32Payloads(flat, w.out, w.job.k), n_chunks=flat.size // w.job.k,
                                        first_id=0, copies=copies_of(phase, w.job.slots, w.job.k), now=sim.now,
                                        progress_timeout=60.0, first_slot=phase.slot))
        sim.run(until=sim.now + 0.05)


@pytest.mark.parametrize("earlier_runs", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_a_restart_whose_ranks_start_apart_joins_through_loss_duplication_and_reordering(job, earlier_runs, seed):
    """Earlier runs joined one after another and stopped (the second climbed and closed); the new run's
    rank 0 starts alone and runs until the switch has counted a part of its (a phase that waits for its
    peers), and only then do the others start: every datagram may be lost, doubled or overtaken, both
    ways. Every rank must agree on one session, no earlier run's."""
    model = model_with(job)
    bad = Impairment(loss=0.2, dup=0.1, latency=0.001, jitter=0.004)
    sim = SimNet(model, up=bad, down=bad, seed=seed)
    workers = {rank: sim.add_worker(job, rank) for rank in range(job.n)}
    earlier = set()
    for _ in range(earlier_runs):
        joins = start(job)
        lossy_join(sim, workers, joins, list(range(job.n)), agreed(joins))
        earlier |= {j.session for j in joins.values()}
    assert len(earlier) == earlier_runs

    def counted() -> int:
        return model.counters()["jobs"][job.job_id]["contributions"]

    joins, before = start(job), counted()
    lossy_join(sim, workers, joins, [0], lambda: counted() > before)
    lossy_join(sim, workers, joins, list(range(job.n)), agreed(joins))
    sessions = {j.session for j in joins.values()}
    assert len(sessions) == 1 and not sessions & earlier


@pytest.mark.parametrize("seed", range(2))
def test_the_ranks_of_a_tree_wider_than_a_chunk_join_through_loss_on_every_hop(seed):
    """32 ranks under 4 leaves at K = 16: each phase is 4 chunks, a slot each of a rung's block, summed up
    the tree and down again, every hop losing, doubling and reordering. An earlier run joined and stopped,
    and the new run's first leaf starts alone; every rank agrees on one session, not the earlier run's."""
    switches: dict = {}
    t = tree(switches, leaves=4, per_leaf=8, k=16, slots=8)
    bad = Impairment(loss=0.05, dup=0.02, latency=0.001, jitter=0.002)
    sim = SimNet(None, up=bad, down=bad, seed=seed, switches=switches)
    workers = dict(enumerate(sim.add_tree_workers(t)))

    def begin() -> dict[int, Join]:
        return {r: Join(t.spine_entry.generation, r, len(workers), 16, 8) for r in workers}

    earlier = begin()
    lossy_join(sim, workers, earlier, list(workers), agreed(earlier))
    assert len({j.session for j in earlier.values()}) == 1
    spine = switches[t.spine]

    def counted() -> int:
        return spine.counters()["jobs"][t.spine_entry.job_id]["contributions"]

    joins, before = begin(), counted()
    lossy_join(sim, workers, joins, list(range(8)), lambda: counted() > before or agreed(joins)())
    lossy_join(sim, workers, joins, list(workers), agreed(joins))
    sessions = {j.session for j in joins.values()}
    assert len(sessions) == 1 and sessions != {earlier[0].session}
    assert joins[0].phase.values.size == 4 * 16
