"""The embedded switch's control port, its server side: one JSON request per line over TCP, one JSON reply.

Requests (``op``): reads need nothing more, ``status`` (with the counters summed over the switch's
cores, what each core's shard served, what its sockets dropped, and the control port's own
counters), and ``slots`` with ``job`` and ``slots`` (the job's own slot numbers: the one table every
shard serves); changes need a credential: ``add_job`` with ``config`` (TOML text) needs the
operator's control token where one is set (``token``), and may carry ``lease`` (seconds: the switch
removes the job once that long passes unrenewed) and ``owner`` (``{"host": ..., "pid": ...}``, the
deploying process, shown by status); ``reset``, ``renew`` (the job's lease, its whole length again)
and ``remove_job`` with ``job`` and ``key`` the installed job's key.
A reply is an object; a request that cannot be served, for whatever reason, gets ``{"error": "..."}``
saying why, and the connection stays open for the next one: no request ends the switch, nor the
connection without a word.

It listens on loopback unless its owner opts in to another address (``public=True``), and there
only with a token (:data:`TOKEN_ENV` or a token file): the job's 32-bit key keeps a mistaken or
casual request from resetting a running job, the token keeps whoever reaches the port from
installing jobs (taking every free slot). Wrong keys and tokens are counted, and an address that
sends :data:`AUTH_FAILURES` of them within :data:`AUTH_WINDOW` seconds has its changes refused
unchecked until the window passes them; a connection idle for ``idle_timeout`` seconds is closed.
The client side is :mod:`switchagg.switch.control_client`.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import os
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config import JobConfig
from ..errors import ConfigError, SwitchAggError
from ..jobs import JobEntry

MAX_REQUEST = 1 << 20  # bytes in one request line: a job's TOML is a few KB
TOKEN_ENV = "SWITCHAGG_CONTROL_TOKEN"  # the operator's control token, where no token file is given
IDLE_TIMEOUT = 60.0  # seconds a control connection may wait between requests before it is closed
AUTH_FAILURES = 5  # wrong keys or tokens one address may send within AUTH_WINDOW seconds ...
AUTH_WINDOW = 10.0  # ... before its changes are refused unchecked (so a key is not guessed at line rate)
# what the control port counts (status's "control"): requests served, error replies, wrong keys or tokens,
# changes refused unchecked for an address's wrong ones, connections closed for idling
GUARD_COUNTERS = ("requests", "errors", "auth_failures", "rate_limited", "idle_timeouts")


class ServedSwitch(Protocol):
    """What the control port asks of the switch it serves (:class:`~switchagg.switch.server.SoftSwitch`)."""

    address: tuple[str, int]
    backend: str
    cores: int
    num_slots: int

    def add_job(self, config: JobConfig, lease: float | None = None,
                owner: tuple[str, int] | None = None) -> int: ...
    def remove_job(self, job_id: int) -> None: ...
    def reset_job(self, job_id: int) -> int: ...
    def renew_job(self, job_id: int) -> float: ...
    def leases(self) -> dict[int, tuple[float, float]]: ...
    def owners(self) -> dict[int, tuple[str, int]]: ...
    def lease_counters(self) -> dict[str, int]: ...
    def jobs(self) -> dict[int, JobEntry]: ...
    def counters(self) -> dict[str, object]: ...
    def shard_stats(self) -> list[dict[str, int]]: ...
    def socket_counters(self) -> dict[str, int]: ...
    def slot_state(self, job_id: int, slots: list[int]) -> dict[int, list[dict[str, int | None]]]: ...


def control_token(token_file: str | Path | None = None) -> str | None:
    """The operator's control token: the token file's text (stripped) where one is given, else
    :data:`TOKEN_ENV`'s value; None when neither is set."""
    if token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"control token file {token_file}: cannot read it ({exc}); give a readable UTF-8 file "
                          "holding the token") from None
    if not token:
        raise ConfigError(f"control token file {token_file} is empty: write the token in it")
    return token


def check_control_address(address: tuple[str, int], public: bool, token: str | None = None) -> None:
    """Refuse a control address other than loopback unless ``public`` and with a ``token``: the port
    changes jobs, so listening beyond this machine must be asked for, not fallen into, and installing
    a job there needs a credential."""
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
    if not ip.is_loopback and token is None:
        raise ConfigError(
            f"the control port would listen on {host}:{address[1]}, which is not loopback, with no control token: "
            f"whoever reaches it could install jobs. Set {TOKEN_ENV} or give `switchagg switch "
            "--control-token-file FILE` (SoftSwitch(..., control_token=...)); clients send the same token")


class _Server(socketserver.ThreadingTCPServer):
    """The control port's server: reuses the address of a switch that just stopped (a restart must not
    wait out TIME_WAIT), set on this subclass, not on the standard library's class for the whole process."""

    allow_reuse_address = True
    daemon_threads = True


class Guard:
    """The control port's credentials and counters: the operator's token (None: ``add_job`` needs none),
    the wrong keys and tokens each address sent lately, and :data:`GUARD_COUNTERS`. ``clock`` is
    injectable so a test can move time on rather than wait."""

    def __init__(self, token: str | None = None, *, failures: int = AUTH_FAILURES, window: float = AUTH_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.token = token
        self._failures, self._window, self._clock = failures, window, clock
        self._lock = threading.Lock()  # one handler thread per connection
        self._failed: dict[str, collections.deque[float]] = {}  # address -> when its recent wrong ones came
        self._counts = dict.fromkeys(GUARD_COUNTERS, 0)

    def count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def admit(self, peer: str) -> None:
        """Refuse a change from ``peer`` unchecked while its wrong keys or tokens are over the limit."""
        with self._lock:
            recent = self._recent(peer)
            if len(recent) < self._failures:
                return
            self._counts["rate_limited"] += 1
            wait = recent[0] + self._window - self._clock()
        raise ConfigError(f"{self._failures} wrong keys or tokens from {peer} within {self._window:g} s: changes "
                          f"from it are refused unchecked for {wait:.1f} s more; send the right key or token then")

    def refuse(self, peer: str, message: str) -> ConfigError:
        """Count a wrong key or token from ``peer``; returns the error to raise."""
        with self._lock:
            self._recent(peer).append(self._clock())
            self._counts["auth_failures"] += 1
        return ConfigError(message)

    def check_token(self, peer: str, req: dict[str, Any]) -> None:
        """``add_job``'s credential: the request's ``token`` must be the operator's, where one is set."""
        if self.token is None:
            return
        token = req.get("token")
        if not isinstance(token, str):
            raise self.refuse(peer, f"add_job needs 'token': this switch's control token (clients send "
                                    f"{TOKEN_ENV}'s value)")
        if not secrets.compare_digest(token.encode(), self.token.encode()):
            raise self.refuse(peer, f"'token' is not this switch's control token: set {TOKEN_ENV} to the one "
                                    "the switch was started with")

    def _recent(self, peer: str) -> collections.deque[float]:
        """``peer``'s wrong ones within the window (the older forgotten, an address with none dropped)."""
        now = self._clock()
        for address in [a for a, times in self._failed.items() if times and times[-1] <= now - self._window]:
            del self._failed[address]
        recent = self._failed.setdefault(peer, collections.deque())
        while recent and recent[0] <= now - self._window:
            recent.popleft()
        return recent


class ControlServer:
    """Serves control requests for one switch on a background thread (loopback only unless ``public``, and
    there only with a ``token``); ``guard`` holds the token and the counters (a new one from ``token``)."""

    def __init__(self, address: tuple[str, int], switch: ServedSwitch, *, public: bool = False,
                 token: str | None = None, guard: Guard | None = None, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.guard = guard if guard is not None else Guard(token)
        check_control_address(address, public, self.guard.token)
        handler = type("Handler", (_Handler,), {"switch": switch, "guard": self.guard, "timeout": idle_timeout})
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
    """One connection: requests until the peer closes it, sends a line too long, or idles past ``timeout``
    (which StreamRequestHandler sets on the socket)."""

    switch: ServedSwitch
    guard: Guard

    def handle(self) -> None:
        try:
            while line := self.rfile.readline(MAX_REQUEST + 1):
                if len(line) > MAX_REQUEST:  # the rest of the line cannot be told from the next request
                    self.guard.count("errors")
                    self._reply({"error": f"a request is one JSON object on one line of at most {MAX_REQUEST} "
                                          "bytes"})
                    return
                self._reply(serve(self.switch, line, self.guard, self.client_address[0]))
        except TimeoutError:
            self.guard.count("idle_timeouts")
            with contextlib.suppress(OSError):  # a peer that stopped reading: closed all the same
                self._reply({"error": f"no request for {self.timeout:g} s: the connection is closed; reconnect"})
        except ConnectionError:
            pass  # the peer went away mid-request: there is no one to answer

    def _reply(self, reply: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(reply).encode() + b"\n")


def serve(switch: ServedSwitch, line: bytes, guard: Guard, peer: str) -> dict[str, Any]:
    """The reply to one request line from ``peer``: what the op returns, or ``{"error": ...}`` saying what was
    wrong with the request. A bad request must not cost its sender the connection without a word."""
    guard.count("requests")
    reply = _serve(switch, line, guard, peer)
    if "error" in reply:
        guard.count("errors")
    return reply


def _serve(switch: ServedSwitch, line: bytes, guard: Guard, peer: str) -> dict[str, Any]:
    try:
        req = json.loads(line.decode())
    except RecursionError:
        return {"error": "a request nests arrays or objects too deep to read: send one flat JSON object"}
    except ValueError as exc:  # not UTF-8, not JSON, a number past the digits Python converts
        return {"error": f"a request is one JSON object per line: {exc}"}
    if not isinstance(req, dict):
        return {"error": f"a request is a JSON object with an 'op', not {type(req).__name__}"}
    try:
        return _dispatch(switch, req, guard, peer)
    # What a request can make the switch's own checks raise (a job that is not installed, a config it
    # refuses); a request's own fields are checked before they reach it.
    except (SwitchAggError, ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        return {"error": str(exc) or type(exc).__name__}
    except Exception as exc:  # a fault of the switch's own: said, and the port keeps serving
        return {"error": f"the switch failed to serve {req.get('op')!r} ({type(exc).__name__}: {exc}); "
                         "report it with the request"}


def _dispatch(switch: ServedSwitch, req: dict[str, Any], guard: Guard, peer: str) -> dict[str, Any]:
    op = req.get("op")
    if op in ("add_job", "reset", "renew", "remove_job"):
        guard.admit(_asker(peer, req))
    if op == "status":
        entries, leases, owners = switch.jobs(), switch.leases(), switch.owners()
        jobs = {str(j): {"generation": e.generation, "slot_base": e.slot_base, "slot_count": e.slot_count,
                         "values_per_packet": e.values_per_packet, "workers": [list(w) for w in e.workers],
                         "lease": ({"seconds": leases[j][0], "left": leases[j][1]} if j in leases else None),
                         "owner": ({"host": owners[j][0], "pid": owners[j][1]} if j in owners else None)}
                for j, e in entries.items()}
        return {"address": list(switch.address), "backend": switch.backend, "cores": switch.cores,
                "num_slots": switch.num_slots, "jobs": jobs,
                "counters": _str_keys(switch.counters()), "shards": switch.shard_stats(),
                "sockets": switch.socket_counters(), "control": guard.counters(),
                "leases": switch.lease_counters()}
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
        guard.check_token(peer, req)
        text = req.get("config")
        if not isinstance(text, str):
            raise ConfigError("add_job needs 'config': the job's TOML text")
        config = JobConfig.from_toml(text, "'config'")
        if "key" in req and req["key"] != config.key:
            raise ConfigError("'key' differs from the key in 'config': send the job's own key, or none")
        return {"generation": switch.add_job(config, req.get("lease"), _owner(req))}
    if op == "reset":
        entry = _authorized(switch, req, guard, peer)
        return {"generation": switch.reset_job(entry.job_id)}
    if op == "renew":
        entry = _authorized(switch, req, guard, peer)
        return {"lease": switch.renew_job(entry.job_id)}
    if op == "remove_job":
        entry = _authorized(switch, req, guard, peer)
        switch.remove_job(entry.job_id)
        return {}
    raise ConfigError(f"unknown control op {op!r}: use status, slots, add_job, reset, renew or remove_job")


def _owner(req: dict[str, Any]) -> tuple[str, int] | None:
    """``add_job``'s ``owner``, checked: the deploying process's host name and pid, or None."""
    owner = req.get("owner")
    if owner is None:
        return None
    if (not isinstance(owner, dict) or not isinstance(owner.get("host"), str) or not _is_int(owner.get("pid"))
            or len(owner["host"]) > 255):
        raise ConfigError("'owner' is the deploying process: {\"host\": its host name, \"pid\": its pid}")
    return owner["host"], owner["pid"]


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


def _authorized(switch: ServedSwitch, req: dict[str, Any], guard: Guard, peer: str) -> JobEntry:
    """The installed job that the request's ``job`` names, if its ``key`` is that job's: a change needs it
    (a wrong one counts against ``peer``)."""
    entry = _installed(switch, req)
    key = req.get("key")
    if not _is_int(key):
        raise ConfigError(f"{req['op']} of job {entry.job_id} needs 'key': the job's key from its config")
    if not 0 <= key <= 0xFFFFFFFF or not secrets.compare_digest(key.to_bytes(4, "big"),
                                                                 entry.key.to_bytes(4, "big")):
        raise guard.refuse(_asker(peer, req),
                           f"'key' is not job {entry.job_id}'s key: send the key of the job's config")
    return entry


def _asker(peer: str, req: dict[str, Any]) -> str:
    """Whose wrong keys a request's are counted with: an address's for ``add_job`` (the operator's token),
    an address's for one job otherwise. Every process on a host shares its address, so a process that
    keeps sending a stale key must not lock out another group's renewals of its own job."""
    return peer if req.get("op") == "add_job" else f"{peer} (job {req.get('job')!r})"


def _str_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj
