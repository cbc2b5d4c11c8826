"""Whether a request can run here: the one check every way in asks (a claim knows only its
prompt's length; a request brings everything), and whether this scheduler has room for one more."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.policy.forks import num_shared_tokens
from services.scheduler.request import SchedulerRequest


class Admission:
    def __init__(self, blocks: BlockManager, max_model_len: int, vocab_size: int) -> None:
        self._blocks = blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def length_error(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run here; None when it can."""
        if num_prompt_tokens >= self.max_model_len:  # as the tokenizer: room for one new token at least
            return f"the prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}"
        if self._blocks.num_blocks_for(num_prompt_tokens + 1) > self._blocks.num_blocks:
            return f"the prompt has {num_prompt_tokens} tokens, more than the KV cache holds"
        return None

    def error(self, request: SchedulerRequest) -> str | None:
        """Why this model cannot run `request`, in words for the user; None when it can. Such a
        request fails alone; admitted, it would make a step raise, which is fatal for the scheduler."""
        prompt = request.prompt_ids  # int32 [P]
        if len(prompt) == 0:
            return "the prompt is empty"
        params = request.logprobs
        ids = [*(prompt.min(), prompt.max()), *params.token_ids_logprob, *request.sampling.stop_token_ids]
        if bad := [int(i) for i in ids if not 0 <= i < self.vocab_size]:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        if (too_long := self.length_error(len(prompt))) is not None:
            return too_long
        if not 0 <= params.top_logprobs_num <= self.vocab_size:
            return f"top_logprobs_num {params.top_logprobs_num} is not in [0, {self.vocab_size}] (the vocabulary)"
        if params.logprob_start_len >= len(prompt):
            return f"logprob_start_len {params.logprob_start_len} is not inside the {len(prompt)}-token prompt"
        if request.sampling.max_new_tokens < 0:
            return "max_new_tokens must be >= 0"
        rids = [request.rid, *(choice.rid for choice in request.choices)]
        if len(set(rids)) < len(rids):
            return "the request's choices must have distinct rids"
        return None

    def has_room(self, num_held: int, max_running: int, num_prompt_tokens: int, num_choices: int = 1) -> bool:
        """A new request would start soon: the sequences held (running, waiting, claimed) stay under
        the running limit, and the KV blocks of the prompt and of its choices' own tails (the
        prompt's full blocks counted once) are free now."""
        blocks = self._blocks.num_blocks_for(num_prompt_tokens + 1)
        tail_blocks = blocks - num_shared_tokens(num_prompt_tokens, self._blocks.block_size) // self._blocks.block_size
        return num_held < max_running and self._blocks.num_free_blocks >= blocks + (num_choices - 1) * tail_blocks
