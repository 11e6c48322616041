"""The embedded software switch as a target: its control port (``switchagg switch``, or a
:class:`~switchagg.switch.server.SoftSwitch` with ``control=``).

Changes to a job (``deploy``, ``reset``, ``renew``, ``undeploy``) carry the job's key, which the control
port checks against the installed job's: the key comes from the config the target was opened with. A
job deployed with a lease is removed by the switch once the lease lapses unrenewed; every deploy
records this process (host name and pid) as the job's owner, which status shows.
Every request carries the operator's control token where one is set (``token``, by default
``SWITCHAGG_CONTROL_TOKEN``'s value), which a switch started with one requires to install a job.
"""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar

from ..config import Endpoint, JobConfig
from ..errors import ConfigError
from ..jobs import JobStatus
from ..switch.control_client import request
from .base import Target, TargetOptions


class SoftTarget(Target):
    """The embedded switch at ``control``, its control port; ``config`` is the job whose key changes carry,
    ``token`` the control token (None: ``SWITCHAGG_CONTROL_TOKEN``'s, where it is set)."""

    name: ClassVar[str] = "soft"
    summary: ClassVar[str] = "the embedded software switch, through its control port (switch.control)"

    def __init__(self, control: Endpoint, config: JobConfig | None = None, token: str | None = None) -> None:
        self.control = control
        self.config = config
        self.token = token

    def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        return request(self.control, req, token=self.token)

    @classmethod
    def open(cls, options: TargetOptions) -> SoftTarget:
        if options.device_id is not None:
            raise ConfigError("--device-id: the embedded switch has no device id (P4 targets only): drop it")
        if options.pipeline:
            raise ConfigError("--pipeline: the embedded switch runs no P4 program to push (bmv2 only): drop it")
        if options.address:
            return cls(Endpoint.parse(options.address, "--address"), options.config)
        if options.config is None or options.config.control is None:
            raise ConfigError("this config has no switch.control address: add one "
                              "(e.g. control = \"127.0.0.1:16712\") and restart `switchagg switch`")
        return cls(options.config.control, options.config)

    def _key(self, job_id: int, what: str) -> int:
        """The key that authorizes a change to ``job_id``: the opening config's, which must be that job's."""
        if self.config is None or self.config.job_id != job_id:
            raise ConfigError(f"{what} job {job_id} on the embedded switch needs the job's key: open the target "
                              f"with that job's config (--config)")
        return self.config.key

    def deploy(self, job: JobConfig, lease: float | None = None) -> int:
        req = {"op": "add_job", "config": job.to_toml(), "key": job.key,
               "owner": {"host": socket.gethostname(), "pid": os.getpid()}}
        if lease is not None:
            req["lease"] = lease
        return self._request(req)["generation"]

    def renew(self, job_id: int) -> None:
        self._request({"op": "renew", "job": job_id, "key": self._key(job_id, "renewing")})

    def undeploy(self, job_id: int) -> None:
        self._request({"op": "remove_job", "job": job_id, "key": self._key(job_id, "removing")})

    def reset(self, job_id: int) -> int:
        return self._request({"op": "reset", "job": job_id,
                                      "key": self._key(job_id, "resetting")})["generation"]

    def jobs(self) -> dict[int, tuple[int, int]]:
        jobs = self._request({"op": "status"})["jobs"]
        return {int(j): (e["slot_base"], e["slot_count"]) for j, e in jobs.items()}

    def capacity(self) -> tuple[int, int | None]:
        return request(self.control, {"op": "status"})["num_slots"], None

    def status(self, job_id: int) -> JobStatus:
        reply = self._request({"op": "status"})
        drops, backend = reply["counters"]["global"], reply.get("backend", "")
        host = {f"{part}_{name}": n for part in ("sockets", "control", "leases")
                for name, n in reply.get(part, {}).items()}
        every = {int(j): {"slot_base": e["slot_base"], "slot_count": e["slot_count"], "n_workers": len(e["workers"]),
                          "lease": None if e.get("lease") is None else e["lease"]["left"], "owner": _owner(e)}
                 for j, e in reply["jobs"].items()}
        job = reply["jobs"].get(str(job_id))
        if job is None:
            return JobStatus(self.name, job_id, False, global_drops=drops, transport=backend, host_counters=host,
                             switch_jobs=every)
        return JobStatus(self.name, job_id, True, job["generation"], job["slot_base"], job["slot_count"],
                         len(job["workers"]), reply["counters"]["jobs"][str(job_id)], drops, backend, host,
                         lease=every[job_id]["lease"], owner=every[job_id]["owner"], switch_jobs=every)


def _owner(job: dict[str, Any]) -> str:
    """A job's owner as status shows it, "host pid N" ("" where its deploy named none)."""
    owner = job.get("owner")
    return "" if owner is None else f"{owner['host']} pid {owner['pid']}"
