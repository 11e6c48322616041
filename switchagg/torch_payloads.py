"""Torch tensors through the switch (:func:`switchagg.client.payloads_of` chooses the path).

CPU tensors take the numpy path (:func:`tensor_to_flat`). Tensors on a GPU
stay there: :class:`TorchPayloads` computes block exponents and quantizes with
torch ops on the device, stages each chunk's int32 values through pinned host
memory, and dequantizes the sums back on the device, with the same arithmetic
as :mod:`switchagg.codec` (power-of-two scales, round half to even), so a GPU
worker and a CPU worker put the very same bits on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .codec import MAX_EXPONENT, MIN_EXPONENT, encode_int32, scale_shift
from .errors import QuantizationError
from .wire import EXP_NONE, VALUE_DTYPE, Buffer


def tensor_to_flat(t: torch.Tensor) -> tuple[np.ndarray, Callable[[np.ndarray, Any], Any]]:
    """A flat numpy vector of CPU tensor ``t`` and a function that turns a result back into a tensor."""
    t = t.detach()
    dtype, shape, device = t.dtype, t.shape, t.device
    flat = t.reshape(-1).cpu()
    if dtype == torch.bfloat16:
        flat = flat.float()

    def restore(result: np.ndarray, out: torch.Tensor | None) -> torch.Tensor:
        back = torch.from_numpy(result).reshape(shape).to(device=device, dtype=dtype)
        if out is None:
            return back
        if out.data_ptr() != back.data_ptr():  # not already summed in place
            out.copy_(back)
        return out

    return flat.contiguous().numpy(), restore


def _times_pow2(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * 2**k`` in float32, in two exact steps when 2**k is not a float32."""
    if -126 <= k <= 127:
        return x * (2.0 ** k)
    half = k // 2
    return (x * (2.0 ** half)) * (2.0 ** (k - half))


class TorchPayloads:
    """A float tensor on any device, quantized there chunk by chunk (the GPU path)."""

    def __init__(self, tensor: torch.Tensor, k: int, n_workers: int) -> None:
        self.k, self.n = k, n_workers
        self.flat = tensor.detach().reshape(-1).float()
        self.device = self.flat.device
        self.out = torch.empty_like(self.flat)
        pinned = self.device.type == "cuda"
        self._stage = torch.empty(k, dtype=torch.int32, pin_memory=pinned)
        self._stage_np = self._stage.numpy()
        self._proposals = self._propose()

    def _propose(self) -> np.ndarray:
        n_blocks = -(-self.flat.numel() // self.k)
        if n_blocks == 0:
            return np.zeros(0, dtype=np.int8)
        padded = torch.zeros(n_blocks * self.k, dtype=torch.float32, device=self.device)
        padded[: self.flat.numel()] = self.flat
        maxabs = padded.view(n_blocks, self.k).abs().amax(dim=1)
        finite = bool(torch.isfinite(maxabs).all())
        if not finite:
            bad = int(torch.nonzero(~torch.isfinite(maxabs))[0])
            raise QuantizationError(
                f"block {bad} (elements {bad * self.k}..) holds NaN or infinity; fix the computation that "
                "produced it (e.g. lower the learning rate or enable gradient clipping) before reducing")
        exps = torch.frexp(maxabs).exponent.to(torch.int32)
        if int(exps.max()) > MAX_EXPONENT:
            raise QuantizationError("a value of magnitude >= 2**127 cannot be quantized to int32 blocks; "
                                    "scale the tensor down before reducing")
        exps = torch.clamp(exps, min=MIN_EXPONENT)
        exps[maxabs == 0] = EXP_NONE
        return exps.to(torch.int8).cpu().numpy()

    def proposals(self) -> np.ndarray:
        return self._proposals

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        block = self.flat[chunk * self.k:(chunk + 1) * self.k]
        q = torch.round(_times_pow2(block, scale_shift(exponent, self.n))).to(torch.int32)
        self._stage[: q.numel()].copy_(q)  # device -> pinned host, synchronous
        encode_int32(self._stage_np[: q.numel()], out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        part = self.out[chunk * self.k:(chunk + 1) * self.k]
        size = part.numel()
        self._stage_np[:size] = np.frombuffer(sums, VALUE_DTYPE, count=size)  # wire -> native int32, pinned
        values = self._stage[:size].to(self.device, non_blocking=True).float()
        part.copy_(_times_pow2(values, -scale_shift(exponent, self.n)))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the staging buffer is reused next

    def result(self, like: torch.Tensor, mean: bool) -> torch.Tensor:
        """The sums (or means) shaped and typed like the input."""
        out = self.out / self.n if mean else self.out
        return out.view(like.shape).to(like.dtype)
