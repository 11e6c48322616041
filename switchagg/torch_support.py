"""Torch tensors in and out of the numpy path (CPU tensors; GPU buffers have their own module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def tensor_to_flat(t: torch.Tensor) -> tuple[np.ndarray, Callable[[np.ndarray, Any], Any], str]:
    """A flat numpy vector of ``t`` and a function that turns a result back into a tensor like it."""
    from .client import _kind

    t = t.detach()
    dtype, shape, device = t.dtype, t.shape, t.device
    kind = _kind(str(dtype).removeprefix("torch."))
    flat = t.reshape(-1).cpu()
    if dtype == torch.bfloat16:
        flat = flat.float()

    def restore(result: np.ndarray, out: torch.Tensor | None) -> torch.Tensor:
        back = torch.from_numpy(result).reshape(shape).to(device=device, dtype=dtype)
        if out is None:
            return back
        out.copy_(back)
        return out

    return flat.contiguous().numpy(), restore, kind
