"""Messages the scheduler receives (and the replies it sends to them)."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from contracts.arrays import NDArray
from contracts.limits import (
    MAX_FORKED_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    Count,
    InstanceId,
    Probability,
    Reason,
    Rid,
    Seed,
    Temperature,
    TokenId,
)


class GrammarKind(enum.IntEnum):
    JSON_OBJECT = 0  # any JSON object (OpenAI's json_object); `text` unused
    JSON_SCHEMA = 1  # a JSON Schema document
    REGEX = 2
    EBNF = 3  # xgrammar's EBNF, `root` the start rule


GrammarAffix = Annotated[str, msgspec.Meta(max_length=1024)]


class Grammar(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What a request's output must match: `prefix`, then a match of `text`, then `suffix` (a forced
    tool call wraps its JSON in the model's markers). The scheduler masks every token that leaves it."""

    kind: GrammarKind
    text: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] = ""
    prefix: GrammarAffix = ""
    suffix: GrammarAffix = ""


class SamplingParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    max_new_tokens: Count = 128
    temperature: Temperature = 1.0  # 0 means greedy
    top_p: Probability = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOKENS)] = -1  # -1 means the whole vocabulary
    min_p: Probability = 0.0
    seed: Seed | None = None  # same seed, same prompt -> same output, also inside a busy batch
    stop_token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False
    # Appended (schema evolution): logit processors, see services/scheduler/logits_processing.py.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: Grammar | None = None  # structured output (services/scheduler/grammar.py)


class LogprobParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What logprobs one request wants. Requests in one batch may differ freely."""

    return_logprob: bool = False
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOKENS)] = -1  # -1: output only; k >= 0: prompt positions k.. and output
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    token_ids_logprob: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_TOKEN_IDS_LOGPROB)] = ()
    # PRODUCT §5: prompt top logprobs assembled once in the scheduler as flat [rows, k] arrays.
    flat_prompt_top_logprobs: bool = False


class ForkedChoice(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One more choice of an `n` > 1 call: the request's prompt and parameters, its own rid, seed
    and detokenizer. The scheduler computes the prompt once and forks a sequence per choice."""

    rid: Rid
    detokenizer_id: InstanceId
    seed: Seed | None = None  # None: the scheduler draws one, as for a request without a seed


ForkedChoices = Annotated[tuple[ForkedChoice, ...], msgspec.Meta(max_length=MAX_FORKED_CHOICES)]


class SchedulerClaim(msgspec.Struct, frozen=True, gc=False):
    """Request (queue group): "which scheduler takes this request?". Small on purpose."""

    rid: Rid
    num_prompt_tokens: Count
    force: bool = False  # take it even without room (the tokenizer waited long enough for one with room)
    # Where the request's outputs go: if its GenerateRequest is lost in transit, the scheduler
    # fails it there when the claim expires, so it never hangs.
    detokenizer_id: InstanceId | None = None
    # Appended (schema evolution): the other choices of an n > 1 request, so that a lost
    # GenerateRequest fails them too; a scheduler that reads them says so with `forks`.
    choices: ForkedChoices = ()


class SchedulerClaimReply(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    scheduler_id: InstanceId
    accepted: bool = True
    error: Reason | None = None  # why not accepted (e.g. prompt longer than max_model_len)
    busy: bool = False  # not accepted for now: no room here (ask again: another scheduler may have some)
    # Appended: this scheduler forks the claim's choices from one prefill. False (an older
    # scheduler): send it choice 0 alone and claim the other choices as requests of their own.
    forks: bool = False


class GenerateRequest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Published to `subjects.scheduler_generate(scheduler_id)` after a successful claim."""

    rid: Rid
    input_ids: NDArray  # int32 [num_prompt_tokens]
    detokenizer_id: InstanceId  # where this request's TokenBatch entries go
    sampling: SamplingParams = SamplingParams()
    logprobs: LogprobParams = LogprobParams()
    stream: bool = False
    # Appended (schema evolution): choices 1..n-1 of an n > 1 call (this request is choice 0),
    # sent only to a scheduler whose claim reply said `forks`.
    choices: ForkedChoices = ()

    def __post_init__(self) -> None:
        if not self.input_ids.is_vector("<i4") or self.input_ids.shape[0] == 0:
            raise ValueError("input_ids must be a non-empty int32 vector")


class AbortRequest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Broadcast to every scheduler; a scheduler ignores rids it does not hold."""

    rid: Rid
    reason: Annotated[str, msgspec.Meta(max_length=64)] = "abort"  # "abort" (client gone), "stop" (detokenizer matched a stop string)


class SchedulerPing(msgspec.Struct, frozen=True, gc=False):
    sent_at: float


class SchedulerInfo(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Reply to a ping: what the answering scheduler serves."""

    scheduler_id: InstanceId
    model_name: Reason
    max_model_len: Count
    vocab_size: Count
    speculative_algorithm: Annotated[str, msgspec.Meta(max_length=64)] = "none"
    num_running: Count = 0
    weight_version: Annotated[str, msgspec.Meta(max_length=256)] = ""  # appended: the policy version served


class FlushCache(msgspec.Struct, frozen=True, gc=False):
    """Forget every cached KV block (SGLang's /flush_cache): broadcast to every scheduler."""

    sent_at: float
