"""Messages that change what a scheduler serves: new weights, pauses, memory release (RL loops).

Two direct subjects per scheduler (`subjects.scheduler_control(id)`, `subjects.scheduler_weights(id)`):

    tokenizer ──request──▶ scheduler_control(id)   one `Control` each, answered by a `ControlReply`
    pusher    ──publish──▶ scheduler_weights(id)   one `WeightManifest` (every tensor's name, shape,
                                                   dtype: the scheduler allocates its buffers while the
                                                   pieces travel), `WeightPiece`s (framed and flow
                                                   controlled by the transport), then one `WeightCommit`
                                                   as a request

A version swaps only when its commit finds every piece it names arrived whole (each piece's
xxh3-64 checked on arrival); anything else is refused and the old weights keep serving.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from contracts.limits import MAX_ARRAY_DIMS, Count, Dim, InstanceId, Reason

MAX_TENSORS = 1 << 20
WeightVersion = Annotated[str, msgspec.Meta(max_length=256)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
# torch dtype names (`str(torch.bfloat16)` without "torch."): what a piece's bytes are
TensorDtype = Annotated[str, msgspec.Meta(pattern=r"^(float32|float16|bfloat16|float64)$")]


class WeightTarget(enum.IntEnum):
    MODEL = 0  # the target model
    DRAFT = 1  # the DSpark drafter


class UpdateFromDisk(msgspec.Struct, frozen=True, gc=False, tag=True, omit_defaults=True):
    """Load `model_path`'s safetensors (same names, shapes) and swap between two steps."""

    model_path: Path
    load_format: Annotated[str, msgspec.Meta(pattern=r"^(auto|safetensors)$")] = "auto"
    weight_version: WeightVersion | None = None  # None: the scheduler counts one up
    abort_all_requests: bool = False  # False: requests in flight finish on the old weights first
    target: WeightTarget = WeightTarget.MODEL


class PauseGeneration(msgspec.Struct, frozen=True, gc=False, tag=True, omit_defaults=True):
    abort: bool = False  # True: end every held request (finish reason abort); False: hold them where they are


class ContinueGeneration(msgspec.Struct, frozen=True, gc=False, tag=True):
    pass


class ReleaseMemory(msgspec.Struct, frozen=True, gc=False, tag=True, omit_defaults=True):
    """Free the KV cache (and with `weights`, the weights' device memory); requests wait until resume."""

    weights: bool = False


class ResumeMemory(msgspec.Struct, frozen=True, gc=False, tag=True):
    pass


Control = UpdateFromDisk | PauseGeneration | ContinueGeneration | ReleaseMemory | ResumeMemory


class ControlReply(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: InstanceId
    ok: bool = True
    error: Reason | None = None  # why not done, naming the first mismatching tensor where there is one
    weight_version: WeightVersion = ""  # what the scheduler serves after the control
    num_aborted: Count = 0
    freed_bytes: int = 0  # ReleaseMemory: measured drop of the scheduler's device (CUDA) or process (CPU) memory
    seconds: float = 0.0


class TensorSpec(msgspec.Struct, frozen=True, gc=False, array_like=True):
    name: TensorName
    dtype: TensorDtype
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_ARRAY_DIMS)]


class WeightManifest(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Sent before a push's first piece: every tensor the pieces will fill. Optional (a push whose
    manifest was lost is staged as its pieces arrive); a piece that disagrees with it (a name it
    does not list, another shape or dtype) makes the version refused."""

    push_id: WeightVersion
    target: WeightTarget
    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(max_length=MAX_TENSORS)]


class WeightPiece(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Bytes [offset, offset + len(data)) of one tensor of one push (row-major, little-endian)."""

    push_id: WeightVersion  # the push's own id (a uuid): pieces of different pushes never mix
    target: WeightTarget
    name: TensorName
    dtype: TensorDtype
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_ARRAY_DIMS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    xxh3: Annotated[int, msgspec.Meta(ge=0)]  # xxh3_64 of `data` (unsigned 64-bit)
    # Last, so a piece is sent as its header and the tensor's own bytes (`scatter.encode_parts`);
    # decoded as a view into the received message (no copy); at most the transport's max_message_bytes
    data: memoryview


class WeightCommit(msgspec.Struct, frozen=True, gc=False, tag=True, omit_defaults=True):
    """Sent (as a request) after a push's last piece: swap if all of `names` arrived whole."""

    push_id: WeightVersion
    names: Annotated[tuple[TensorName, ...], msgspec.Meta(max_length=MAX_TENSORS)]
    weight_version: WeightVersion | None = None  # None: the scheduler counts one up
    target: WeightTarget = WeightTarget.MODEL
    abort_all_requests: bool = False


WeightMessage = WeightManifest | WeightPiece | WeightCommit
