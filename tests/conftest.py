"""Shared fixtures: loopback job configs on free ports and a running embedded switch."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from switchagg import Client, JobConfig, SoftSwitch
from switchagg.loopback import free_ports, loopback_job


def loopback_config(n: int, *, switch_port: int, k: int = 1024, slot_count: int = 16, control: int | None = None,
                    **kw) -> JobConfig:
    """A loopback job for a switch already running on ``switch_port``: the tests' small defaults."""
    return loopback_job(n, values_per_packet=k, slot_count=slot_count, switch_port=switch_port, control_port=control,
                        **kw)


@pytest.fixture
def soft_switch() -> Iterator[SoftSwitch]:
    (control,) = free_ports(1, socket.SOCK_STREAM)
    sw = SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control)).start()
    yield sw
    sw.stop()
    assert sw.error is None


@pytest.fixture
def make_job(soft_switch: SoftSwitch) -> Callable[..., JobConfig]:
    def make(n: int, **kw) -> JobConfig:
        cfg = loopback_config(n, switch_port=soft_switch.address[1],
                              control=soft_switch.control_address[1], **kw)
        soft_switch.add_job(cfg)
        return cfg
    return make


def run_ranks(n: int, fn: Callable[[int], object], timeout: float = 60.0) -> list[object]:
    """Run fn(rank) on n threads; return each result or the exception it raised."""
    results: list[object] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    return results


def calls_on_ranks(cfg, per_rank, **client_kw):
    """Each rank runs its list of callables ``f(client)`` in order; returns each rank's outcomes
    (a value, or the exception the call raised)."""
    def body(rank):
        outcomes = []
        with Client(cfg, rank, start_timeout=10, stall_timeout=3, **client_kw) as c:
            for call in per_rank[rank]:
                try:
                    outcomes.append(call(c))
                except Exception as exc:  # noqa: BLE001 - the outcome under test
                    outcomes.append(exc)
        return outcomes
    return run_ranks(len(per_rank), body, timeout=60)


def need(kind: str, missing: str | None) -> None:
    """Skip a test whose prerequisite is ``missing`` -- or fail it where CI found the prerequisites."""
    if missing is None:
        return
    if os.environ.get(f"SWITCHAGG_REQUIRE_{kind.upper()}") == "1":
        pytest.fail(f"{kind} tests are required here but: {missing}")
    pytest.skip(missing)


def assert_segmented(backend: str) -> None:
    """A worker's sends went out segmented (GSO) through a namespace's veth, which cuts them into frames.

    Older kernels refuse GSO on a device without checksum offload, as the test beds' are (newer ones
    checksum the segments in software): then the refusal must say EIO, and the worker fell back to
    plain sendmmsg.
    """
    assert backend.startswith("sendmmsg+GSO"), backend
    assert "refused" not in backend or "EIO" in backend, backend


_RAN: dict[str, dict[str, int]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for kind in ("bmv2", "netns", "tofino"):
        if kind in report.keywords and (report.when == "call" or report.outcome != "passed"):
            counts = _RAN.setdefault(kind, {})
            counts[report.outcome] = counts.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter) -> None:
    for kind, counts in sorted(_RAN.items()):
        terminalreporter.write_line(
            f"{kind} tests: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
