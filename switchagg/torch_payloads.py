"""Torch tensors through the switch (:func:`switchagg.client.payloads_of` chooses the path).

CPU tensors take the numpy path (:func:`tensor_to_flat`). Tensors on a GPU
stay there: :class:`TorchPayloads` computes block exponents and quantizes with
torch ops on the device, stages each chunk's int32 values through pinned host
memory, and dequantizes the sums back on the device, with the same arithmetic
as :mod:`switchagg.codec` (power-of-two scales, round half to even, and the
class codes of a chunk marked :data:`~switchagg.wire.EXP_NONFINITE`), so a GPU
worker and a CPU worker put the very same bits on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .calls import Layout
from .codec import (
    CLASS_NAN,
    CLASS_NEG,
    CLASS_POS,
    MAX_EXPONENT,
    MIN_EXPONENT,
    NONFINITE_FROM,
    encode_int32,
    scale_shift,
)
from .wire import EXP_NONE, EXP_NONFINITE, VALUE_DTYPE, Buffer


def tensor_to_flat(t: torch.Tensor) -> tuple[np.ndarray, Callable[[np.ndarray, Any], Any]]:
    """A flat numpy vector of CPU tensor ``t`` and a function that turns a result (shaped as the
    call's result) back into a tensor of ``t``'s dtype and device."""
    t = t.detach()
    dtype, device = t.dtype, t.device
    flat = t.reshape(-1).cpu()
    if dtype == torch.bfloat16:
        flat = flat.float()

    def restore(result: np.ndarray, out: torch.Tensor | None) -> torch.Tensor:
        back = torch.from_numpy(result).to(device=device, dtype=dtype)
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


def _decode_classes(counts: torch.Tensor) -> torch.Tensor:
    """Summed class codes into floats, as codec.dequantize decodes them: an infinity where only that
    sign was counted, NaN everywhere else (a NaN, both signs, or only finite values: no finite sum
    travelled in the chunk)."""
    pos = (counts & 0xFF) != 0
    neg = ((counts >> 8) & 0xFF) != 0
    nan = ((counts >> 16) & 0xFF) != 0
    out = torch.full(counts.shape, float("nan"), dtype=torch.float32, device=counts.device)
    out[pos & ~neg & ~nan] = float("inf")
    out[neg & ~pos & ~nan] = float("-inf")
    return out


class TorchPayloads:
    """A float tensor on any device, quantized there chunk by chunk (the GPU path).

    ``layout`` as :class:`~switchagg.payloads.FloatPayloads`'s: an allreduce's by default; a
    reduce-scatter's sums land in a shard-sized :attr:`out`.
    """

    def __init__(self, tensor: torch.Tensor, k: int, n_workers: int, layout: Layout | None = None) -> None:
        self.k, self.n = k, n_workers
        self.flat = tensor.detach().reshape(-1).float()
        self.layout = layout or Layout(k, self.flat.numel())
        self.device = self.flat.device
        self.out = torch.empty(self.layout.shard if self.layout.scatter else self.flat.numel(),
                               dtype=torch.float32, device=self.device)
        pinned = self.device.type == "cuda"
        self._stage = torch.empty(k, dtype=torch.int32, pin_memory=pinned)
        self._stage_np = self._stage.numpy()
        self._proposals = self._propose()

    def _propose(self) -> np.ndarray:
        """Each chunk's proposal, as codec.propose_exponents makes them, for all shards at once: each
        shard padded with zeros to whole chunks, one row per chunk."""
        layout = self.layout
        n_blocks = layout.n_chunks
        if n_blocks == 0:
            return np.zeros(0, dtype=np.int8)
        padded = torch.zeros(layout.shards, layout.per_shard * self.k, dtype=torch.float32, device=self.device)
        padded[:, : layout.shard] = self.flat.view(layout.shards, layout.shard)
        maxabs = padded.view(n_blocks, self.k).abs().amax(dim=1)  # amax propagates NaN
        exps = torch.frexp(maxabs).exponent.to(torch.int32)
        exps = torch.clamp(exps, min=MIN_EXPONENT, max=MAX_EXPONENT)
        exps[maxabs == 0] = EXP_NONE
        exps[~(maxabs < NONFINITE_FROM)] = EXP_NONFINITE  # as codec.propose_exponents: NaN compares false
        return exps.to(torch.int8).cpu().numpy()

    def proposals(self) -> np.ndarray:
        return self._proposals

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        start, stop = self.layout.source(chunk)
        block = self.flat[start:stop]
        if exponent == EXP_NONFINITE:  # class codes, as codec.quantize writes them
            q = ((block >= NONFINITE_FROM).to(torch.int32) * CLASS_POS
                 + (block <= -NONFINITE_FROM).to(torch.int32) * CLASS_NEG
                 + torch.isnan(block).to(torch.int32) * CLASS_NAN)
        else:
            q = torch.round(_times_pow2(block, scale_shift(exponent, self.n))).to(torch.int32)
        self._stage[: q.numel()].copy_(q)  # device -> pinned host, synchronous
        encode_int32(self._stage_np[: q.numel()], out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        start, stop = self.layout.target(chunk)
        part = self.out[start:stop]
        size = part.numel()
        self._stage_np[:size] = np.frombuffer(sums, VALUE_DTYPE, count=size)  # wire -> native int32, pinned
        values = self._stage[:size].to(self.device, non_blocking=True)
        if exponent == EXP_NONFINITE:
            part.copy_(_decode_classes(values))
        else:
            part.copy_(_times_pow2(values.float(), -scale_shift(exponent, self.n)))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the staging buffer is reused next

    def result(self, like: torch.Tensor, mean: bool, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The sums (or means) typed like the input ``like``, shaped like it or as ``shape`` (a
        reduce-scatter's shard)."""
        out = self.out / self.n if mean else self.out
        return out.view(like.shape if shape is None else shape).to(like.dtype)
