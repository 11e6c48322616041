"""Torch tensors through the switch (:func:`switchagg.client.payloads_of` chooses the path).

CPU tensors take the numpy path (:func:`tensor_to_flat`). A float tensor on a GPU stays there:
:class:`TorchPayloads` works out its chunks' exponents and quantizes them on the device, a window of
chunks at a time, and the C stream (:class:`~switchagg.protocol.NativeReduction`) sends them from
pinned host memory; the sums come back into pinned memory and go to the device a window at a time,
dequantized there. The arithmetic is :mod:`switchagg.codec`'s (power-of-two scales, round half to
even, the class codes of a chunk marked :data:`~switchagg.wire.EXP_NONFINITE`), so a GPU worker and
a CPU worker put the very same bits on the wire.

Why windows: a chunk is quantized with the largest exponent any rank proposed for it, which comes
back in the result of its slot's previous use (``docs/protocol.md`` section 4), so it can be
quantized only once that result is in. Chunk by chunk that cost about seven kernel launches, a
blocking copy and a synchronization per chunk (a 25 MB bucket at K = 64 is ~100k chunks). Here the
chunks whose exponents are agreed go half the job's slots at a time (the other half is on the wire
meanwhile) through a few kernels and one copy into pinned memory, and the stream sends a data chunk
only once its window is there (:class:`~switchagg.protocol.StagedPayloads`).

The work runs on a stream of the client's own, which first waits for the caller's current stream
(where the gradient is being written). The client's thread waits for events (the proposals, each
window's copy), never for the device or a whole stream; the caller's thread (a DDP hook's: autograd's)
waits for nothing. :class:`Device` is the one place that waits, and it counts: on a CPU, where each op
is done when it returns, it only counts, so the tests hold the waits to one per window on any machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

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
    ceil_log2,
    encode_int32,
)
from .wire import EXP_NONE, EXP_NONFINITE, VALUE_DTYPE, Buffer

if TYPE_CHECKING:
    from .protocol import NativeReduction, Reduction

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # the stream each GPU's calls run on, made once


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


def stays_on_device(t: torch.Tensor) -> bool:
    """Whether a tensor is quantized where it lives (:class:`TorchPayloads`): a float tensor off the CPU.
    A CPU tensor takes the numpy path, which runs the codec inside the C stream."""
    return t.device.type != "cpu" and t.is_floating_point()


class Device:
    """Where a call's tensor work runs, and the one place that waits for it.

    On a GPU the work goes on a stream of its own, which first waits (on the device) for the caller's
    current stream; :meth:`wait` waits for one event of it, never for the device or a stream, and
    :meth:`hand_over` makes the calling thread's stream wait for it on the device. On a CPU each op is
    done when it returns: an event is nothing, and :meth:`wait` only counts where a GPU would wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda and device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        self.stream = _STREAMS.get(device)
        self.waits = 0  # how often a thread waited for this call's device work
        self.waiters: set[int] = set()  # which threads did (threading.get_ident())

    def follow_caller(self) -> None:
        """What the calling thread's current stream queued comes first (the tensor is being written there)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def scope(self) -> AbstractContextManager:
        """Ops inside run on this call's stream."""
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def keep(self, tensor: torch.Tensor) -> None:
        """``tensor``, made on another stream, is used on this one: its memory is not reused before this
        stream's work on it is done (the caching allocator's ``record_stream``)."""
        if self.cuda:
            tensor.record_stream(self.stream)

    def pinned(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies to and from without the host waiting (page-locked on a GPU's)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far (None on a CPU: it is done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Wait for ``event`` (:meth:`mark`): a host synchronization, counted."""
        self.waits += 1
        self.waiters.add(threading.get_ident())
        if event is not None:
            event.synchronize()

    def hand_over(self, result: torch.Tensor) -> None:
        """The calling thread's current stream waits for this call's work (on the device), and ``result``,
        made on this call's stream, is kept until that stream's use of it is done."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            result.record_stream(current)


class TorchPayloads:
    """A float tensor on any device, quantized there a window of chunks at a time (the GPU path):
    :class:`~switchagg.protocol.StagedPayloads`.

    ``layout`` as :class:`~switchagg.payloads.FloatPayloads`'s: an allreduce's by default; a
    reduce-scatter's sums (of ``rank``'s shard) land in a shard-sized :attr:`out`. Made in the caller's
    thread, it only queues work there: :meth:`proposals` waits for their copy, on the client's thread.
    """

    def __init__(self, tensor: torch.Tensor, k: int, n_workers: int, layout: Layout | None = None,
                 rank: int = 0) -> None:
        self.k, self.n, self._log2n = k, n_workers, ceil_log2(n_workers)
        self.layout = layout = layout or Layout(k, tensor.numel())
        n_chunks = layout.n_chunks
        # the data chunks whose sums this rank receives: all, or a reduce-scatter's own shard's
        self._own = (rank * layout.per_shard, (rank + 1) * layout.per_shard) if layout.scatter else (0, n_chunks)
        self.work = Device(tensor.device)
        self._rows = self.work.pinned(n_chunks, k, dtype=torch.int32)  # each chunk quantized: what the stream sends
        self._sums = self.work.pinned(self._own[1] - self._own[0], k, dtype=torch.int32)  # and the sums it receives
        self.rows, self.sums = self._rows.numpy(), self._sums.numpy()
        self._proposals = self.work.pinned(n_chunks, dtype=torch.int8)
        self._agreed = self.work.pinned(n_chunks, dtype=torch.int8)  # the exponent each chunk went with
        self.work.follow_caller()
        with self.work.scope():
            self.work.keep(tensor)
            self._chunks = _as_chunks(tensor.detach(), layout)  # (n_chunks, K) float32, zero-padded
            self._exponents = torch.empty(n_chunks, dtype=torch.int32, device=tensor.device)  # the agreed ones
            self.out = torch.empty(layout.shard if layout.scatter else tensor.numel(), dtype=torch.float32,
                                   device=tensor.device)
            self._proposals.copy_(_propose(self._chunks), non_blocking=True)
            self._proposed = self.work.mark()
        self._waited = False  # for the proposals' copy
        self._quantized = self._dequantized = 0  # data chunks [0, m) quantized (handed to the stream), dequantized

    def proposals(self) -> np.ndarray:
        """Each chunk's proposed exponent (int8), once its copy to the host is done."""
        if not self._waited:
            self.work.wait(self._proposed)
            self._waited = True
        return self._proposals.numpy()

    # ---- the windows (StagedPayloads.advance) ---------------------------------------------------------

    def advance(self, red: Reduction | NativeReduction, now: float) -> None:
        """Quantize the chunks whose exponents the switch agreed, a window at a time (half the slots), and
        hand them to ``red``; dequantize the sums that came, a window at a time. A window short of that
        goes only where it is the call's last: once every chunk handed over is summed, at least the next
        slots' worth are agreed, so the windows never wait on each other."""
        if red.mismatch is not None:  # the ranks' calls differ: no data goes
            return
        window, n_chunks = max(1, red.params.slot_count // 2), self.layout.n_chunks
        agreed = red.agreed_upto()
        while self._quantized < agreed and (agreed - self._quantized >= window or agreed == n_chunks):
            stop = min(self._quantized + window, agreed)
            self._quantize(self._quantized, stop, red.exponents(self._quantized, stop))
            self._quantized = stop
            red.prepare(stop, now)
        summed = red.summed_upto()
        while self._dequantized < summed and (summed - self._dequantized >= window or summed == n_chunks):
            stop = min(self._dequantized + window, summed)
            self._dequantize(self._dequantized, stop)
            self._dequantized = stop

    def _quantize(self, start: int, stop: int, exponents: bytes) -> None:
        """Data chunks [start, stop) quantized with their agreed exponents into their rows of pinned
        memory; returns once the rows are there (the one wait of a window)."""
        agreed = self._agreed.numpy()
        agreed[start:stop] = np.frombuffer(exponents, np.int8)
        with self.work.scope():
            e = self._agreed[start:stop].to(self.work.device, non_blocking=True).int()
            self._exponents[start:stop] = e
            x = self._chunks[start:stop]
            q = torch.round(_times_pow2(x, _shift(e, self._log2n))).to(torch.int32)
            if (agreed[start:stop] == EXP_NONFINITE).any():  # class codes where some rank's chunk held NaN or inf
                q = torch.where((e == EXP_NONFINITE)[:, None], _encode_classes(x), q)
            self._rows[start:stop].copy_(q, non_blocking=True)
            copied = self.work.mark()
        self.work.wait(copied)

    def _dequantize(self, start: int, stop: int) -> None:
        """The sums of data chunks [start, stop) that this rank receives, from pinned memory into :attr:`out`,
        dequantized on the device; nothing waits (the stream orders it before the result's use)."""
        first, last = max(start, self._own[0]), min(stop, self._own[1])
        if first >= last:
            return
        rows = slice(first - self._own[0], last - self._own[0])
        with self.work.scope():
            sums = self._sums[rows].to(self.work.device, non_blocking=True)
            e = self._exponents[first:last]
            values = _times_pow2(sums.float(), -_shift(e, self._log2n))
            if (self._agreed.numpy()[first:last] == EXP_NONFINITE).any():
                values = torch.where((e == EXP_NONFINITE)[:, None], _decode_classes(sums), values)
            at = rows.start * self.k
            end = min(rows.stop * self.k, self.out.numel())
            self.out[at:end] = values.reshape(-1)[: end - at]

    # ---- one chunk at a time (the Python Reduction's Payloads) ------------------------------------------

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        """Chunk ``chunk``'s row, quantized with ``exponent`` when its window was (:meth:`advance`)."""
        encode_int32(self.rows[chunk], out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        """Its sums into its row, dequantized with its window (:meth:`advance`)."""
        self.sums[chunk - self._own[0]] = np.frombuffer(sums, VALUE_DTYPE, count=self.k)

    def result(self, like: torch.Tensor, mean: bool, shape: tuple[int, ...] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The sums (or means) typed like the input ``like``, shaped like it or as ``shape`` (a
        reduce-scatter's shard), in ``out`` where given; the calling thread's stream waits for them."""
        with self.work.scope():
            result = self.out / self.n if mean else self.out
            result = result.view(like.shape if shape is None else shape).to(like.dtype)
            if out is not None:
                self.work.keep(out)
                result = out.copy_(result)
        self.work.hand_over(result)
        return result


def _as_chunks(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The call's values as float32 rows of K, one per data chunk, each shard zero-padded to whole chunks
    (a view of the tensor where it already is that)."""
    flat = tensor.reshape(-1).float()
    if layout.per_shard * layout.k == layout.shard:  # whole chunks: no padding
        return flat.view(layout.n_chunks, layout.k)
    padded = torch.zeros(layout.shards, layout.per_shard * layout.k, dtype=torch.float32, device=flat.device)
    padded[:, : layout.shard] = flat.view(layout.shards, layout.shard)
    return padded.view(layout.n_chunks, layout.k)


def _propose(chunks: torch.Tensor) -> torch.Tensor:
    """Each row's proposed exponent as codec.propose_exponents makes it, with no wait: ``where``, not
    the masked assignment that makes the host wait for the mask's indices."""
    maxabs = chunks.abs().amax(dim=1)  # amax keeps NaN
    exps = torch.frexp(maxabs).exponent.clamp(MIN_EXPONENT, MAX_EXPONENT)
    exps = torch.where(maxabs == 0, EXP_NONE, exps)
    return torch.where(maxabs < NONFINITE_FROM, exps, EXP_NONFINITE).to(torch.int8)  # NaN compares false


def _shift(exponents: torch.Tensor, log2n: int) -> torch.Tensor:
    """codec.scale_shift of each exponent (int32)."""
    return 31 - torch.where(exponents == EXP_NONE, MIN_EXPONENT, exponents) - log2n


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for integer k in [-126, 127]: built from its bits."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _times_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` row by row (``k``: an int32 per row), in float32 as the codec does it: in one exact step
    where 2**k is a float32, else in two (2**(k // 2), then the rest)."""
    one = (k >= -126) & (k <= 127)
    first = torch.where(one, k, torch.div(k, 2, rounding_mode="floor"))
    return x * _pow2(first)[:, None] * _pow2(torch.where(one, 0, k - first))[:, None]


def _encode_classes(x: torch.Tensor) -> torch.Tensor:
    """Each value's class code (int32), as codec.quantize encodes a marked chunk: +inf (or >= 2**126)
    in the low 16 bits, -inf (or <= -2**126) in the high 16, NaN in both; a function of its own so that
    tests can hold it to the numpy codec's for any number of contributors."""
    return ((x >= NONFINITE_FROM).int() * CLASS_POS + (x <= -NONFINITE_FROM).int() * CLASS_NEG
            + torch.isnan(x).int() * CLASS_NAN)


def _decode_classes(counts: torch.Tensor) -> torch.Tensor:
    """Summed class codes (int32, up to 65,535 contributors') into floats, as codec.dequantize decodes
    them: an infinity where only that sign's half counted, NaN everywhere else (both halves: a NaN or
    both signs; neither: only finite values, whose sum did not travel in the chunk). The shift is
    arithmetic, which keeps a high half of 32,768 or more (a negative sum) non-zero all the same."""
    pos = (counts & 0xFFFF) != 0
    neg = (counts >> 16) != 0
    return torch.where(pos & ~neg, torch.inf, torch.where(neg & ~pos, -torch.inf, torch.nan))
