"""Messages the detokenizer receives: registrations from tokenizers, token batches from schedulers."""

from __future__ import annotations

import enum

import msgspec

from contracts.arrays import NDArray


class FinishType(enum.IntEnum):
    STOP = 0  # eos, a stop token id or a stop string
    LENGTH = 1  # max_new_tokens or max_model_len
    ABORT = 2  # client gone, scheduler error, shutdown


class Finish(msgspec.Struct, frozen=True, gc=False, array_like=True):
    type: FinishType
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str | None = None  # for ABORT: why, in words a user can act on


class DetokenizeParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text


class DetokenizerRegistration(msgspec.Struct, frozen=True, gc=False):
    """Request (queue group): one detokenizer takes ownership of `rid` before any token exists."""

    rid: str
    tokenizer_id: str  # outputs go to `subjects.tokenizer_outputs(tokenizer_id)`
    params: DetokenizeParams


class DetokenizerRegistrationReply(msgspec.Struct, frozen=True, gc=False):
    detokenizer_id: str


class RequestLogprobs(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One request's logprob entries that are new in one step. Every field optional.

    Null positions (nothing predicts the first prompt token) are NaN in value arrays and -1 in id
    arrays. Top-k rows are sorted by logprob, ties by token id. `k` is the request's
    `top_logprobs_num`; `m` is `len(token_ids_logprob)` (the ids themselves are in the request).
    With `--logprobs-mode processed`, tokens the request's top-k/top-p/min-p remove carry -9999.0.

    New fields are appended with a `None` default: with `omit_defaults` an old message encodes to
    the same bytes, and an old reader skips fields it does not know.
    """

    # Output positions new in this step (n = the request's new token count in the batch).
    output_token_logprobs: NDArray | None = None  # f32 [n]
    output_top_logprobs: NDArray | None = None  # f32 [n, k]
    output_top_ids: NDArray | None = None  # i32 [n, k]
    output_ids_logprobs: NDArray | None = None  # f32 [n, m]
    # Prompt positions new in this step: [input_start, input_start + p) of the prompt.
    input_start: int | None = None
    input_token_logprobs: NDArray | None = None  # f32 [p]
    input_top_logprobs: NDArray | None = None  # f32 [p, k]
    input_top_ids: NDArray | None = None  # i32 [p, k]
    input_ids_logprobs: NDArray | None = None  # f32 [p, m]
    # PRODUCT §5, opted-in requests only, sent once when the last prefill chunk is done; then the
    # nested `input_top_*` fields above stay None for that request.
    input_top_logprobs_flat: NDArray | None = None  # f32 [rows, k], rows after the null prefix
    input_top_ids_flat: NDArray | None = None  # i32 [rows, k]
    input_top_null_prefix: int | None = None


class TokenBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One scheduler step's output for one detokenizer, columnar over the R requests in it.

    Requests are ragged: request i owns `new_token_ids[offsets[i]:offsets[i+1]]` where
    `offsets = [0, *cumsum(num_new_tokens)]` (0 new tokens is valid: a prefill chunk).
    """

    scheduler_id: str
    step: int
    rids: list[str]  # [R]
    num_new_tokens: NDArray  # i32 [R]
    new_token_ids: NDArray  # i32 [sum(num_new_tokens)]
    prompt_tokens: NDArray  # i32 [R]
    finish: list[Finish | None]  # [R]; None while running
    logprobs: list[RequestLogprobs | None] | None = None  # [R]; None when nobody asked
    spec_verify_ct: NDArray | None = None  # i32 [R], cumulative verify passes (speculative only)
