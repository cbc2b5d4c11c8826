"""A request as the core takes it, and what the core returns per step. No torch."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from contracts.detokenizer import Finish
from contracts.scheduler import ForkedChoice, GenerateRequest, LogprobParams, SamplingParams
from services.common.arrays import from_wire
from services.common.logprob_rows import RequestLogprobs


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


class RequestOutput(msgspec.Struct, frozen=True):
    rid: str
    detokenizer_id: str
    new_token_ids: list[int]
    prompt_tokens: int
    finish: Finish | None
    logprobs: RequestLogprobs | None  # None when the request did not ask for logprobs
    spec_verify_ct: int | None = None  # verify passes so far; None without speculative decoding
    cached_tokens: int = 0  # prompt tokens whose KV it found computed (the prefix cache, a forked prompt)


def has_penalties(params: SamplingParams) -> bool:
    """Whether this request's logits depend on the tokens it has seen (rather than only on its
    parameters): `logits_processing`'s penalties. Here, torch-free, so that `Sequence` can cache it."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def is_identity(params: SamplingParams) -> bool:
    """True when none of `logits_processing`'s processors changes this request's logits."""
    return not params.logit_bias and params.min_new_tokens == 0 and not has_penalties(params) and params.grammar is None
