"""The embedded switch's control port, its server side: one JSON request per line over TCP, one JSON reply.

Requests (``op``): ``status``; ``reset`` with ``job``; ``slots`` with ``job`` and
``slots``; ``add_job`` with ``config`` (TOML text); ``remove_job`` with ``job``.
A reply is an object; a failed request gets ``{"error": "..."}``. Bind it to
loopback: it is not authenticated. The client side is :mod:`switchagg.switch.control_client`.
"""

from __future__ import annotations

import json
import socketserver
import threading
import tomllib
from typing import Any, Protocol

from ..config import JobConfig
from ..errors import SwitchAggError
from ..jobs import JobEntry


class ServedSwitch(Protocol):
    """What the control port asks of the switch it serves (:class:`~switchagg.switch.server.SoftSwitch`)."""

    address: tuple[str, int]
    backend: str

    def add_job(self, config: JobConfig) -> int: ...
    def remove_job(self, job_id: int) -> None: ...
    def reset_job(self, job_id: int) -> int: ...
    def jobs(self) -> dict[int, JobEntry]: ...
    def counters(self) -> dict[str, object]: ...
    def slot_state(self, job_id: int, slots: list[int]) -> dict[int, list[dict[str, int | None]]]: ...


class ControlServer:
    """Serves control requests for one switch on a background thread."""

    def __init__(self, address: tuple[str, int], switch: ServedSwitch) -> None:
        handler = type("Handler", (_Handler,), {"switch": switch})
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(address, handler)
        self._server.daemon_threads = True
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever, name="switchagg-control",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Handler(socketserver.StreamRequestHandler):
    switch: ServedSwitch

    def handle(self) -> None:
        for line in self.rfile:
            try:
                reply = _dispatch(self.switch, json.loads(line))
            except (SwitchAggError, KeyError, ValueError, TypeError) as exc:
                reply = {"error": str(exc) or type(exc).__name__}
            self.wfile.write(json.dumps(reply).encode() + b"\n")


def _dispatch(switch: ServedSwitch, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op == "status":
        jobs = {str(j): {"generation": e.generation, "slot_base": e.slot_base, "slot_count": e.slot_count,
                         "values_per_packet": e.values_per_packet, "workers": [list(w) for w in e.workers]}
                for j, e in switch.jobs().items()}
        return {"address": list(switch.address), "backend": switch.backend, "jobs": jobs,
                "counters": _str_keys(switch.counters())}
    if op == "reset":
        return {"generation": switch.reset_job(int(req["job"]))}
    if op == "slots":
        states = switch.slot_state(int(req["job"]), [int(s) for s in req["slots"]])
        return {"slots": {str(s): v for s, v in states.items()}}
    if op == "add_job":
        return {"generation": switch.add_job(JobConfig.from_dict(tomllib.loads(req["config"])))}
    if op == "remove_job":
        switch.remove_job(int(req["job"]))
        return {}
    raise ValueError(f"unknown control op {op!r}")


def _str_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj
