"""switchagg: in-network gradient aggregation with programmable switch offload.

The names most users need are here: :class:`JobConfig`, :class:`Client` and
:class:`SoftSwitch`; the errors live in :mod:`switchagg.errors`.
"""

from .client import Client
from .config import Endpoint, JobConfig, WorkerSpec
from .errors import (
    ClosedError,
    ConfigError,
    JobNotStarted,
    QuantizationError,
    StallError,
    SwitchAggError,
)
from .switch.server import SoftSwitch

__version__ = "0.1.0"

__all__ = [
    "Client", "ClosedError", "ConfigError", "Endpoint", "JobConfig", "JobNotStarted",
    "QuantizationError", "SoftSwitch", "StallError", "SwitchAggError", "WorkerSpec",
]
