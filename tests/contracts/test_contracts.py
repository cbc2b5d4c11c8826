"""Wire contracts: MessagePack round trips of every type, zero-copy arrays, schema evolution,
versioned subjects."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import msgspec
import numpy as np
import pytest

import contracts
from contracts import subjects
from contracts.arrays import NDArray
from contracts.control import Heartbeat
from contracts.logprobs import LogprobColumns
from contracts.weights import (
    ContinueGeneration,
    ControlReply,
    PauseGeneration,
    ReleaseMemory,
    ResumeMemory,
    UpdateFromDisk,
    TensorSpec,
    WeightCommit,
    WeightManifest,
    WeightPiece,
    WeightTarget,
)
from contracts.detokenizer import (
    DetokenizeParams,
    DetokenizerRegistration,
    DetokenizerRegistrationReply,
    Finish,
    FinishType,
    TokenBatch,
)
from contracts.scheduler import (
    Grammar,
    GrammarKind,
    AbortRequest,
    ForkedChoice,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
    SchedulerClaim,
    SchedulerClaimReply,
    SchedulerInfo,
    SchedulerPing,
)
from contracts.scheduler import FlushCache
from contracts.tokenizer import PrefixSummary, TextBatch
from services.common.arrays import from_wire, to_wire


def i32(*values: int) -> NDArray:
    return to_wire(np.array(values, dtype=np.int32))


def f32(rows: int, cols: int) -> NDArray:
    return to_wire(np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) - 0.5)


def flat32(*values: float) -> NDArray:
    return to_wire(np.array(values, dtype=np.float32))


COLUMNS = LogprobColumns(  # the output rows of three requests: b asked for none, c for top-2 and one id
    rows=i32(2, 0, 1), token=flat32(-0.5, np.nan, -1.0),
    top_k=i32(0, 0, 2), top_values=flat32(-1.0, -2.0), top_ids=i32(12, 3),
    num_ids=i32(0, 0, 1), ids=flat32(-7.0),
)
PROMPT = LogprobColumns(rows=i32(0, 2, 0), token=flat32(np.nan, -3.0), start=i32(0, 4, 0))  # b's prompt rows, from position 4
FLAT = LogprobColumns(rows=i32(3, 0, 0), top_k=i32(2, 0, 0), top_values=flat32(-1, -2, -3, -4, -5, -6), top_ids=i32(1, 2, 3, 4, 5, 6),
                      start=i32(1, 0, 0))  # a's flat prompt arrays: 3 rows after a null prefix of 1 (PRODUCT §5)

SAMPLES: list[msgspec.Struct] = [
    i32(1, 2, 3),
    Heartbeat("scheduler", "abc", alive=False, num_running=3, reason="shutdown"),
    Finish(FinishType.STOP, matched="\n\n"),
    Finish(FinishType.ABORT, message="scheduler died"),
    DetokenizeParams(stop=("</s>", "\n"), skip_special_tokens=False, no_stop_trim=True),
    DetokenizerRegistration("rid-1", "tok-1", DetokenizeParams(stop=("x",))),
    DetokenizerRegistrationReply("detok-1"),
    TokenBatch(
        scheduler_id="s",
        step=7,
        rids=["a", "b", "c"],
        num_new_tokens=i32(2, 0, 1),
        new_token_ids=i32(10, 11, 12),
        prompt_tokens=i32(5, 6, 7),
        finish=[None, Finish(FinishType.LENGTH), None],
        spec_verify_ct=i32(1, 2, 3),
        cached_tokens=i32(0, 16, 0),
    ),
    TokenBatch(  # every kind of logprob rows as the batch's columns
        scheduler_id="s",
        step=8,
        rids=["a", "b", "c"],
        num_new_tokens=i32(2, 0, 1),
        new_token_ids=i32(10, 11, 12),
        prompt_tokens=i32(5, 6, 7),
        finish=[None, None, None],
        output_logprobs=COLUMNS,
        prompt_logprobs=PROMPT,
        prompt_top_flat=FLAT,
    ),
    COLUMNS,
    FLAT,
    SamplingParams(max_new_tokens=16, temperature=0.0, top_k=5, seed=42, stop_token_ids=(2, 3), ignore_eos=True),
    Grammar(GrammarKind.REGEX, r"\d+", prefix="<n>", suffix="</n>"),
    SamplingParams(grammar=Grammar(GrammarKind.JSON_OBJECT)),
    LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=(5, 6)),
    SchedulerClaim("rid-1", 32768),
    FlushCache(12.5),
    PrefixSummary("s", -3, 16, to_wire(np.asarray([1, 2**32 - 1], "<u4")), 5, 64),
    SchedulerClaim("rid-1", 12, detokenizer_id="d", choices=(ForkedChoice("rid-2", "d2", seed=-5), ForkedChoice("rid-3", "d"))),
    SchedulerClaimReply("s", accepted=False, error="prompt too long"),
    SchedulerClaimReply("s", forks=True),
    GenerateRequest("rid-1", i32(1, 2), "d", choices=(ForkedChoice("rid-2", "d2", seed=7),)),
    ForkedChoice("rid-2", "d2", seed=2**63 - 1),
    GenerateRequest("rid-1", i32(1, 2, 3), "detok-1", SamplingParams(temperature=0.0), LogprobParams(True), True),
    AbortRequest("rid-1", reason="stop"),
    SchedulerPing(sent_at=1.5),
    SchedulerInfo("s", "sparkwire-tiny", 32768, 2048, speculative_algorithm="dspark", num_running=2),
    TextBatch(
        detokenizer_id="d",
        scheduler_id="s",
        rids=["a", "b"],
        text_deltas=["hé", ""],
        num_new_tokens=i32(1, 2),
        new_token_ids=i32(10, 11, 12),
        prompt_tokens=i32(3, 4),
        finish=[Finish(FinishType.STOP, matched=2), None],
        spec_verify_ct=None,
        output_logprobs=LogprobColumns(rows=i32(0, 2), token=flat32(-0.5, -0.25)),
        weight_version="step-3",
    ),
    UpdateFromDisk("/ckpt/step-3", weight_version="step-3", abort_all_requests=True, target=WeightTarget.DRAFT),
    PauseGeneration(abort=True),
    ContinueGeneration(),
    ReleaseMemory(weights=True),
    ResumeMemory(),
    ControlReply("s", ok=False, error="tensor 'x' has shape [2]", weight_version="3", num_aborted=1, freed_bytes=5, seconds=0.5),
    TensorSpec("model.embed_tokens.weight", "bfloat16", (151936, 4096)),
    WeightManifest("push-1", WeightTarget.MODEL, (TensorSpec("model.norm.weight", "bfloat16", (2,)),
                                                  TensorSpec("lm_head.weight", "float32", (3, 2)))),  # fmt: skip
    WeightPiece("push-1", WeightTarget.MODEL, "model.norm.weight", "bfloat16", (2,), 0, 2**64 - 1, memoryview(b"\x00\x01\x02\x03")),
    WeightCommit("push-1", ("model.norm.weight",), "step-4", abort_all_requests=True),
]


def contract_types() -> set[type]:
    found = set()
    for info in pkgutil.iter_modules(contracts.__path__):
        module = importlib.import_module(f"contracts.{info.name}")
        found |= {obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, msgspec.Struct)
                  and obj.__module__ == module.__name__}  # fmt: skip
    return found


def test_every_contract_type_has_a_round_trip_sample():
    assert contract_types() <= {type(sample) for sample in SAMPLES}


def assert_same(a: object, b: object) -> None:
    """Struct equality, with NDArray compared by dtype, shape and values (NaN equal to NaN)."""
    if isinstance(a, NDArray):
        assert isinstance(b, NDArray) and (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(from_wire(a), from_wire(b))
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b)
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_msgpack_round_trip(sample):
    decoded = msgspec.msgpack.Decoder(type(sample)).decode(msgspec.msgpack.encode(sample))
    assert_same(sample, decoded)


def test_round_trip_keeps_none_entries_in_lists():
    batch = next(s for s in SAMPLES if isinstance(s, TokenBatch))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=TokenBatch)
    assert decoded.finish[0] is None and decoded.finish[1] == Finish(FinishType.LENGTH) and decoded.finish[2] is None


def test_ndarray_decode_is_zero_copy_over_the_message_buffer():
    ids = np.arange(1000, dtype=np.int32)
    buffer = msgspec.msgpack.encode(GenerateRequest("rid", to_wire(ids), "d"))
    decoded = msgspec.msgpack.decode(buffer, type=GenerateRequest)
    array = np.frombuffer(decoded.input_ids.data, dtype=np.dtype(decoded.input_ids.dtype))
    assert np.shares_memory(array, np.frombuffer(buffer, dtype=np.uint8))
    np.testing.assert_array_equal(from_wire(decoded.input_ids), ids)
    assert not array.flags.writeable


def test_ndarray_bytes_are_little_endian_whatever_the_input_order():
    big = np.array([1, 258], dtype=">i4")
    wire = to_wire(big)
    assert wire.dtype == "<i4" and bytes(wire.data) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_to_wire_views_contiguous_little_endian_arrays_and_copies_the_rest():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = to_wire(rows[1:])  # contiguous rows: the NDArray's bytes are the array's
    assert np.shares_memory(np.frombuffer(view.data, np.uint8), rows)
    assert view.dtype == "<f4" and view.shape == (2, 4)
    columns = to_wire(rows[:, :2])  # strided: copied into row-major order
    np.testing.assert_array_equal(from_wire(columns), rows[:, :2])
    empty = to_wire(np.zeros((0, 20), np.int32))
    assert empty.shape == (0, 20) and from_wire(empty).shape == (0, 20)
    scalar = to_wire(np.array(2.5, np.float64))
    assert scalar.dtype == "<f8" and from_wire(scalar) == 2.5


# Schema evolution: the "old" structs are what a reader built before the appended fields had.
class OldTokenBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: str
    step: int
    rids: list[str]
    num_new_tokens: NDArray
    new_token_ids: NDArray
    prompt_tokens: NDArray
    finish: list[Finish | None]


class OldSchedulerInfo(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: str
    model_name: str
    max_model_len: int
    vocab_size: int


class OldFinish(msgspec.Struct, frozen=True, gc=False, array_like=True):
    type: FinishType


def test_old_reader_decodes_a_new_message():
    new = [s for s in SAMPLES if isinstance(s, TokenBatch)][-1]
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldTokenBatch)
    assert (old.scheduler_id, old.step, old.rids) == (new.scheduler_id, new.step, new.rids)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Finish(FinishType.STOP, 7)), type=OldFinish).type == FinishType.STOP


def test_new_reader_decodes_an_old_message_with_defaults():
    old = OldSchedulerInfo("s", "m", 128, 2048)
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=SchedulerInfo)
    assert new == SchedulerInfo("s", "m", 128, 2048)
    assert (new.speculative_algorithm, new.num_running) == ("none", 0)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(OldTokenBatch("s", 1, [], i32(), i32(), i32(), [])), type=TokenBatch)
    assert batch.output_logprobs is None and batch.prompt_logprobs is None and batch.spec_verify_ct is None
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(OldFinish(FinishType.LENGTH)), type=Finish) == Finish(FinishType.LENGTH)


class OldGenerateRequest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    rid: str
    input_ids: NDArray
    detokenizer_id: str
    sampling: SamplingParams = SamplingParams()
    logprobs: LogprobParams = LogprobParams()
    stream: bool = False


class OldSchedulerClaim(msgspec.Struct, frozen=True, gc=False):
    rid: str
    num_prompt_tokens: int
    force: bool = False
    detokenizer_id: str | None = None


class OldSchedulerClaimReply(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: str
    accepted: bool = True
    error: str | None = None
    busy: bool = False


def test_forked_choices_evolve_the_schema():
    """An old scheduler reads choice 0 of a forked request and says nothing of `forks` (the
    tokenizer then claims the other choices on their own); old messages read as one choice."""
    forked = GenerateRequest("rid-1", i32(1, 2), "d", choices=(ForkedChoice("rid-2", "d2", seed=7),))
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(forked), type=OldGenerateRequest)
    assert (old.rid, old.detokenizer_id) == ("rid-1", "d")
    reply = msgspec.msgpack.decode(msgspec.msgpack.encode(OldSchedulerClaimReply("s")), type=SchedulerClaimReply)
    assert reply.accepted and not reply.forks
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(OldGenerateRequest("r", i32(1), "d")), type=GenerateRequest)
    assert new.choices == ()
    claim = SchedulerClaim("r", 3, choices=(ForkedChoice("r2", "d"),))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(claim), type=OldSchedulerClaim) == OldSchedulerClaim("r", 3)


def test_unset_optional_fields_encode_as_if_they_did_not_exist():
    """PRODUCT §5: a batch with no opted-in request encodes exactly as without the fields."""
    full = [s for s in SAMPLES if isinstance(s, TokenBatch)][-1]
    bare = TokenBatch(full.scheduler_id, full.step, full.rids, full.num_new_tokens, full.new_token_ids,
                      full.prompt_tokens, full.finish)  # fmt: skip
    old = OldTokenBatch(full.scheduler_id, full.step, full.rids, full.num_new_tokens, full.new_token_ids,
                        full.prompt_tokens, full.finish)  # fmt: skip
    assert msgspec.msgpack.encode(bare) == msgspec.msgpack.encode(old)
    assert msgspec.msgpack.encode(LogprobColumns(i32())) == msgspec.msgpack.encode({"rows": i32()})


def all_subjects() -> list[str]:
    constants = [value for name, value in vars(subjects).items() if name.isupper() and isinstance(value, str)
                 and name not in ("VERSION", "PREFIX") and not name.endswith("_QUEUE")]  # fmt: skip
    functions = [obj("abc123") for obj in vars(subjects).values()
                 if inspect.isfunction(obj) and obj.__module__ == subjects.__name__]  # fmt: skip
    return constants + functions


def test_every_subject_is_versioned():
    found = all_subjects()
    assert len(found) >= 10
    assert all(subject.startswith(f"sparkwire.{subjects.VERSION}.") for subject in found), found


def test_direct_subjects_embed_the_instance_id():
    for make in (subjects.scheduler_generate, subjects.detokenizer_tokens, subjects.tokenizer_outputs):
        assert ".abc123." in make("abc123")
        assert make("a") != make("b")


def test_a_prefix_summary_or_token_batch_of_the_wrong_shape_is_rejected():
    with pytest.raises(ValueError):
        PrefixSummary("s", 0, 16, i32(1, 2), 0, 1)  # int32, not u4
    with pytest.raises(ValueError):
        TokenBatch(scheduler_id="s", step=1, rids=["a"], num_new_tokens=i32(0), new_token_ids=i32(), prompt_tokens=i32(1),
                   finish=[None], cached_tokens=i32(1, 2))  # fmt: skip
