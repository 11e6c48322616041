"""The Target interface: what every switch that can run switchagg jobs offers its control plane.

A target is one kind of switch (the embedded one, BMv2, Tofino), reached at one address. Its
operations are the lifecycle of a job: ``deploy`` installs it (with a lease where the target keeps
them: the switch removes the job once the lease lapses, and ``renew`` extends it), ``reset`` starts a
new run (a new generation, so old state reads as empty), ``status`` reads its counters, ``undeploy``
removes it;
``build`` compiles the target's data plane where it has one. An operation a target does not have
raises :class:`UnsupportedOperation`, whose message says what to do instead.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..config import JobConfig
from ..errors import SwitchAggError
from ..jobs import JobStatus


class UnsupportedOperation(SwitchAggError):
    """This target has no such operation."""


@dataclass(frozen=True)
class TargetOptions:
    """How to reach a target: the job's config, and the control address and device of a P4 switch.

    A target refuses, in :meth:`Target.open`, an option it has no use for (a device id for the
    embedded switch, a pipeline for Tofino): a flag that is silently dropped reads as if it worked.
    """

    config: JobConfig | None = None
    address: str | None = None  # the target's control-plane address; each target has a default
    device_id: int | None = None  # a P4 switch's device id; None: 0
    pipeline: str | None = None  # a build directory: compile into it and push the program before deploying


class Target(abc.ABC):
    """One switch's control plane. Construct one with :func:`switchagg.targets.open_target`."""

    name: ClassVar[str]
    summary: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def open(cls, options: TargetOptions) -> Target:
        """The target reached as ``options`` say (raises when they do not say enough)."""

    @abc.abstractmethod
    def deploy(self, job: JobConfig, lease: float | None = None) -> int:
        """Install ``job``; returns its generation. With ``lease`` (seconds) the switch removes the job once
        that long passes without a :meth:`renew`; a target that keeps no leases refuses one
        (:class:`UnsupportedOperation`) before it changes anything."""

    def check(self, job: JobConfig) -> None:
        """Refuse, saying what to change, a job this target cannot serve, touching nothing: a tree's levels are
        each checked before any is deployed. By default nothing is refused here (:meth:`deploy` still may)."""
        return None

    @abc.abstractmethod
    def undeploy(self, job_id: int) -> None:
        """Remove the job: its packets are no longer admitted."""

    @abc.abstractmethod
    def reset(self, job_id: int) -> int:
        """Start a new run of the job; returns the new generation."""

    @abc.abstractmethod
    def status(self, job_id: int) -> JobStatus:
        """The job's parameters (None when not installed) and counters, and the switch-wide drops."""

    def renew(self, job_id: int) -> None:
        """Extend the job's lease by its whole length again (a process group's rank 0 does, while the group lives)."""
        raise UnsupportedOperation(self._no_leases())

    def _no_leases(self) -> str:
        """What a target that keeps no leases says: why, and what to do instead."""
        return (f"the {self.name} target keeps no leases: its control plane runs no timer to expire a job, so a job "
                "stays until `switchagg undeploy` (or destroy_process_group) removes it; deploy it without a lease")

    def jobs(self) -> dict[int, tuple[int, int]]:
        """The installed jobs' slot ranges, ``{job_id: (slot_base, slot_count)}``: where a new job fits."""
        raise UnsupportedOperation(f"the {self.name} target cannot list its jobs")

    def capacity(self) -> tuple[int, int | None]:
        """The switch's slot pool and the most jobs it holds (None: no such limit): how big a new job may be."""
        raise UnsupportedOperation(f"the {self.name} target cannot say how many slots it has")

    @classmethod
    def build(cls, out_dir: Path) -> dict[str, Path]:
        """Compile this target's data plane into ``out_dir``; returns what was made, by name."""
        raise UnsupportedOperation(f"the {cls.name} target has no data plane to compile")

    @classmethod
    def resources(cls, out_dir: Path) -> str:
        """The compiler's report of what a build in ``out_dir`` uses of the chip, as lines a person reads."""
        raise UnsupportedOperation(f"the {cls.name} target's compiler writes no resource report "
                                   "(only the Tofino targets' does)")
