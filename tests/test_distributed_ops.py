"""Every ReduceOp on every dtype through the backend gives what gloo gives, and integer AVG what NCCL gives.

Each case runs once on a gloo group and once on a switchagg group, the same inputs on the same
ranks (``tests/ops_worker.py``). Where gloo returns a tensor, switchagg returns the same one (the
float types that go through the switch within the codec's bound, everything else bit for bit); where
gloo raises, switchagg raises the same error, except integer AVG, which gloo refuses ("result type
Float can't be cast") and NCCL does as the exact, wrapping sum followed by C's division, truncating
toward zero: switchagg does that, through the switch for int32 and the fallback for the others.
"""

from __future__ import annotations

import pytest
import torch

from tests import ops_worker, test_distributed

switch = test_distributed.switch  # the embedded switch, and the variables that point the ranks at it

# complex64 too: torch hands a complex SUM or AVG to the backend as float32 pairs (view_as_real)
THROUGH_SWITCH = {(op, dtype) for op in ("SUM", "AVG")
                  for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.complex64)}
NCCL_AVG = {torch.uint8, torch.int8, torch.int32, torch.int64}  # integer types that NCCL averages (and gloo sums)


def wrapped_sum(dtype: torch.dtype, world: int) -> torch.Tensor:
    """The ranks' sum as ``dtype`` holds it: modulo 2**bits, as NCCL's and gloo's sums are."""
    return sum(ops_worker.values(r, dtype).to(torch.int64) for r in range(world)).to(dtype)


def _tensor(outcome: tuple) -> tuple:
    """A worker's (outcome, bytes sent), its (dtype, list) made a tensor again."""
    result, sent = outcome
    return (result if isinstance(result, str) else torch.tensor(result[1], dtype=result[0])), sent


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_on_every_dtype_matches_gloo_and_integer_avg_matches_nccl(switch, world):
    _, env = switch
    gloo = test_distributed.spawn(ops_worker.all_reduce_ops, env, "gloo", world=world)
    ours = test_distributed.spawn(ops_worker.all_reduce_ops, env, "switchagg", world=world)
    checked = 0
    for op in ops_worker.OPS:
        for dtype in ops_worker.DTYPES:
            for rank in range(world):
                (want, _), (got, sent) = (_tensor(gloo[rank][op, str(dtype)]), _tensor(ours[rank][op, str(dtype)]))
                case = f"{op} {dtype} rank {rank} of {world}"
                if (op, dtype) in THROUGH_SWITCH:
                    assert sent > ops_worker.N * dtype.itemsize, f"{case}: the switch summed it"
                else:
                    assert sent == 0, f"{case}: the fallback did it"
                if op == "AVG" and dtype in NCCL_AVG:
                    assert isinstance(want, str) and "can't be cast" in want, f"{case}: gloo still refuses it"
                    total = wrapped_sum(dtype, world)
                    want = torch.div(total, world, rounding_mode="trunc")  # NCCL's ncclDevSumPostDiv
                    if dtype.is_signed:
                        floor = torch.div(total, world, rounding_mode="floor")
                        assert not torch.equal(want, floor), "the inputs tell truncation from flooring"
                if isinstance(want, str):
                    assert got == want, case
                elif (op, dtype) in THROUGH_SWITCH and dtype != torch.int32:
                    # The codec's bound, and the rounding of gloo's partial sums to the dtype (the
                    # switch rounds its exact sum once): for inputs below 1000 in magnitude.
                    eps = torch.finfo(dtype).eps
                    bound = world * 1000 * (2.0 ** -20 + (world - 1) * eps)
                    torch.testing.assert_close(got, want, rtol=eps, atol=bound, msg=case)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=case)
                checked += 1
    assert checked == len(ops_worker.OPS) * len(ops_worker.DTYPES) * world


def test_a_call_that_fails_raises_from_wait(switch):
    """torch's ``_create_work_from_future`` makes a Work whose wait() returns True even when the call
    failed; the backend's Work raises the call's error, as gloo's and NCCL's do."""
    _, env = switch
    for got in test_distributed.spawn(ops_worker.closed_client, env, "switchagg"):
        assert set(got) == {"sync", "async", "int AVG"}
        for how, outcome in got.items():
            assert isinstance(outcome, str) and "closed" in outcome, (how, outcome)


def test_monitored_barrier_is_the_group_s_own_not_torch_s(switch):
    """``dist.monitored_barrier`` refuses any backend not named gloo (torch's check, before any call);
    the group's own ``monitored_barrier``, its gloo backend's, names the rank that did not arrive,
    and passes when all do (the README's advice)."""
    _, env = switch
    first, last = test_distributed.spawn(ops_worker.monitored_barrier, env, "switchagg")
    for got in (first, last):
        assert got["torch's"] == "ValueError: monitored_barrier is only implemented for GLOO backend."
        assert got["all"] is None, got["all"]
    assert "Ranks 1 failed to pass monitoredBarrier" in first["missing"], first["missing"]


def _close(got: torch.Tensor, want: torch.Tensor, world: int, case: str) -> None:
    """Within the codec's bound and gloo's rounding of its partial sums (inputs below 1000 in magnitude);
    exact for the integer types."""
    if not want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=case)
        return
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=eps, atol=world * 1000 * (2.0 ** -20 + (world - 1) * eps), msg=case)


def test_reduce_scatter_all_gather_and_coalesced_calls_go_through_the_switch_and_match_gloo(switch):
    """What torch's suite sends nowhere near the switch on CPU (its tests of these are NCCL's):
    reduce_scatter_tensor SUM and AVG of each type the switch sums (and of int64, through the
    fallback; integer AVG as NCCL's), all_gather_into_tensor of any type
    (``SWITCHAGG_ALL_GATHER=switch``), and coalesced all-reduces, each one call through the switch."""
    _, env = switch
    world = 3
    gloo = test_distributed.spawn(ops_worker.switch_calls, env, "gloo", world=world)
    ours = test_distributed.spawn(ops_worker.switch_calls, {**env, "SWITCHAGG_ALL_GATHER": "switch"}, "switchagg",
                                  world=world)
    assert len(gloo[0]) == 5 * 2 + 5 + 2 * 2 * 2
    for rank in range(world):
        for case, (want, _) in gloo[rank].items():
            got, sent = ours[rank][case]
            if case.startswith("reduce_scatter_tensor AVG torch.int"):  # gloo refuses it; NCCL's: its sum, divided
                assert isinstance(want, str) and "can't be cast" in want, (case, want)
                ((dtype, total),), _ = gloo[rank][case.replace("AVG", "SUM")]
                want = [(dtype, torch.div(torch.tensor(total, dtype=dtype), world, rounding_mode="trunc").tolist())]
            assert not isinstance(want, str), (case, want)
            assert not isinstance(got, str), (case, got)
            if case.startswith("reduce_scatter_tensor") and case.endswith("torch.int64"):
                assert sent == 0, f"{case}: through the fallback"
            else:
                assert sent > 0, f"{case}: through the switch"
            for (dtype, w), (got_dtype, g) in zip(want, got, strict=True):
                assert got_dtype == dtype, case
                _close(torch.tensor(g, dtype=dtype), torch.tensor(w, dtype=dtype), world, f"{case} rank {rank}")
