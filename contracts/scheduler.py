"""Messages the scheduler receives (and the replies it sends to them)."""

from __future__ import annotations

import msgspec

from contracts.arrays import NDArray


class SamplingParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means the whole vocabulary
    min_p: float = 0.0
    seed: int | None = None  # same seed, same prompt -> same output, also inside a busy batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Appended (schema evolution): logit processors, see services/scheduler/logits_processing.py.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)


class LogprobParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What logprobs one request wants. Requests in one batch may differ freely."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output only; k >= 0: prompt positions k.. and output
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    # PRODUCT §5: prompt top logprobs assembled once in the scheduler as flat [rows, k] arrays.
    flat_prompt_top_logprobs: bool = False


class SchedulerClaim(msgspec.Struct, frozen=True, gc=False):
    """Request (queue group): "which scheduler takes this request?". Small on purpose."""

    rid: str
    num_prompt_tokens: int


class SchedulerClaimReply(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: str
    accepted: bool = True
    error: str | None = None  # why not accepted (e.g. prompt longer than max_model_len)


class GenerateRequest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Published to `subjects.scheduler_generate(scheduler_id)` after a successful claim."""

    rid: str
    input_ids: NDArray  # int32 [num_prompt_tokens]
    detokenizer_id: str  # where this request's TokenBatch entries go
    sampling: SamplingParams = SamplingParams()
    logprobs: LogprobParams = LogprobParams()
    stream: bool = False


class AbortRequest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Broadcast to every scheduler; a scheduler ignores rids it does not hold."""

    rid: str
    reason: str = "abort"  # "abort" (client gone), "stop" (detokenizer matched a stop string)


class SchedulerPing(msgspec.Struct, frozen=True, gc=False):
    sent_at: float


class SchedulerInfo(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Reply to a ping: what the answering scheduler serves."""

    scheduler_id: str
    model_name: str
    max_model_len: int
    vocab_size: int
    speculative_algorithm: str = "none"
    num_running: int = 0
