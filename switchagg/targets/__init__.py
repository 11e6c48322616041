"""The targets: one implementation of :class:`~switchagg.targets.base.Target` per kind of switch.

The command line looks a target up here by name; adding a target is adding it to :data:`TARGETS`.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import Target, TargetOptions, UnsupportedOperation
from .bmv2 import Bmv2Target
from .soft import SoftTarget
from .tofino import Tofino2Target, TofinoTarget

TARGETS: dict[str, type[Target]] = {t.name: t for t in (SoftTarget, Bmv2Target, TofinoTarget, Tofino2Target)}

__all__ = ["TARGETS", "Target", "TargetOptions", "UnsupportedOperation", "open_target", "target_class"]


def target_class(name: str) -> type[Target]:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"unknown target {name!r}: use one of {', '.join(TARGETS)}") from None


def open_target(name: str, options: TargetOptions) -> Target:
    """The target ``name`` reached as ``options`` say."""
    return target_class(name).open(options)
