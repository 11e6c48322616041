"""The embedded software switch as a target: its control port (``switchagg switch``, or a
:class:`~switchagg.switch.server.SoftSwitch` with ``control=``)."""

from __future__ import annotations

from typing import ClassVar

from ..config import Endpoint, JobConfig
from ..errors import ConfigError
from ..jobs import JobStatus
from ..switch.control_client import request
from .base import Target, TargetOptions


class SoftTarget(Target):
    """The embedded switch at ``control``, its control port."""

    name: ClassVar[str] = "soft"
    summary: ClassVar[str] = "the embedded software switch, through its control port (switch.control)"

    def __init__(self, control: Endpoint) -> None:
        self.control = control

    @classmethod
    def open(cls, options: TargetOptions) -> SoftTarget:
        if options.address:
            return cls(Endpoint.parse(options.address, "--address"))
        if options.config is None or options.config.control is None:
            raise ConfigError("this config has no switch.control address: add one "
                              "(e.g. control = \"127.0.0.1:16712\") and restart `switchagg switch`")
        return cls(options.config.control)

    def deploy(self, job: JobConfig) -> int:
        return request(self.control, {"op": "add_job", "config": job.to_toml()})["generation"]

    def undeploy(self, job_id: int) -> None:
        request(self.control, {"op": "remove_job", "job": job_id})

    def reset(self, job_id: int) -> int:
        return request(self.control, {"op": "reset", "job": job_id})["generation"]

    def status(self, job_id: int) -> JobStatus:
        reply = request(self.control, {"op": "status"})
        drops, backend = reply["counters"]["global"], reply.get("backend", "")
        job = reply["jobs"].get(str(job_id))
        if job is None:
            return JobStatus(self.name, job_id, False, global_drops=drops, transport=backend)
        return JobStatus(self.name, job_id, True, job["generation"], job["slot_base"], job["slot_count"],
                         len(job["workers"]), reply["counters"]["jobs"][str(job_id)], drops, backend)
