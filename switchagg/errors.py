"""Exceptions of switchagg; each message says what the user can do about it."""

from __future__ import annotations


class SwitchAggError(Exception):
    """Base class of every error switchagg raises on purpose."""


class ConfigError(SwitchAggError, ValueError):
    """A job configuration is invalid or disagrees with the switch."""


class QuantizationError(SwitchAggError, ValueError):
    """A tensor cannot be quantized (NaN, infinity, or out of range)."""


class JobNotStarted(SwitchAggError, TimeoutError):
    """The switch never answered: it is down, or the job is not admitted, or peers never came."""


class StallError(SwitchAggError, TimeoutError):
    """Progress stopped: a peer died, or the switch stopped answering."""


class ClosedError(SwitchAggError, RuntimeError):
    """The client was closed, or failed earlier and can no longer be used."""
