"""The worker's two host<->device crossings per step: one upload, one readback.

`HostUpload` packs a step's host arrays (token ids, positions, slots, tables, sampling
parameters; each in its own dtype) into one persistent byte buffer — pinned on CUDA, so the copy is asynchronous — and sends
it with one non-blocking copy. Before the buffer is written again, `send` waits for the last copy
out of it (a CUDA event): usually already done, since most steps end with the readback, which waits
for every earlier copy on the stream; but a step with nothing to read back (a prefill chunk that
samples nothing) returns before its copy has run, and the next step must not overwrite its inputs.

`HostReadback` collects the step's device results (sampled tokens, accepted counts, drafts,
logprob rows) and brings them all back with one device->host copy: every part is 32 bits wide
(float32 travels as its int32 bit pattern), so they concatenate into one int32 buffer. `start`
only queues that copy (into pinned memory, on CUDA) and `PendingReadback.wait` waits for it, so
the host can queue the next step's work before it waits for this one's results (overlapped
decoding, `SchedulerCore`); `fetch` is the two at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class HostUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array arrives with its own dtype and shape (int64, int32, float32, bool ...)."""
        offsets, total = [], 0
        for array in arrays.values():
            total = -(-total // ALIGN) * ALIGN  # every part starts 8-byte aligned, so it can be viewed as its dtype
            offsets.append(total)
            total += array.nbytes
        if self._copied is not None:
            self._copied.synchronize()  # its copy has left the buffer: safe to overwrite
        if self._buffer.numel() < total:
            self._buffer = torch.empty(max(total, 2 * self._buffer.numel()), dtype=torch.uint8, pin_memory=self._pinned)
        host = self._buffer.numpy()
        for array, offset in zip(arrays.values(), offsets, strict=True):
            host[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        on_device = self._buffer[:total].to(self.device, non_blocking=True)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return {
            name: on_device[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype.str]).view(array.shape)
            for (name, array), offset in zip(arrays.items(), offsets, strict=True)
        }


ALIGN = 8
_TORCH_DTYPES = {"<i8": torch.int64, "<i4": torch.int32, "<f4": torch.float32, "|b1": torch.bool}


class HostReadback:
    """Register device tensors during a step, then `fetch` them all with one copy (or `start` it and
    `wait` later). On CUDA the copy lands in one of two persistent pinned buffers, taken in turn, so
    a step's copy can be queued while the last one is still being read; `wait` copies the result
    out into fresh host memory (results are views of it that outlive the step: logprob rows), so a
    buffer is free again once its step was waited for, and no step allocates pinned memory (a
    pinned allocation per step, held by those views, was suspected of a slowdown that turned out to
    be a benchmark's warm-up: ops/bench/results/gpu_overlap.md, runs 1-4; not measured apart)."""

    def __init__(self) -> None:
        self.num_copies = 0  # device->host copies made, over the worker's life
        self._parts: list[torch.Tensor] = []
        self._kinds: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._pinned: list[torch.Tensor] = []  # the two staging buffers (CUDA), grown on demand
        self._in_use: list[PendingReadback | None] = [None, None]
        self._turn = 0

    def add(self, tensor: torch.Tensor) -> int:
        """A handle for `fetch`'s result. float32 and 32-bit-representable integers only."""
        self._kinds.append((tensor.dtype, tuple(tensor.shape)))
        if tensor.dtype == torch.float32:
            tensor = tensor.contiguous().view(torch.int32)
        elif tensor.dtype != torch.int32:
            tensor = tensor.to(torch.int32)
        self._parts.append(tensor.reshape(-1))
        return len(self._parts) - 1

    def start(self) -> PendingReadback:
        """Queue the one device->host copy of every part added since the last call."""
        parts, kinds = self._parts, self._kinds
        self._parts, self._kinds = [], []
        if not parts:
            return PendingReadback(None, None, kinds)
        self.num_copies += 1
        device = torch.cat(parts)  # the step's one device->host copy, from here
        if device.device.type != "cuda":
            return PendingReadback(device.cpu(), None, kinds)  # no device to wait for: the copy is done
        turn, self._turn = self._turn, 1 - self._turn
        if self._in_use[turn] is not None:
            self._in_use[turn].wait()  # the copy two steps back was never waited for: it leaves the buffer now
        staging = self._staging(turn, device.numel())
        staging.copy_(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        pending = self._in_use[turn] = PendingReadback(staging, copied, kinds, release=lambda: self._release(turn, pending))
        return pending

    def fetch(self) -> list[np.ndarray]:
        return self.start().wait()

    def _staging(self, turn: int, numel: int) -> torch.Tensor:
        while len(self._pinned) <= turn:
            self._pinned.append(torch.empty(0, dtype=torch.int32))
        if self._pinned[turn].numel() < numel:
            self._pinned[turn] = torch.empty(max(numel, 2 * self._pinned[turn].numel()), dtype=torch.int32, pin_memory=True)
        return self._pinned[turn][:numel]

    def _release(self, turn: int, pending: PendingReadback) -> None:
        if self._in_use[turn] is pending:
            self._in_use[turn] = None


class PendingReadback:
    """One step's readback, queued: `wait` blocks until it is on the host and splits it (once)."""

    def __init__(
        self,
        host: torch.Tensor | None,
        copied: torch.cuda.Event | None,
        kinds: list[tuple[torch.dtype, tuple[int, ...]]],
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
        out, offset = [], 0
        for dtype, shape in self._kinds:
            size = int(np.prod(shape, dtype=np.int64))
            chunk = host[offset : offset + size]
            offset += size
            out.append((chunk.view(np.float32) if dtype == torch.float32 else chunk).reshape(shape))
        self._out = out
        return out
