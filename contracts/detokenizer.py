"""Messages the detokenizer receives: registrations from tokenizers, token batches from schedulers."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from contracts.arrays import NDArray
from contracts.logprobs import LogprobColumns, int32s
from contracts.limits import (
    MAX_STOP_STRINGS,
    Count,
    InstanceId,
    Reason,
    Rid,
    StopString,
    TokenId,
)


class FinishType(enum.IntEnum):
    STOP = 0  # eos, a stop token id or a stop string
    LENGTH = 1  # max_new_tokens or max_model_len
    ABORT = 2  # client gone, scheduler error, shutdown


class Finish(msgspec.Struct, frozen=True, gc=False, array_like=True):
    type: FinishType
    matched: TokenId | StopString | None = None  # the stop token id or stop string that ended the request
    message: Reason | None = None  # for ABORT: why, in words a user can act on


class DetokenizeParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    stop: Annotated[tuple[StopString, ...], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    min_tokens: Count = 0  # vLLM: a stop string ending in the first min_tokens output tokens is no stop


class DetokenizerRegistration(msgspec.Struct, frozen=True, gc=False):
    """Request (queue group): one detokenizer takes ownership of `rid` before any token exists."""

    rid: Rid
    tokenizer_id: InstanceId  # outputs go to `subjects.tokenizer_outputs(tokenizer_id)`
    params: DetokenizeParams


class DetokenizerRegistrationReply(msgspec.Struct, frozen=True, gc=False):
    detokenizer_id: InstanceId


class TokenBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One scheduler step's output for one detokenizer, columnar over the R requests in it.

    Requests are ragged: request i owns `new_token_ids[offsets[i]:offsets[i+1]]` where
    `offsets = [0, *cumsum(num_new_tokens)]` (0 new tokens is valid: a prefill chunk). Logprob
    rows new in the step travel as the batch's columns (`LogprobColumns`), each absent when no
    request of the batch has any: `output_logprobs` (request i's rows: its new tokens', or none),
    `prompt_logprobs` (their first prompt position in `start`), `prompt_top_flat` (PRODUCT §5's
    flat prompt top-k arrays, sent once, when the prompt is in; `start`: the null prefix).
    """

    scheduler_id: InstanceId
    step: Count
    rids: list[Rid]  # [R]
    num_new_tokens: NDArray  # i32 [R]
    new_token_ids: NDArray  # i32 [sum(num_new_tokens)]
    prompt_tokens: NDArray  # i32 [R]
    finish: list[Finish | None]  # [R]; None while running
    spec_verify_ct: NDArray | None = None  # i32 [R], cumulative verify passes (speculative only)
    output_logprobs: LogprobColumns | None = None
    prompt_logprobs: LogprobColumns | None = None
    prompt_top_flat: LogprobColumns | None = None
    cached_tokens: NDArray | None = None  # i32 [R], prompt tokens found in KV (prefix cache); absent: none
    weight_version: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # appended: the weights of the step

    def __post_init__(self) -> None:
        counts = check_columns(self.rids, self.num_new_tokens, self.new_token_ids, self.prompt_tokens, self.finish,
                               self.spec_verify_ct)  # fmt: skip
        check_logprobs(counts, self.output_logprobs, self.prompt_logprobs, self.prompt_top_flat)
        if self.cached_tokens is not None and not self.cached_tokens.is_vector("<i4", len(self.rids)):
            raise ValueError(f"cached_tokens must be an int32 vector of {len(self.rids)} entries")


def check_columns(
    rids: list[str],
    num_new_tokens: NDArray,
    new_token_ids: NDArray,
    prompt_tokens: NDArray,
    finish: list[Finish | None],
    spec_verify_ct: NDArray | None,
) -> list[int]:
    """Invariant of the ragged columnar batches (`TokenBatch`, `TextBatch`): every column has R
    entries, and the counts are >= 0 and add up to the ids. Returns the counts (`num_new_tokens`);
    raises ValueError (on decode: the message is rejected)."""
    count = len(rids)
    for name, column in (("num_new_tokens", num_new_tokens), ("prompt_tokens", prompt_tokens),
                         ("spec_verify_ct", spec_verify_ct)):  # fmt: skip
        if column is not None and not column.is_vector("<i4", count):
            raise ValueError(f"{name} must be an int32 vector of {count} entries")
    if len(finish) != count:
        raise ValueError(f"finish must have {count} entries")
    counts = int32s(num_new_tokens, "num_new_tokens")
    if min(counts, default=0) < 0 or not new_token_ids.is_vector("<i4", sum(counts)):
        raise ValueError("num_new_tokens must be >= 0 and add up to new_token_ids")
    return counts


def check_logprobs(counts: list[int], output: LogprobColumns | None, *prompt: LogprobColumns | None) -> None:
    """Every logprob column set has the batch's R requests, and a request's output rows are its new tokens (or none)."""
    for columns in (output, *prompt):
        if columns is not None and columns.num_requests() != len(counts):
            raise ValueError(f"logprob columns must have {len(counts)} requests")
    if output is not None:
        rows = int32s(output.rows, "output_logprobs.rows")
        # (the commonest batch, every request with rows, is equal lists: one C comparison)
        if rows != counts and any(n not in (0, c) for n, c in zip(rows, counts, strict=True)):
            raise ValueError("a request's output logprob rows must be its new tokens")
