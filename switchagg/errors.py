"""Exceptions of switchagg; each message says what the user can do about it."""

from __future__ import annotations


class SwitchAggError(Exception):
    """Base class of every error switchagg raises on purpose."""


class ConfigError(SwitchAggError, ValueError):
    """A job configuration is invalid or disagrees with the switch."""


class QuantizationError(SwitchAggError, ValueError):
    """A float call's input held NaN or infinity on some rank, with ``Client(nonfinite="raise")``."""


class JobNotStarted(SwitchAggError, TimeoutError):
    """The switch never answered: it is down, or the job is not admitted, or peers never came."""


class StallError(SwitchAggError, TimeoutError):
    """Progress stopped: a peer died, or the switch stopped answering."""


class ClosedError(SwitchAggError, RuntimeError):
    """The client was closed, or failed earlier and can no longer be used."""


class CallMismatch(SwitchAggError, ValueError):
    """Workers issued different calls at the same place in their sequence (length, kind or op).

    Raised on every rank for that call; the ranks' next calls stay paired.
    """


class PeerFailed(SwitchAggError, RuntimeError):
    """Another rank could not take part in this call (its input could not be reduced).

    That rank raises its own error for the call; every other rank raises this one, and the
    ranks' next calls stay paired.
    """


class NoRoom(SwitchAggError):
    """The switch has no slots (or job entries) free for a process group's jobs: the group sums through
    its fallback backend instead, and says so."""
