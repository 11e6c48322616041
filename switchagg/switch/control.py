"""The embedded switch's control port, its server side: one JSON request per line over TCP, one JSON reply.

Requests (``op``): reads need nothing more, ``status`` (with the counters summed over the switch's
cores, and what each core's shard served), and ``slots`` with ``job`` and ``slots`` (the job's own
slot numbers: the one table every shard serves); changes need the job's key, ``add_job`` with ``config`` (TOML text: the
key is the one it carries), ``reset`` and ``remove_job`` with ``job`` and ``key`` (the installed job's).
A reply is an object; a request that cannot be served, for whatever reason, gets ``{"error": "..."}``
saying why, and the connection stays open for the next one.

It listens on loopback unless its owner opts in to another address (``public=True``): the key
is the job's 32-bit admission key, which keeps a mistaken or casual request from resetting a
running job, not a determined attacker who can reach the port. The client side is
:mod:`switchagg.switch.control_client`.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
import socketserver
import threading
import tomllib
from typing import Any, Protocol

from ..config import JobConfig
from ..errors import ConfigError, SwitchAggError
from ..jobs import JobEntry

MAX_REQUEST = 1 << 20  # bytes in one request line: a job's TOML is a few KB


class ServedSwitch(Protocol):
    """What the control port asks of the switch it serves (:class:`~switchagg.switch.server.SoftSwitch`)."""

    address: tuple[str, int]
    backend: str
    cores: int
    num_slots: int

    def add_job(self, config: JobConfig) -> int: ...
    def remove_job(self, job_id: int) -> None: ...
    def reset_job(self, job_id: int) -> int: ...
    def jobs(self) -> dict[int, JobEntry]: ...
    def counters(self) -> dict[str, object]: ...
    def shard_stats(self) -> list[dict[str, int]]: ...
    def slot_state(self, job_id: int, slots: list[int]) -> dict[int, list[dict[str, int | None]]]: ...


def check_control_address(address: tuple[str, int], public: bool) -> None:
    """Refuse a control address other than loopback unless ``public``: the port changes jobs, so
    listening beyond this machine must be asked for, not fallen into."""
    host = address[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name: what it resolves to
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            raise ConfigError(f"control address {host!r}: not an IPv4 address, nor a name this machine "
                              "resolves; write e.g. 127.0.0.1:16712") from None
    if not ip.is_loopback and not public:
        raise ConfigError(
            f"the control port would listen on {host}:{address[1]}, which is not loopback: whoever reaches it "
            "reads every job's counters and, knowing a job's key, resets or removes it. Use 127.0.0.1, or "
            "opt in with `switchagg switch --control-any-address` (SoftSwitch(..., control_public=True))")


class _Server(socketserver.ThreadingTCPServer):
    """The control port's server: reuses the address of a switch that just stopped (a restart must not
    wait out TIME_WAIT), set on this subclass, not on the standard library's class for the whole process."""

    allow_reuse_address = True
    daemon_threads = True


class ControlServer:
    """Serves control requests for one switch on a background thread (loopback only unless ``public``)."""

    def __init__(self, address: tuple[str, int], switch: ServedSwitch, *, public: bool = False) -> None:
        check_control_address(address, public)
        handler = type("Handler", (_Handler,), {"switch": switch})
        try:
            self._server = _Server(address, handler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for control requests on TCP {address[0]}:{address[1]}: "
                                     f"{exc.strerror or exc}; is another switch using that port?") from None
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
        while line := self.rfile.readline(MAX_REQUEST + 1):
            if len(line) > MAX_REQUEST:  # the rest of the line cannot be told from the next request
                self._reply({"error": f"a request is one JSON object on one line of at most {MAX_REQUEST} bytes"})
                return
            self._reply(serve(self.switch, line))

    def _reply(self, reply: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(reply).encode() + b"\n")


def serve(switch: ServedSwitch, line: bytes) -> dict[str, Any]:
    """The reply to one request line: what the op returns, or ``{"error": ...}`` saying what was wrong
    with the request. A bad request must not cost its sender the connection without a word."""
    try:
        req = json.loads(line.decode())
    except ValueError as exc:  # not UTF-8, not JSON
        return {"error": f"a request is one JSON object per line: {exc}"}
    if not isinstance(req, dict):
        return {"error": f"a request is a JSON object with an 'op', not {type(req).__name__}"}
    try:
        return _dispatch(switch, req)
    # What a request can make the switch's own checks raise (a job that is not installed, a config it
    # refuses); a request's own fields are checked before they reach it.
    except (SwitchAggError, ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        return {"error": str(exc) or type(exc).__name__}


def _dispatch(switch: ServedSwitch, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op == "status":
        jobs = {str(j): {"generation": e.generation, "slot_base": e.slot_base, "slot_count": e.slot_count,
                         "values_per_packet": e.values_per_packet, "workers": [list(w) for w in e.workers]}
                for j, e in switch.jobs().items()}
        return {"address": list(switch.address), "backend": switch.backend, "cores": switch.cores,
                "num_slots": switch.num_slots, "jobs": jobs,
                "counters": _str_keys(switch.counters()), "shards": switch.shard_stats()}
    if op == "slots":
        entry = _installed(switch, req)
        slots = req.get("slots")
        if not isinstance(slots, list) or not all(_is_int(s) for s in slots):
            raise ConfigError("'slots' must be a list of slot numbers")
        outside = [s for s in slots if not 0 <= s < entry.slot_count]
        if outside:
            raise ConfigError(f"slots {outside} are outside job {entry.job_id}'s slots 0..{entry.slot_count - 1}")
        states = switch.slot_state(entry.job_id, slots)
        return {"slots": {str(s): v for s, v in states.items()}}
    if op == "add_job":
        text = req.get("config")
        if not isinstance(text, str):
            raise ConfigError("add_job needs 'config': the job's TOML text")
        try:
            config = JobConfig.from_dict(tomllib.loads(text))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"'config' is not valid TOML: {exc}") from None
        if "key" in req and req["key"] != config.key:
            raise ConfigError("'key' differs from the key in 'config': send the job's own key, or none")
        return {"generation": switch.add_job(config)}
    if op == "reset":
        entry = _authorized(switch, req)
        return {"generation": switch.reset_job(entry.job_id)}
    if op == "remove_job":
        entry = _authorized(switch, req)
        switch.remove_job(entry.job_id)
        return {}
    raise ConfigError(f"unknown control op {op!r}: use status, slots, add_job, reset or remove_job")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _installed(switch: ServedSwitch, req: dict[str, Any]) -> JobEntry:
    """The installed job that the request's ``job`` names."""
    job_id = req.get("job")
    if not _is_int(job_id):
        raise ConfigError(f"{req.get('op')} needs 'job': the job id, an integer")
    entry = switch.jobs().get(job_id)
    if entry is None:
        raise ConfigError(f"job {job_id} is not installed on this switch: deploy it first")
    return entry


def _authorized(switch: ServedSwitch, req: dict[str, Any]) -> JobEntry:
    """The installed job that the request's ``job`` names, if its ``key`` is that job's: a change needs it."""
    entry = _installed(switch, req)
    key = req.get("key")
    if not _is_int(key):
        raise ConfigError(f"{req['op']} of job {entry.job_id} needs 'key': the job's key from its config")
    if not 0 <= key <= 0xFFFFFFFF or not secrets.compare_digest(key.to_bytes(4, "big"),
                                                                 entry.key.to_bytes(4, "big")):
        raise ConfigError(f"'key' is not job {entry.job_id}'s key: send the key of the job's config")
    return entry


def _str_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj
