"""The worker's two host<->device crossings per step: one upload, one readback.

`HostUpload` packs a step's host arrays (token ids, positions, slots, tables, sampling
parameters; each in its own dtype) into one persistent byte buffer — pinned on CUDA, so the copy
is asynchronous — and sends it with one non-blocking copy into one of two device buffers, taken in
turn; the typed views of a layout are made once per buffer and reused while the layout repeats (a
decode step's does). Before the buffer is written again, `send` waits for the last copy out of it
(a CUDA event): usually already done, since most steps end with the readback, which waits for
every earlier copy on the stream; but a step with nothing to read back (a prefill chunk that
samples nothing) returns before its copy has run, and the next step must not overwrite its inputs.

`HostReadback` collects the step's device results (sampled tokens, accepted counts, drafts,
logprob rows) and brings them all back with one device->host copy: every part is 32 bits wide
(float32 travels as its int32 bit pattern, a small int64 as its two halves), so they concatenate
into one int32 buffer (a step with one part, a greedy decode's tokens, copies it as it is; parts
that already lie back to back in one buffer are copied as that one span, without the
concatenation's kernel and its launch; views of one buffer known together, `LogprobGraphs.greedy`'s
tokens and columns, are registered as that one part with `add_packed`). `start`
only queues that copy (into pinned memory, on CUDA) and `PendingReadback.wait` waits for it, so
the host can queue the next step's work before it waits for this one's results (overlapped
decoding, `SchedulerCore`); `fetch` is the two at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch


class HostUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer
        # CUDA: two device buffers the copies land in, taken in turn (CPU: the host buffer itself)
        self._targets = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2 if self._pinned else 0)]
        self._turn = 0
        self._views: list[dict[tuple, dict[str, torch.Tensor]]] = [{}, {}]  # per target: layout -> its views
        self._typed: list[dict[str, torch.Tensor]] = [{}, {}]  # per target: dtype -> the whole target as that dtype

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array arrives with its own dtype and shape (int64, int32, float32, bool ...). The
        tensors returned hold their values until the send after the next (on the CPU: until the
        next), and every use queued on the stream before that send reads them intact."""
        offsets, total = [], 0
        for array in arrays.values():
            total = -(-total // ALIGN) * ALIGN  # every part starts 8-byte aligned, so it can be viewed as its dtype
            offsets.append(total)
            total += array.nbytes
        if self._copied is not None:
            self._copied.synchronize()  # its copy has left the buffer: safe to overwrite
        if self._buffer.numel() < total:
            self._buffer = torch.empty(max(total, 2 * self._buffer.numel()), dtype=torch.uint8, pin_memory=self._pinned)
            if not self._pinned:
                self._forget(0)  # the CPU's views are of this buffer
        host = self._buffer.numpy()
        for array, offset in zip(arrays.values(), offsets, strict=True):
            host[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        turn = 0
        if self._pinned:
            turn, self._turn = self._turn, 1 - self._turn
            if self._targets[turn].numel() < total:
                self._targets[turn] = torch.empty(self._buffer.numel(), dtype=torch.uint8, device=self.device)
                self._forget(turn)
            self._targets[turn][:total].copy_(self._buffer[:total], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return dict(self._layout_views(turn, arrays, offsets))

    def _layout_views(self, turn: int, arrays: dict[str, np.ndarray], offsets: list[int]) -> dict[str, torch.Tensor]:
        """The typed views of one layout (names, dtypes, shapes), made once: a decode step sends the
        same layout step after step, and ~3 view calls per array were most of `send`'s own time. A new
        layout (a batch that changed size, tables that widened: frequent in a batch whose requests
        come and go) makes each view in one call, from the target viewed whole as its dtype."""
        key = tuple((name, array.dtype.str, array.shape) for name, array in arrays.items())
        views = self._views[turn].get(key)
        if views is None:
            if len(self._views[turn]) >= MAX_LAYOUTS:
                self._views[turn].clear()
            typed = self._typed[turn]
            for array in arrays.values():
                if array.dtype.str not in typed:
                    typed[array.dtype.str] = self._typed_target(turn, array.dtype.str)
            views = self._views[turn][key] = {
                name: typed[array.dtype.str].as_strided(array.shape, _strides(array.shape), offset // array.itemsize)
                for (name, array), offset in zip(arrays.items(), offsets, strict=True)
            }
        return views

    def _typed_target(self, turn: int, dtype: str) -> torch.Tensor:
        """The target (CPU: the host buffer) as `dtype`, its whole items (every part starts ALIGN-aligned)."""
        target = self._targets[turn] if self._pinned else self._buffer
        size = _TORCH_DTYPES[dtype].itemsize
        return target[: target.numel() - target.numel() % size].view(_TORCH_DTYPES[dtype])

    def _forget(self, turn: int) -> None:
        """A new target (or CPU buffer): the views of the old one go."""
        self._views[turn].clear()
        self._typed[turn].clear()


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous array's strides, in items (the arrays sent are 1-D or 2-D)."""
    if len(shape) == 1:
        return (1,)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


ALIGN = 8
MAX_HALVES_NUMEL = 4096  # int64 readback parts up to this size travel as 32-bit halves
MAX_LAYOUTS = 256  # cached view sets per buffer (block tables widen as sequences grow: new layouts)
_TORCH_DTYPES = {"<i8": torch.int64, "<i4": torch.int32, "<f4": torch.float32, "|b1": torch.bool}


class HostReadback:
    """Register device tensors during a step, then `fetch` them all with one copy (or `start` it and
    `wait` later). On CUDA the copy lands in one of two persistent pinned buffers, taken in turn, so
    a step's copy can be queued while the last one is still being read; `wait` copies the result
    out into fresh host memory (results are views of it that outlive the step: logprob rows), so a
    buffer is free again once its step was waited for, and no step allocates pinned memory (a
    pinned allocation per step, held by those views, was once blamed for a slowdown that turned out
    to be a benchmark's warm-up; its own cost was never measured apart)."""

    def __init__(self) -> None:
        self.num_copies = 0  # device->host copies made, over the worker's life
        self.num_joined = 0  # of them, those whose parts had to be concatenated first
        self._parts: list[torch.Tensor] = []
        self._kinds: list[tuple[torch.dtype, tuple[int, ...], bool, int, int]] = []  # (dtype, shape, halves, part, first word in it)
        self._pinned: list[torch.Tensor] = []  # the two staging buffers (CUDA), grown on demand
        self._copied: list[torch.cuda.Event] = []  # each staging buffer's copy-done event (CUDA)
        self._in_use: list[PendingReadback | None] = [None, None]
        self._turn = 0

    def add(self, tensor: torch.Tensor) -> int:
        """A handle for `fetch`'s result. float32 and 32-bit-representable integers only; integers
        come back as int32. A small int64 part travels as its two 32-bit halves (no conversion
        kernel: a decode step's tokens), a large one narrowed on the device (half the bytes)."""
        halves = tensor.dtype == torch.int64 and tensor.numel() <= MAX_HALVES_NUMEL
        self._kinds.append((tensor.dtype, tuple(tensor.shape), halves, len(self._parts), 0))
        if tensor.dtype == torch.float32 or halves:
            tensor = tensor.contiguous().view(torch.int32)
        elif tensor.dtype != torch.int32:
            tensor = tensor.to(torch.int32)
        self._parts.append(tensor.reshape(-1))
        return len(self._kinds) - 1

    def add_packed(self, buffer: torch.Tensor, views: Sequence[PackedView]) -> list[int]:
        """Handles for `views` of one 1-D int32 device buffer, which travels whole as one part
        (padding between the views included): what an `add` per view would give, without a view,
        a reshape and a step of `one_span`'s walk per view (a greedy decode step's tokens and four
        columns, split on the host every step)."""
        part, first = len(self._parts), len(self._kinds)
        self._parts.append(buffer)
        self._kinds.extend((v.dtype, v.shape, v.dtype == torch.int64, part, v.offset) for v in views)
        return list(range(first, len(self._kinds)))

    def start(self) -> PendingReadback:
        """Queue the one device->host copy of every part added since the last call."""
        parts, kinds = self._parts, self._kinds
        self._parts, self._kinds = [], []
        if not parts:
            return PendingReadback(None, None, [])
        self.num_copies += 1
        span = (parts[0], [0]) if len(parts) == 1 else one_span(parts)
        joined = span is None
        if joined:
            self.num_joined += 1
            device = torch.cat(parts)  # the step's one device->host copy, from here
            starts = list(itertools.accumulate((part.numel() for part in parts[:-1]), initial=0))
        else:
            device, starts = span
        kinds = [(dtype, shape, halves, starts[part] + offset) for dtype, shape, halves, part, offset in kinds]
        if device.device.type != "cuda":  # no device to wait for: the copy is done (a copy: parts may be static buffers')
            return PendingReadback((device if joined else device.clone()).cpu(), None, kinds)
        turn, self._turn = self._turn, 1 - self._turn
        if self._in_use[turn] is not None:
            self._in_use[turn].wait()  # the copy two steps back was never waited for: it leaves the buffer now
        staging = self._staging(turn, device.numel())
        staging.copy_(device, non_blocking=True)
        copied = self._copied[turn]  # free to record again: the step that last used it was waited for
        copied.record()
        pending = self._in_use[turn] = PendingReadback(staging, copied, kinds, release=lambda: self._release(turn, pending))
        return pending

    def fetch(self) -> list[np.ndarray]:
        return self.start().wait()

    def _staging(self, turn: int, numel: int) -> torch.Tensor:
        while len(self._pinned) <= turn:
            self._pinned.append(torch.empty(0, dtype=torch.int32))
            self._copied.append(torch.cuda.Event())
        if self._pinned[turn].numel() < numel:
            self._pinned[turn] = torch.empty(max(numel, 2 * self._pinned[turn].numel()), dtype=torch.int32, pin_memory=True)
        return self._pinned[turn][:numel]

    def _release(self, turn: int, pending: PendingReadback) -> None:
        if self._in_use[turn] is pending:
            self._in_use[turn] = None


MAX_GAP_WORDS = 3  # padding one span still covers between two parts (a packed buffer aligning its columns to 16 bytes)


def one_span(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """1-D int32 parts that lie in order in one storage, back to back or apart by at most
    MAX_GAP_WORDS words of padding: the one 1-D view over all of them (padding included) and each
    part's first word in it (an empty part's: where the next would begin); else None, found out at
    the first part that breaks the run."""
    first = storage = end = None
    total = 0
    starts = []
    for part in parts:
        if not part.numel():
            starts.append(total)
            continue
        if first is None:
            first, storage, end = part, part.untyped_storage().data_ptr(), part.data_ptr()
        gap, rest = divmod(part.data_ptr() - end, part.element_size())
        if rest or not 0 <= gap <= MAX_GAP_WORDS or part.untyped_storage().data_ptr() != storage:
            return None
        starts.append(total + gap)
        end = part.data_ptr() + part.numel() * part.element_size()
        total += gap + part.numel()
    return None if first is None else (first.as_strided((total,), (1,)), starts)


class PackedView(NamedTuple):
    """A view of a 1-D int32 buffer read back whole (`HostReadback.add_packed`)."""

    dtype: torch.dtype  # int32, float32 (as its bit pattern), or int64 (as its pairs of words: values that fit 32 bits)
    shape: tuple[int, ...]
    offset: int  # its first word in the buffer


class PendingReadback:
    """One step's readback, queued: `wait` blocks until it is on the host and splits it (once)."""

    def __init__(
        self,
        host: torch.Tensor | None,
        copied: torch.cuda.Event | None,
        kinds: list[tuple[torch.dtype, tuple[int, ...], bool, int]],  # (dtype, shape, sent as int64 halves, first word)
        release: Callable[[], None] | None = None,  # gives the staging buffer back (CUDA)
    ) -> None:
        self._host, self._copied, self._kinds, self._release = host, copied, kinds, release
        self._out: list[np.ndarray] | None = None

    def wait(self) -> list[np.ndarray]:
        if self._out is not None:
            return self._out
        if self._host is None:
            self._out = []
            return self._out
        host = self._host.numpy()
        if self._copied is not None:  # a staging buffer: copy the step's values out of it, then let it go
            self._copied.synchronize()
            host = host.copy()
            self._release()
        out = []
        for dtype, shape, halves, offset in self._kinds:
            size = math.prod(shape) * (2 if halves else 1)  # math's: np.prod's fixed cost, paid per part, shows
            chunk = host[offset : offset + size]
            if halves:
                chunk = chunk.view(np.int64).astype(np.int32)
            elif dtype == torch.float32:
                chunk = chunk.view(np.float32)
            out.append(chunk.reshape(shape))
        self._out = out
        return out
