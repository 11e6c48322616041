"""The embedded switch's control port, its client side: one request, one reply (see :mod:`.control`)."""

from __future__ import annotations

import json
import socket
from typing import Any

from ..config import Endpoint
from ..errors import ConfigError, SwitchAggError
from .control import control_token


def request(endpoint: Endpoint, req: dict[str, Any], timeout: float = 3.0,
            token: str | None = None) -> dict[str, Any]:
    """Send one control request to an embedded switch and return its reply; ``token`` (by default
    :data:`~switchagg.switch.control.TOKEN_ENV`'s value) goes with it where there is one, for a switch
    that requires it to install a job."""
    token = token if token is not None else control_token()
    if token is not None:
        req = {**req, "token": token}
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
    try:
        reply = json.loads(line)
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict):
        raise SwitchAggError(f"the control port at {endpoint} answered {line[:80]!r}, not a JSON object: is it an "
                             "embedded switch's control port (switch.control), not another service?")
    if "error" in reply:
        raise ConfigError(f"the switch at {endpoint} refused {req.get('op')!r}: {reply['error']}")
    return reply
