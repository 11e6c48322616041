"""A switchagg call's outcome as a ``torch.futures.Future``: what DDP's hooks and torch's Work expect.

The client completes a ``concurrent.futures.Future`` on its own thread; torch wants its own Future,
which for a CUDA tensor also records an event on a stream so that the consumer's stream waits for
the result and not for the whole device. The conversion lives here once, for the comm hook and for
the process group's Work objects.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


def torch_future(done: Future, device: torch.device, value: Callable[[Any], Any] = lambda r: r,
                 ) -> torch.futures.Future:
    """A torch Future that completes with ``value(result)`` of ``done``, or with its error.

    ``value`` runs on the thread that completes ``done`` (it may copy a result into place);
    an error it raises becomes the Future's error too.
    """
    cuda = device.type == "cuda"
    future: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else None)
    side = torch.cuda.Stream(device) if cuda else None

    def finish(call: Future) -> None:
        try:
            result = value(call.result())
        except BaseException as exc:  # noqa: BLE001 - the Future's owner raises it
            future.set_exception(exc)
            return
        if side is None:
            future.set_result(result)
            return
        with torch.cuda.stream(side):  # the Future records its CUDA event on this stream
            side.wait_stream(torch.cuda.default_stream(device))
            future.set_result(result)

    done.add_done_callback(finish)
    return future


def failed_future(error: BaseException, device: torch.device) -> torch.futures.Future:
    """A torch Future that holds ``error`` already (a call refused before it was queued)."""
    future: torch.futures.Future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
    future.set_exception(error)
    return future


class FutureWork(torch.distributed.Work):
    """torch's Work over a Future, whose ``wait()`` raises the Future's error.

    torch's ``_create_work_from_future`` makes a Work whose ``wait()`` waits for the Future and
    returns True whatever it holds, so a call that failed (a stall, a closed client, a fallback's
    refusal) would pass for a finished one and leave the tensor as it was. torch calls ``wait`` and
    ``get_future`` of a Python Work by name (its ``PyWork``), as ``test_c10d_pypg.py`` shows.
    """

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - the call's own timers bound it
        self._future.wait()  # raises the call's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future
