"""Forks (`n` > 1): a request's other choices wait on it (`Sequence.forks`) until its prefill is
done, then each starts with the prompt's full blocks shared (`BlockManager.fork`) and the prompt's
logprob entries copied; it computes only the prompt's tail itself. From then on a forked choice is
a sequence like any other: aborting it frees its own holds, a preempted one re-prefills its whole
prompt + output alone."""

from __future__ import annotations

from collections import deque

from services.scheduler.block_manager import BlockManager
from services.scheduler.policy.outputs import Outputs
from services.scheduler.policy.sequence import Sequence
from services.common.logprob_rows import RequestLogprobs, RowLogprobs


class Forks:
    def __init__(self, blocks: BlockManager, waiting: deque[Sequence], outputs: Outputs) -> None:
        self._blocks = blocks
        self._waiting = waiting
        self._outputs = outputs
        self.num_prefix_hits = 0  # prompt tokens whose KV a fork took from its parent instead of computing

    def advance(self, parent: Sequence) -> None:
        """After a step of `parent`'s prefill: keep its prompt entries for the forks, and fork them
        once the whole prompt is in KV."""
        if not parent.forks:
            return
        part = self._outputs.prompt_part(parent)
        if part is not None:
            parent.prompt_parts.append(part)
        if parent.num_computed >= parent.num_prompt:
            self._fork(parent)

    def _fork(self, parent: Sequence) -> None:
        """The prompt is in KV: each waiting choice starts from it, first in the queue.

        A fork shares the prompt's full blocks before the last prompt token and recomputes the
        rest itself (1 to block_size tokens) instead of copying the partial last block on the
        device: the partial block is the fork's own to write into from its first output on, the
        recompute needs no worker change, it writes the drafter's context rows (same slots) too,
        and it samples the fork's first token from its own row with its own seed, as if alone.
        """
        shared = num_shared_tokens(parent.num_prompt, self._blocks.block_size)
        prompt = _joined(parent.prompt_parts)
        for child in parent.forks:
            self._blocks.fork(parent.rid, child.rid, shared)
            child.num_computed = child.num_cached = shared
            self.num_prefix_hits += shared
            child.next_prompt_logprob, child.flat_sent = child.num_prompt, True  # returned here, once
            if child.params.wants_logprobs and not prompt.is_empty():
                self._outputs.give_prompt(child, prompt)
        self._waiting.extendleft(reversed(parent.forks))
        parent.forks, parent.prompt_parts = [], []

    def pass_on(self, seq: Sequence) -> None:
        """`seq` leaves before its prefill was done: its first fork takes the others and prefills alone."""
        if seq.forks:
            heir, *others = seq.forks
            heir.forks, seq.forks = others, []
            self._waiting.appendleft(heir)

    def drop_waiting_holds(self) -> bool:
        """Waiting forks hold their prompt's shared blocks, the last holders once choice 0 was
        preempted or finished: before anything is aborted for want of KV, they let go of them and
        will re-prefill alone (as preempted). Whether any did."""
        holders = [seq for seq in self._waiting if self._blocks.holds(seq.rid)]
        for seq in holders:
            self._blocks.free(seq.rid)
            seq.num_computed = 0
        return bool(holders)


def _joined(parts: list[RequestLogprobs]) -> RequestLogprobs:
    """The prompt rows of several steps as one step's: rows joined in order, the flat arrays (sent once, so in one part)."""
    prompts = [part.prompt for part in parts if part.prompt is not None]
    flat = next((part.flat for part in parts if part.flat is not None), None)
    return RequestLogprobs(prompt=RowLogprobs.joined(prompts) if prompts else None, flat=flat)


def num_shared_tokens(num_prompt: int, block_size: int) -> int:
    """Prompt tokens forks share: the full blocks before the last prompt token."""
    return (num_prompt - 1) // block_size * block_size
