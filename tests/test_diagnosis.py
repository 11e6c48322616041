"""A stalled call's diagnosis (switchagg.diagnosis), sans-I/O: its QUERYs go through the switch model, its
answers come back as the model sends them, and the sentence names the workers a stuck chunk waits for."""

from __future__ import annotations

import json

import pytest

from switchagg.diagnosis import ASKED, Diagnosis
from switchagg.jobs import Uplink
from switchagg.switch.model import SwitchModel
from switchagg.wire import FLAG_COPY, HEADER_SIZE, Header, PacketType, make_header, unpack_header

from .simnet import Job

JOB = Job(n=3, slots=4, k=8)
ME = 0  # the stalled worker


def contribute(model: SwitchModel, rank: int, chunk: int, slot: int, copy: int = 0) -> None:
    """Rank ``rank``'s contribution of ``chunk`` (zeros) in ``copy`` of ``slot``, as its worker sends it."""
    head = make_header(PacketType.CONTRIB, job=JOB.job_id, worker=rank, slot=slot, copy=copy, chunk=chunk,
                       generation=JOB.generation, key=JOB.key, count=JOB.k).pack()
    model.process(head + bytes(4 * JOB.k), JOB.address(rank))


def ask(model: SwitchModel, diagnosis: Diagnosis, *, lose: int | None = None) -> list[Header]:
    """Send the diagnosis's QUERYs to the model (``lose``: the chunk whose QUERY is lost); the answers."""
    answers = []
    for query in diagnosis.queries():
        if unpack_header(query).chunk == lose:
            continue
        for emit in model.process(query, JOB.address(ME)):
            assert emit.dst == JOB.address(ME) and len(emit.payload()) == HEADER_SIZE
            answers.append(unpack_header(emit.payload()))
    return answers


@pytest.fixture
def model() -> SwitchModel:
    """Slot 0 holds chunk 10 with ranks 0 and 1 counted (2 missing); slot 1 chunk 11, every rank counted
    (its result lost on its way to this worker); slot 2 nothing of chunk 12; slot 3, copy 1, chunk 13 with
    rank 1 alone."""
    sw = SwitchModel(16)
    sw.add_job(JOB.entry())
    for rank in (0, 1):
        contribute(sw, rank, 10, 0)
    for rank in range(3):
        contribute(sw, rank, 11, 1)
    contribute(sw, 1, 13, 3, copy=1)
    return sw


STUCK = [(10, 0, 0), (11, 1, 0), (12, 2, 0), (13, 3, 1)]


def test_the_queries_ask_about_the_oldest_stuck_chunks_under_the_calls_ids():
    diagnosis = Diagnosis(JOB.params(ME), STUCK + [(14, 0, 1)])
    asked = [unpack_header(q) for q in diagnosis.queries()]
    assert len(asked) == ASKED == 4  # the oldest four; the fifth is not asked about
    for h, (chunk, slot, copy) in zip(asked, STUCK, strict=True):
        assert (h.type, h.job, h.worker, h.generation, h.key) == (PacketType.QUERY, JOB.job_id, ME, JOB.generation,
                                                                    JOB.key)
        assert (h.chunk, h.slot, h.copy, h.count) == (chunk, slot, copy, 0)


def test_the_switchs_answers_name_the_missing_workers_of_each_stuck_chunk(model):
    diagnosis = Diagnosis(JOB.params(ME), STUCK)
    assert all(diagnosis.receive(h) for h in ask(model, diagnosis))
    assert diagnosis.answered
    assert diagnosis.from_answers("10.0.0.1:9") == (
        " The switch answers: chunk 10 waits for workers [2]; chunk 11 is summed, but its result does not reach "
        "this worker; no worker's contribution of chunk 12 reached the switch; chunk 13 waits for workers [0, 2].")


def test_a_lost_answer_is_said_and_no_answer_at_all_says_the_switch_is_gone(model):
    diagnosis = Diagnosis(JOB.params(ME), STUCK)
    for h in ask(model, diagnosis, lose=11):
        diagnosis.receive(h)
    assert not diagnosis.answered  # the client asks again
    assert "chunk 11: no answer; " in diagnosis.from_answers("sw")
    silent = Diagnosis(JOB.params(ME), STUCK)
    assert silent.from_answers("10.0.0.1:9") == (
        " The switch at 10.0.0.1:9 answered none of 4 QUERYs either: it is down, this worker cannot reach it, "
        "or it no longer has this job (`switchagg status`).")


def test_only_answers_to_its_own_queries_count(model):
    diagnosis = Diagnosis(JOB.params(ME), STUCK[:1])
    (answer,) = ask(model, diagnosis)
    others = [answer._replace(type=PacketType.RESULT), answer._replace(job=JOB.job_id + 1),
              answer._replace(worker=1), answer._replace(generation=JOB.generation + 1),
              answer._replace(chunk=11), answer._replace(slot=1), answer._replace(flags=answer.flags ^ FLAG_COPY)]
    assert not any(diagnosis.receive(h) for h in others)
    assert not diagnosis.answered and "answered none" in diagnosis.from_answers("sw")
    assert diagnosis.receive(answer) and diagnosis.answered


def test_the_control_ports_slot_states_name_the_missing_workers_or_the_chunk_held_instead(model):
    diagnosis = Diagnosis(JOB.params(ME), STUCK)
    request = diagnosis.slots_request()
    assert request == {"op": "slots", "job": JOB.job_id, "slots": [0, 1, 2, 3]}
    # as switch.control serves it: each slot's copies, through JSON
    reply = json.loads(json.dumps({"slots": {str(s): model.slot_state(JOB.job_id, s) for s in request["slots"]}}))
    assert diagnosis.from_slots(reply["slots"]) == (
        " The switch says: chunk 10 still waits for workers [2]; chunk 11 is summed, but its result does not "
        "reach this worker; chunk 12 never reached the switch (slot 2 copy 0 holds chunk None); chunk 13 still "
        "waits for workers [0, 2].")


def test_nothing_stuck_asks_nothing():
    diagnosis = Diagnosis(JOB.params(ME), [])
    assert diagnosis.queries() == [] and diagnosis.answered
    assert diagnosis.from_answers("sw") == "" and diagnosis.from_slots({}) == ""
    assert diagnosis.slots_request()["slots"] == []


def test_a_leaf_of_a_tree_names_its_parent_for_what_it_sent_up_and_missing_workers_by_their_tree_ranks():
    """A leaf (ranks 4..6 of a tree) that sent chunks 11 and 12 up, every worker counted, waits for its parent:
    one note says so, naming the parent; chunk 10 lacks the worker of tree rank 6."""
    leaf = Job(n=3, slots=4, k=8, tree_size=9, rank_base=4, parent=Uplink(("10.9.0.1", 16711), 1, 1, 7))
    sw = SwitchModel(16)
    sw.add_job(leaf.entry())
    for rank, chunk, slot in [(0, 10, 0), (1, 10, 0), *((r, 11, 1) for r in range(3)), *((r, 12, 2) for r in range(3))]:
        head = make_header(PacketType.CONTRIB, job=leaf.job_id, worker=rank, slot=slot, chunk=chunk,
                           generation=leaf.generation, key=leaf.key, count=leaf.k).pack()
        sw.process(head + bytes(4 * leaf.k), leaf.address(rank))
    parent = "at 10.9.0.1:16711 (job 1)"
    diagnosis = Diagnosis(leaf.params(ME), STUCK[:3], parent)
    reply = {str(s): sw.slot_state(leaf.job_id, s) for s in diagnosis.slots_request()["slots"]}
    assert diagnosis.from_slots(reply) == (
        " The switch says: chunk 10 still waits for workers [6]; chunks 11, 12 hold every worker's contribution "
        "here and wait for the sums of the parent switch at 10.9.0.1:16711 (job 1) (`switchagg status` there).")
    for query in diagnosis.queries():
        for emit in sw.process(query, leaf.address(ME)):
            diagnosis.receive(unpack_header(emit.payload()))
    assert diagnosis.from_answers("sw") == (
        " The switch answers: chunk 10 waits for workers [6]; every worker's contribution of chunks 11, 12 reached "
        "the switch, whose sums go up to its parent switch at 10.9.0.1:16711 (job 1): the parent (or another "
        "switch under it) holds them up, or the results do not reach this worker.")
