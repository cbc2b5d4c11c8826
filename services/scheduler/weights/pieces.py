"""Pushed weight versions as their pieces arrive: each piece checked by its xxh3-64 on arrival and
written into its tensor's host buffer; a version is handed over only when its commit finds every
tensor it names complete and nothing corrupt or lost on the way.

A push's `WeightManifest` (sent before its pieces) has every host buffer of the version allocated
and its pages touched on a small thread pool while the pieces travel: a piece waits only for its
own tensor's buffer. Without a manifest (lost, or a piece ahead of it) a tensor's buffer is
allocated when its first piece arrives.

The host buffers of the last version handed over (once swapped: `recycle`) or refused are kept
for the next push, by size: an RL loop pushes the same shapes again and again, and writing into
memory already mapped (pinned, with CUDA) is several times faster than into fresh pages."""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from contracts.weights import WeightCommit, WeightManifest, WeightPiece, WeightTarget
from services.scheduler.weights.tensors import WeightMismatch

MAX_VERSIONS_IN_PROGRESS = 2  # a newer push makes the oldest unfinished one stale
ALLOCATION_THREADS = 4  # page faults (or pinning) of fresh buffers in parallel, ahead of the pieces
PAGE_BYTES = 4096

TensorShape = tuple[tuple[int, ...], str]  # (shape, dtype name)


class IncompleteVersion(ValueError):
    """A pushed version that did not arrive whole: never served."""


def _allocate(nbytes: int) -> torch.Tensor:
    """A host buffer (pinned with CUDA) with every page mapped: writing a piece into it faults nothing."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    buffer.numpy()[::PAGE_BYTES] = 0
    return buffer


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


class _Version:
    def __init__(self, spare: dict[int, list[torch.Tensor]]) -> None:
        self._spare = spare  # nbytes -> host buffers free to take
        self.buffers: dict[str, torch.Tensor] = {}  # name -> u8 [nbytes], on the host (pinned with CUDA)
        self.allocating: dict[str, Future[torch.Tensor]] = {}  # name -> its buffer, allocated from the manifest
        self.shapes: dict[str, TensorShape] = {}  # name -> as the manifest or the tensor's first piece declared it
        self.received: dict[str, int] = {}  # name -> bytes arrived
        self.manifest: WeightManifest | None = None
        self.error: str | None = None  # the first thing that went wrong

    def plan(self, manifest: WeightManifest, pool: ThreadPoolExecutor) -> None:
        """Take a spare buffer or start allocating one for every tensor of `manifest` no piece named yet."""
        self.manifest = manifest
        if unlisted := sorted(set(self.shapes) - {spec.name for spec in manifest.tensors}):
            self.error = self.error or f"tensor {unlisted[0]!r}: a piece arrived for a tensor the push's manifest does not list"
        for spec in manifest.tensors:
            declared = (tuple(spec.shape), spec.dtype)
            if spec.name in self.shapes:
                if self.shapes[spec.name] != declared:
                    self.error = self.error or self._disagrees(spec.name, self.shapes[spec.name], declared)
                continue
            nbytes = _nbytes(*declared)
            spare = self._spare.get(nbytes)
            self.shapes[spec.name], self.received[spec.name] = declared, 0
            if spare:
                self.buffers[spec.name] = spare.pop()
            else:
                self.allocating[spec.name] = pool.submit(_allocate, nbytes)

    def add(self, piece: WeightPiece) -> None:
        if self.error is not None:
            return
        if xxhash.xxh3_64_intdigest(piece.data) != piece.xxh3:
            self.error = f"tensor {piece.name!r}: the piece at byte {piece.offset} failed its checksum (corrupted in transit)"
            return
        buffer = self._buffer(piece)
        end = piece.offset + piece.data.nbytes
        if buffer is None:
            return
        if end > buffer.numel():
            self.error = f"tensor {piece.name!r}: a piece does not fit the tensor's declared shape and dtype"
            return
        buffer.numpy()[piece.offset : end] = np.frombuffer(piece.data, dtype=np.uint8)
        self.received[piece.name] += piece.data.nbytes

    def _buffer(self, piece: WeightPiece) -> torch.Tensor | None:
        """The piece's tensor's buffer (waiting for it if the manifest's allocation is under way);
        None, with `error` set, if the piece disagrees with the manifest or the tensor's first piece."""
        declared = (tuple(piece.shape), piece.dtype)
        if piece.name not in self.shapes:
            if self.manifest is not None:
                self.error = f"tensor {piece.name!r}: a piece arrived for a tensor the push's manifest does not list"
                return None
            spare = self._spare.get(nbytes := _nbytes(*declared))
            self.buffers[piece.name] = spare.pop() if spare else _allocate(nbytes)
            self.shapes[piece.name], self.received[piece.name] = declared, 0
        if self.shapes[piece.name] != declared:
            self.error = self._disagrees(piece.name, self.shapes[piece.name], declared)
            return None
        if piece.name in self.allocating:
            self.buffers[piece.name] = self.allocating.pop(piece.name).result()
        return self.buffers[piece.name]

    def _disagrees(self, name: str, first: TensorShape, then: TensorShape) -> str:
        source = "the push's manifest" if self.manifest is not None else "its first piece"
        return (f"tensor {name!r}: a piece declares shape {list(then[0])} {then[1]} but {source} "
                f"declared {list(first[0])} {first[1]}")  # fmt: skip

    def settle(self) -> dict[str, torch.Tensor]:
        """Every buffer, once allocated (an allocation not started yet is cancelled)."""
        for name, future in self.allocating.items():
            if not future.cancel():
                self.buffers[name] = future.result()
        self.allocating.clear()
        return self.buffers

    def tensors(self, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if self.error is not None:
            raise IncompleteVersion(self.error)
        buffers = self.settle()
        for name in names:
            if self.received.get(name, -1) != (buffers[name].numel() if name in buffers else 0):
                raise IncompleteVersion(f"tensor {name!r}: {self.received.get(name, 0)} bytes arrived of "
                                        f"{buffers[name].numel() if name in buffers else 'its'} (pieces lost in transit)")  # fmt: skip
        if extra := sorted(set(self.shapes) - set(names)):
            raise IncompleteVersion(f"tensor {extra[0]!r} arrived but the commit does not name it")
        return {name: buffers[name].view(getattr(torch, self.shapes[name][1])).view(self.shapes[name][0]) for name in names}


class PushedVersions:
    """The versions being pushed to this scheduler, by (target, version)."""

    def __init__(self) -> None:
        self._versions: dict[tuple[WeightTarget, str], _Version] = {}
        self._spare: dict[int, list[torch.Tensor]] = {}  # nbytes -> host buffers of the last version done with
        self._lent: _Version | None = None  # the version `take` handed over, until `recycle`
        self._pool: ThreadPoolExecutor | None = None  # allocates the buffers a manifest lists

    def plan(self, manifest: WeightManifest) -> None:
        """Start allocating the buffers of every tensor `manifest` lists; returns at once."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(ALLOCATION_THREADS, thread_name_prefix="weights-alloc")
        self._version(manifest.target, manifest.push_id).plan(manifest, self._pool)

    def add(self, piece: WeightPiece, missed: int = 0) -> None:
        """`missed`: messages of this sender lost right before this one (the transport's gap count)."""
        version = self._version(piece.target, piece.push_id)
        if missed:
            for each in self._versions.values():
                each.error = each.error or f"{missed} messages of the push were lost in transit"
        version.add(piece)

    def _version(self, target: WeightTarget, push_id: str) -> _Version:
        key = (target, push_id)
        if key not in self._versions:
            while len(self._versions) >= MAX_VERSIONS_IN_PROGRESS:
                stale = self._versions.pop(next(iter(self._versions)))
                for allocation in stale.allocating.values():
                    allocation.cancel()
            self._versions[key] = _Version(self._spare)
        return self._versions[key]

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
        for buffer in version.settle().values():
            self._spare.setdefault(buffer.numel(), []).append(buffer)

    def shapes(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorShape]:
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


__all__ = ["IncompleteVersion", "PushedVersions", "WeightMismatch"]
