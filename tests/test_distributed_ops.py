"""Calls through the backend end as gloo's do: a failed call raises from ``wait()``."""

from __future__ import annotations

from tests import ops_worker, test_distributed

switch = test_distributed.switch  # the embedded switch, and the variables that point the ranks at it


def test_a_call_that_fails_raises_from_wait(switch):
    """torch's ``_create_work_from_future`` makes a Work whose wait() returns True even when the call
    failed; the backend's Work raises the call's error, as gloo's and NCCL's do."""
    _, env = switch
    for got in test_distributed.spawn(ops_worker.closed_client, env, "switchagg"):
        assert set(got) == {"sync", "async"}
        for how, outcome in got.items():
            assert isinstance(outcome, str) and "closed" in outcome, (how, outcome)
