"""Pushed weight versions as their pieces arrive: each piece checked by its xxh3-64 on arrival and
written into its tensor's host buffer; a version is handed over only when its commit finds every
tensor it names complete and nothing corrupt or lost on the way.

The host buffers of the last version handed over (once swapped: `recycle`) or refused are kept
for the next push, by size: an RL loop pushes the same shapes again and again, and writing into
memory already mapped (pinned, with CUDA) is several times faster than into fresh pages."""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

from contracts.weights import WeightCommit, WeightPiece, WeightTarget
from services.scheduler.weights.tensors import WeightMismatch

MAX_VERSIONS_IN_PROGRESS = 2  # a newer push makes the oldest unfinished one stale


class IncompleteVersion(ValueError):
    """A pushed version that did not arrive whole: never served."""


class _Version:
    def __init__(self, spare: dict[int, list[torch.Tensor]]) -> None:
        self._spare = spare  # nbytes -> host buffers free to take
        self.buffers: dict[str, torch.Tensor] = {}  # name -> u8 [nbytes], on the host (pinned with CUDA)
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self.received: dict[str, int] = {}  # name -> bytes arrived
        self.error: str | None = None  # the first thing that went wrong

    def add(self, piece: WeightPiece) -> None:
        if self.error is not None:
            return
        if xxhash.xxh3_64_intdigest(piece.data) != piece.xxh3:
            self.error = f"tensor {piece.name!r}: the piece at byte {piece.offset} failed its checksum (corrupted in transit)"
            return
        buffer = self._buffer(piece)
        end = piece.offset + piece.data.nbytes
        if buffer is None or end > buffer.numel():
            self.error = f"tensor {piece.name!r}: a piece does not fit the tensor's declared shape and dtype"
            return
        buffer.numpy()[piece.offset : end] = np.frombuffer(piece.data, dtype=np.uint8)
        self.received[piece.name] += piece.data.nbytes

    def _buffer(self, piece: WeightPiece) -> torch.Tensor | None:
        declared = (tuple(piece.shape), piece.dtype)
        if piece.name not in self.buffers:
            nbytes = math.prod(piece.shape) * torch.empty(0, dtype=getattr(torch, piece.dtype)).element_size()
            spare = self._spare.get(nbytes)
            pinned = torch.cuda.is_available()
            self.buffers[piece.name] = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.shapes[piece.name], self.received[piece.name] = declared, 0
        return self.buffers[piece.name] if self.shapes[piece.name] == declared else None

    def tensors(self, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if self.error is not None:
            raise IncompleteVersion(self.error)
        for name in names:
            if self.received.get(name, -1) != (self.buffers[name].numel() if name in self.buffers else 0):
                raise IncompleteVersion(f"tensor {name!r}: {self.received.get(name, 0)} bytes arrived of "
                                        f"{self.buffers[name].numel() if name in self.buffers else 'its'} (pieces lost in transit)")  # fmt: skip
        if extra := sorted(set(self.buffers) - set(names)):
            raise IncompleteVersion(f"tensor {extra[0]!r} arrived but the commit does not name it")
        return {name: self.buffers[name].view(getattr(torch, self.shapes[name][1])).view(self.shapes[name][0]) for name in names}


class PushedVersions:
    """The versions being pushed to this scheduler, by (target, version)."""

    def __init__(self) -> None:
        self._versions: dict[tuple[WeightTarget, str], _Version] = {}
        self._spare: dict[int, list[torch.Tensor]] = {}  # nbytes -> host buffers of the last version done with
        self._lent: _Version | None = None  # the version `take` handed over, until `recycle`

    def add(self, piece: WeightPiece, missed: int = 0) -> None:
        """`missed`: messages of this sender lost right before this one (the transport's gap count)."""
        key = (piece.target, piece.push_id)
        if key not in self._versions:
            while len(self._versions) >= MAX_VERSIONS_IN_PROGRESS:
                self._versions.pop(next(iter(self._versions)))
            self._versions[key] = _Version(self._spare)
        if missed:
            for version in self._versions.values():
                version.error = version.error or f"{missed} messages of the push were lost in transit"
        self._versions[key].add(piece)

    def take(self, commit: WeightCommit) -> dict[str, torch.Tensor]:
        """The committed version's tensors (name -> host tensor), theirs until `recycle`; raises
        `IncompleteVersion` (its buffers are kept for the next push)."""
        version = self._versions.pop((commit.target, commit.push_id), None)
        if version is None:
            raise IncompleteVersion(f"no piece of push {commit.push_id!r} arrived")
        try:
            tensors = version.tensors(commit.names)
        except IncompleteVersion:
            self._keep(version)
            raise
        self._lent = version
        return tensors

    def recycle(self) -> None:
        """The tensors `take` handed over are copied where they go: their buffers serve the next push."""
        if self._lent is not None:
            self._keep(self._lent)
            self._lent = None

    def drop_spare(self) -> None:
        """Give the kept buffers back (releasing memory)."""
        self._spare.clear()

    def _keep(self, version: _Version) -> None:
        self._spare.clear()  # one version's worth at most
        for buffer in version.buffers.values():
            self._spare.setdefault(buffer.numel(), []).append(buffer)

    def shapes(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


__all__ = ["IncompleteVersion", "PushedVersions", "WeightMismatch"]
