"""The loss bench's random sequence and its figures (the bench itself needs root and nftables)."""

from __future__ import annotations

import numpy as np

from switchagg.benchmarks.loss import RANDOM_MAX, call_slowdowns, call_times, random_calls


def test_the_loss_bench_random_sequence_is_seeded_and_its_slowdowns_are_per_call():
    calls = random_calls()
    assert calls == random_calls() and len({f for _, f in calls}) == 2
    assert all(1 <= n <= RANDOM_MAX for n, _ in calls)
    marks = [{"marks": np.array([0.0, 1.0, 3.0])}, {"marks": np.array([0.5, 1.5, 2.0])}]
    assert list(call_times(marks)) == [1.0, 1.5]  # from the last rank's end of one call to its end of the next
    median, p99, worst, total = call_slowdowns(np.array([1.0, 2.0, 9.0]), np.array([1.0, 1.0, 1.0]))
    assert (median, worst, total) == (2.0, 9.0, 4.0) and 2.0 < p99 < 9.0
