"""The embedded switch's control port: one JSON request per line over TCP, one JSON reply.

Requests (``op``): ``status``; ``reset`` with ``job``; ``slots`` with ``job`` and
``slots``; ``add_job`` with ``config`` (TOML text); ``remove_job`` with ``job``.
A reply is an object; a failed request gets ``{"error": "..."}``. Bind it to
loopback: it is not authenticated.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import tomllib
from typing import TYPE_CHECKING, Any

from ..config import Endpoint, JobConfig
from ..errors import ConfigError, SwitchAggError

if TYPE_CHECKING:
    from .server import SoftSwitch


class ControlServer:
    """Serves control requests for one :class:`SoftSwitch` on a background thread."""

    def __init__(self, address: tuple[str, int], switch: SoftSwitch) -> None:
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
    switch: SoftSwitch

    def handle(self) -> None:
        for line in self.rfile:
            try:
                reply = _dispatch(self.switch, json.loads(line))
            except (SwitchAggError, KeyError, ValueError, TypeError) as exc:
                reply = {"error": str(exc) or type(exc).__name__}
            self.wfile.write(json.dumps(reply).encode() + b"\n")


def _dispatch(switch: SoftSwitch, req: dict[str, Any]) -> dict[str, Any]:
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


def request(endpoint: Endpoint, req: dict[str, Any], timeout: float = 3.0) -> dict[str, Any]:
    """Send one control request to an embedded switch and return its reply."""
    try:
        with socket.create_connection(endpoint.tuple, timeout=timeout) as conn:
            conn.sendall(json.dumps(req).encode() + b"\n")
            line = conn.makefile("rb").readline()
    except OSError as exc:
        raise SwitchAggError(
            f"cannot reach the embedded switch's control port at {endpoint} ({exc}): "
            "is `switchagg switch` running with this config?") from None
    if not line:
        raise SwitchAggError(f"the control port at {endpoint} closed the connection without replying")
    reply = json.loads(line)
    if "error" in reply:
        raise ConfigError(f"the switch at {endpoint} refused {req.get('op')!r}: {reply['error']}")
    return reply
