"""A request as the core takes it, and what the core returns per step. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import numpy as np

from contracts.detokenizer import Finish
from contracts.scheduler import ForkedChoice, GenerateRequest, LogprobParams, SamplingParams
from services.common.arrays import from_wire


@dataclass(frozen=True)
class SchedulerRequest:
    """A request as the core takes it: the decoded `GenerateRequest`, prompt ids owned (copied)."""

    rid: str
    prompt_ids: np.ndarray  # int32 [P]
    detokenizer_id: str
    sampling: SamplingParams = SamplingParams()
    logprobs: LogprobParams = LogprobParams()
    choices: tuple[ForkedChoice, ...] = ()  # choices 1..n-1 of an n > 1 call: forked after the prefill

    @classmethod
    def from_generate(cls, request: GenerateRequest) -> SchedulerRequest:
        prompt = np.array(from_wire(request.input_ids), dtype=np.int32)  # copy: frees the message buffer
        return cls(request.rid, prompt, request.detokenizer_id, request.sampling, request.logprobs, request.choices)

    def choice(self, choice: ForkedChoice) -> SchedulerRequest:
        """One forked choice as a request of its own: this prompt and these parameters, its rid and seed."""
        sampling = msgspec.structs.replace(self.sampling, seed=choice.seed)
        return SchedulerRequest(choice.rid, self.prompt_ids, choice.detokenizer_id, sampling, self.logprobs)


Array = TypeVar("Array")  # np.ndarray on the host; torch.Tensor on the device, before the step's readback


class RowLogprobs(msgspec.Struct, Generic[Array], frozen=True):
    """Logprobs of n rows: the target token's, the top-k (sorted, ties by id), the requested ids'.
    One layout on both sides of the readback: the worker builds `RowLogprobs[torch.Tensor]` for
    every query of a step at once, the readback makes them the step's host columns, and each
    request gets its rows as a `RowSpan` of them (or, cut to its own widths, rows of its own)."""

    token: Array  # f32 [n]
    top_values: Array  # f32 [n, k]
    top_ids: Array  # i32 [n, k]
    ids: Array  # f32 [n, m]

    @classmethod
    def of(cls, token: np.ndarray, top_values: np.ndarray | None = None, top_ids: np.ndarray | None = None,
           ids: np.ndarray | None = None) -> RowLogprobs:  # fmt: skip
        """Host rows with the columns not given empty (k = 0, m = 0)."""
        n = len(token)
        return cls(
            token,
            np.zeros((n, 0), np.float32) if top_values is None else top_values,
            np.zeros((n, 0), np.int32) if top_ids is None else top_ids,
            np.zeros((n, 0), np.float32) if ids is None else ids,
        )

    @property
    def num_rows(self) -> int:
        return len(self.token)

    @property
    def k(self) -> int:
        return self.top_values.shape[1]

    @property
    def m(self) -> int:
        return self.ids.shape[1]

    def columns(self) -> tuple[Array, Array, Array, Array]:
        """In field order: what the readback carries, and what `RowLogprobs(*columns)` rebuilds."""
        return self.token, self.top_values, self.top_ids, self.ids

    def head(self, n: int) -> RowLogprobs:
        if n >= len(self.token):
            return self
        return RowLogprobs(self.token[:n], self.top_values[:n], self.top_ids[:n], self.ids[:n])

    def with_null_row(self) -> RowLogprobs:
        """Prepend the null entry of the first returned prompt position: NaN values, -1 ids."""
        k, m = self.top_values.shape[1], self.ids.shape[1]
        return RowLogprobs(
            token=np.concatenate([np.full(1, np.nan, np.float32), self.token]),
            top_values=np.concatenate([np.full((1, k), np.nan, np.float32), self.top_values]),
            top_ids=np.concatenate([np.full((1, k), -1, np.int32), self.top_ids]),
            ids=np.concatenate([np.full((1, m), np.nan, np.float32), self.ids]),
        )


class _SpanColumn:
    """A `RowSpan`'s column of the name it is bound to: the source's, cut to the span's rows (a
    view, made when read)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, span: RowSpan | None, owner: type | None = None):
        if span is None:
            return self  # read on the class
        return getattr(span.source, self.name)[span.start : span.start + span.count]


class RowSpan(msgspec.Struct, frozen=True, gc=False):
    """`count` rows of a step's host columns from row `start`, read as `RowLogprobs` reads (each
    column a view, made when read). What each request of a step gets where it asked for the
    columns' widths (`split_logprobs`): one small object instead of four views a request a step,
    and `wire` sends a batch's rows as those columns, or one gather of them, without reading any."""

    source: RowLogprobs[np.ndarray]
    start: int
    count: int

    token = _SpanColumn()  # f32 [count]
    top_values = _SpanColumn()  # f32 [count, k]
    top_ids = _SpanColumn()  # i32 [count, k]
    ids = _SpanColumn()  # f32 [count, m]

    @property
    def num_rows(self) -> int:
        return self.count

    @property
    def k(self) -> int:
        return self.source.top_values.shape[1]

    @property
    def m(self) -> int:
        return self.source.ids.shape[1]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.token, self.top_values, self.top_ids, self.ids

    def head(self, n: int) -> RowSpan:
        return self if n >= self.count else RowSpan(self.source, self.start, n)

    def with_null_row(self) -> RowLogprobs:
        return self.rows().with_null_row()

    def rows(self) -> RowLogprobs:
        """As rows of their own (views)."""
        return RowLogprobs(self.token, self.top_values, self.top_ids, self.ids)


HostRows = RowLogprobs | RowSpan  # a request's rows of one step, on the host


def are_all_rows(rows: np.ndarray, num_source_rows: int | None) -> bool:
    """rows == 0, 1, ..., num_source_rows - 1: a source's every row, in order (nothing to gather)."""
    return rows.size == num_source_rows and bool((rows == np.arange(rows.size)).all())


class LogprobEntries(msgspec.Struct):
    """One request's new logprob entries of one step; the prompt fields' names follow
    `RequestLogprobs`, and so do the output ones, read from `output` (the step's output rows, kept
    as they came: a `RowSpan` is read only where the wire needs a request's own arrays). (A mutable
    `msgspec.Struct`: one is made per request per step, ~10x faster than a dataclass.)"""

    output: HostRows | None = None  # the new output tokens' rows: their top-k width 0 / ids width 0 when not asked
    input_start: int | None = None
    input_token_logprobs: np.ndarray | None = None  # f32 [p]
    input_top_logprobs: np.ndarray | None = None  # f32 [p, k]
    input_top_ids: np.ndarray | None = None  # i32 [p, k]
    input_ids_logprobs: np.ndarray | None = None  # f32 [p, m]
    input_top_logprobs_flat: np.ndarray | None = None  # f32 [rows, k]
    input_top_ids_flat: np.ndarray | None = None  # i32 [rows, k]
    input_top_null_prefix: int | None = None

    @property
    def output_token_logprobs(self) -> np.ndarray | None:  # f32 [n]
        return None if self.output is None else self.output.token

    @property
    def output_top_logprobs(self) -> np.ndarray | None:  # f32 [n, k]
        return None if self.output is None or self.output.k == 0 else self.output.top_values

    @property
    def output_top_ids(self) -> np.ndarray | None:  # i32 [n, k]
        return None if self.output is None or self.output.k == 0 else self.output.top_ids

    @property
    def output_ids_logprobs(self) -> np.ndarray | None:  # f32 [n, m]
        return None if self.output is None or self.output.m == 0 else self.output.ids

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__struct_fields__)

    def has_prompt_entries(self) -> bool:
        # Spelled out, not a loop over PROMPT_FIELDS: asked per request per step (wire), where a getattr loop costs ~3x.
        return not (self.input_start is None and self.input_token_logprobs is None and self.input_top_logprobs is None
                    and self.input_top_ids is None and self.input_ids_logprobs is None and self.input_top_logprobs_flat is None
                    and self.input_top_ids_flat is None and self.input_top_null_prefix is None)  # fmt: skip

    def prompt_part(self) -> LogprobEntries:
        """Only the prompt (input) entries."""
        return LogprobEntries(**{name: getattr(self, name) for name in PROMPT_FIELDS})

    def fields(self) -> dict[str, object]:
        """Every entry that is set, by its `RequestLogprobs` field name (output arrays read from `output`)."""
        fields = {name: getattr(self, name) for name in PROMPT_FIELDS if getattr(self, name) is not None}
        if self.output is not None:
            fields |= {name: value for name in OUTPUT_FIELDS if (value := getattr(self, name)) is not None}
        return fields

    @staticmethod
    def joined_prompt(parts: list[LogprobEntries]) -> LogprobEntries:
        """The prompt entries of several steps as one step's: arrays concatenated in order, the
        first start, the flat arrays (sent once, so in one part)."""
        joined = LogprobEntries()
        for name in PROMPT_ARRAYS:
            arrays = [getattr(part, name) for part in parts if getattr(part, name) is not None]
            setattr(joined, name, np.concatenate(arrays) if arrays else None)
        for name in ("input_start", "input_top_logprobs_flat", "input_top_ids_flat", "input_top_null_prefix"):
            setattr(joined, name, next((getattr(p, name) for p in parts if getattr(p, name) is not None), None))
        return joined


OUTPUT_FIELDS = ("output_token_logprobs", "output_top_logprobs", "output_top_ids", "output_ids_logprobs")
PROMPT_FIELDS = tuple(name for name in LogprobEntries.__struct_fields__ if name.startswith("input_"))
PROMPT_ARRAYS = ("input_token_logprobs", "input_top_logprobs", "input_top_ids", "input_ids_logprobs")  # joined step by step


class RequestOutput(msgspec.Struct, frozen=True):
    rid: str
    detokenizer_id: str
    new_token_ids: list[int]
    prompt_tokens: int
    finish: Finish | None
    logprobs: LogprobEntries | None  # None when the request did not ask for logprobs
    spec_verify_ct: int | None = None  # verify passes so far; None without speculative decoding


def has_penalties(params: SamplingParams) -> bool:
    """Whether this request's logits depend on the tokens it has seen (rather than only on its
    parameters): `logits_processing`'s penalties. Here, torch-free, so that `Sequence` can cache it."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def is_identity(params: SamplingParams) -> bool:
    """True when none of `logits_processing`'s processors changes this request's logits."""
    return not params.logit_bias and params.min_new_tokens == 0 and not has_penalties(params)
