"""P4Testgen's tests of p4/tna, both chips, against SwitchModel (tests/p4testgen_ptf.py says how).

Needs p4testgen built with its Tofino target (README, "Tofino"); skips with the reason elsewhere, and
scripts/test requires it (SWITCHAGG_REQUIRE_P4TESTGEN=1) where it finds it. Every path P4Testgen finds
(a fixed seed, all of them: about 45 s a chip here), first pass and second, is compared or classified
out with its reason.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from switchagg.jobs import GlobalDrop, JobCounter
from switchagg.targets.tofino_build import Chip

from . import p4testgen_ptf as tg
from .conftest import need

# What a run must compare at the least (seed 1 gives 165 first passes on Tofino, 240 on Tofino 2 with trees, all
# compared, about 40 of them with their packet out byte for byte; and 169 second passes on Tofino, 115 on Tofino 2,
# all compared, 32 with their packet out): floors well under that, so that the test cannot pass by comparing
# nothing, on either pass.
MIN_COMPARED = 120  # first passes
MIN_OUTPUTS = 25
MIN_SECOND = 80
MIN_SECOND_OUTPUTS = 20
MIN_COVERAGE = 0.95  # statement coverage: 667/696 (95.8%) on Tofino, 724/756 (95.8%) on Tofino 2 (docs/tofino.md)
WRITE, ADD, READ = 1, 2, 3  # the decision's ops (p4/tna/aggregation.p4: SA_OP_*), as the trace computes md.second_op


@pytest.fixture(scope="session", params=[Chip.TOFINO, Chip.TOFINO2], ids=lambda c: c.value[0])
def report(request, tmp_path_factory) -> tg.Report:
    """One chip's P4Testgen run, translated and compared (generated tests are build output, in a tmp dir)."""
    if tg.find_p4testgen() is None:
        need("p4testgen", "p4testgen (P4Testgen with its Tofino target) was not found on PATH or in /opt/tofino/bin: "
                          "build it as the README's Tofino section says")
    chip = request.param
    generated = tg.generate(chip, tmp_path_factory.mktemp(f"p4testgen-{chip.value[0]}"))
    result = tg.run(chip, generated)
    print(result.summary())
    return result


def test_p4testgen_and_the_model_agree_on_every_path(report):
    assert report.disagreements == {}, "\n".join(f"{t}: {p}" for t, p in report.disagreements.items())
    assert report.unmappable == {}, report.unmappable  # the assumptions keep every entry and state legal
    first = len(report.compared) - len(report.second_pass)
    assert first >= MIN_COMPARED and report.outputs - report.second_outputs >= MIN_OUTPUTS, report.summary()
    assert len(report.second_pass) >= MIN_SECOND and report.second_outputs >= MIN_SECOND_OUTPUTS, report.summary()


def test_the_paths_cover_the_first_pass(report):
    """Which outcomes were reached: every kind the first pass has but the forwarding path (docs/tofino.md)."""
    seen = set()
    for test in tg.parse_ptf(report.generated.ptf):
        if test.port == report.chip.recirculation_port:
            continue
        counters = tg.counted(test.trace) or []
        seen |= {(kind, event) for kind, _, event in counters}
    assert {("global", d) for d in (0, 1, 2)} <= seen  # malformed, bad_version, not_admitted
    assert {("job", e) for e in (0, 3, 4, 5, 6, 7, 9)} <= seen  # contributions, probes, wrong generation, slot,
    # bad count, stale, queries


def test_the_paths_cover_the_second_pass(report):
    """Which second passes were compared: every op its decision takes (none, write, add, read) and every outcome
    (the sum multicast, a stored sum to the sender, duplicate_pending, stale, and a contribution counted
    into an unfinished sum, which the second pass drops uncounted)."""
    tests = {t.name: t for t in tg.parse_ptf(report.generated.ptf)}
    ops, outcomes = set(), set()
    for name in report.second_pass:
        trace = tests[name].trace
        ops.add(decision(trace))
        outcomes.add(tuple(event for _, _, event in tg.counted(trace)))
    assert ops == {0, 1, 2, 3}, ops  # SA_OP_NONE (stale), SA_OP_WRITE, SA_OP_ADD, SA_OP_READ
    events = (JobCounter.RESULTS_MULTICAST, JobCounter.RESULTS_UNICAST, JobCounter.DUPLICATE_PENDING, JobCounter.STALE)
    if report.chip.trees:  # a level's partial up, its resend, its parent's result down, and one no copy awaited
        events += (JobCounter.PARTIALS_UP, JobCounter.PARTIALS_RESENT, JobCounter.RESULTS_FROM_PARENT,
                   JobCounter.UNEXPECTED_RESULT)
    assert {(e,) for e in events} | {()} == outcomes, outcomes


def test_the_paths_cover_a_tree_s_first_pass(report):
    """Where the program serves trees, the first pass's tree paths were compared: a parent's RESULT that a copy
    took (sent round uncounted), one it did not await (unexpected_result), one from no parent (malformed).
    Where it serves none (Tofino 1), every RESULT it sent was malformed (its paths need not single one out: there
    a RESULT is one of validation's malformed types)."""
    tests = {t.name: t for t in tg.parse_ptf(report.generated.ptf)}
    results = [tests[n] for n in report.compared if n not in report.second_pass and result_of(tests[n])]
    outcomes = {(tuple((kind, event) for kind, _, event in tg.counted(t.trace)), tg.ingress_outcome(t.trace).port)
                for t in results}
    malformed = ((("global", GlobalDrop.MALFORMED),), None)
    if not report.chip.trees:
        assert outcomes <= {malformed}, outcomes
        return
    taken, unexpected = ((), report.chip.recirculation_port), ((("job", JobCounter.UNEXPECTED_RESULT),), None)
    assert {taken, unexpected, malformed} <= outcomes, outcomes


def result_of(test: tg.PtfTest) -> bool:
    """A test that sends a RESULT (version 1, type 2) to the switchagg port."""
    h = test.packet[tg.ETH_IP_UDP_SIZE:tg.ETH_IP_UDP_SIZE + 2]
    return tg._datagram(test.packet) is not None and h == bytes([1, 2])


def decision(trace: str, second: bool = True) -> int:
    """The op the pass's decision took for its half of the values: the second pass's, the last md.second_op
    computed (ExponentStage's); the first pass's, the last md.op (decide_00's). The parser's first is NONE, 0."""
    return int(re.findall(rf"Computed: md\.{'second_op' if second else 'op'} = (\d+);", trace)[-1])


def test_statement_coverage_is_held(report):
    covered = re.match(r"(\d+)/(\d+) ", report.generated.coverage)
    assert covered, f"P4Testgen reported no statement coverage: {report.generated.coverage}"
    assert int(covered[1]) >= MIN_COVERAGE * int(covered[2]), report.summary()


def test_a_wrong_expectation_is_caught(report):
    """The comparison is not vacuous: a model that got one header field, a value of a sum, a multicast group,
    a counter or a byte of the packet out wrong disagrees with P4Testgen. The value broken is one the pass
    computed (the first pass's half of the values, or the second's), written, summed or read, on both passes."""
    tests = {t.name: t for t in tg.parse_ptf(report.generated.ptf)}
    caught = {"field": 0, "value": 0, "group": 0, "counter": 0, "payload": 0}
    values_caught = set()  # (second pass?, the op that computed the value broken)
    for name in report.compared:
        test = tests[name]
        setup = tg.translate(test, report.chip)
        expect = tg.tofino_expectation(setup, test.packet, test.port)
        if expect.emits:
            emits = [dict(h) for h in expect.emits]
            emits[-1 if "v31" not in emits[-1] else -3]["version"] ^= 0x80  # the switchagg header's version
            problems, _ = tg.compare(test, dataclasses.replace(expect, emits=emits))
            caught["field"] += bool(problems)
        if expect.emits and "v31" in expect.emits[-1]:
            second = name in report.second_pass
            emits = [dict(h) for h in expect.emits]
            emits[-1 if second else -2]["v31"] ^= 1 << 31  # this pass's half (the other's it carries unchanged)
            problems, _ = tg.compare(test, dataclasses.replace(expect, emits=emits))
            caught["value"] += bool(problems)
            if problems:
                values_caught.add((second, decision(test.trace, second)))
        if expect.group is not None:
            problems, _ = tg.compare(test, dataclasses.replace(expect, group=expect.group + 1))
            caught["group"] += bool(problems)
        if expect.out:
            port, data = expect.out[0]
            broken = [(port, data[:-1] + bytes([data[-1] ^ 1]))]
            problems, _ = tg.compare(test, dataclasses.replace(expect, out=broken))
            caught["payload"] += bool(problems)
        if expect.counters:
            problems, _ = tg.compare(test, dataclasses.replace(expect, counters=expect.counters[1:]))
            caught["counter"] += bool(problems)
    assert caught["field"] >= MIN_OUTPUTS + MIN_SECOND_OUTPUTS and caught["counter"] >= MIN_COMPARED // 2, caught
    assert caught["payload"] >= MIN_OUTPUTS + MIN_SECOND_OUTPUTS and caught["value"] >= MIN_SECOND_OUTPUTS, caught
    assert caught["group"] >= 2, caught  # the second pass's multicasts
    assert {(second, op) for second in (False, True) for op in (WRITE, ADD, READ)} <= values_caught, values_caught
