"""Who runs this step, with which tokens: decodes, prefill chunks, admissions, KV and preemption.

Running requests first, oldest first (a decode is its last token plus its drafts; a prefill chunk
takes what is left of the token budget), then waiting requests while the budget, the running
limit and free KV blocks allow. A step in which no sequence decodes has nothing to stall, so its
budget is `prefill_budget` (>= `chunk_budget`): a long prompt that arrives alone prefills in a
few large steps instead of many small ones. When a running request needs a block and none is
free, the newest running request is preempted: its blocks are freed and it goes back to the front
of the queue; on resume it re-prefills prompt + generated tokens (its pending drafts ride on the
last chunk), and since sampling depends only on (seed, output position) and logprobs already
returned are not returned again, its results are those it would have had alone.

Prefix caching: a request admitted with no blocks of its own starts from the longest run of cached
full blocks equal to its tokens' first blocks (`_cached_prefix`), and computes only the rest; each
step's computed full blocks are registered as they fill (`commit`). A hit stops before the last
token (it must be computed to sample) and before any prompt position whose logprob row the
request still wants (a row comes from the position before it), unless those rows were kept with
the cached blocks (`prompt_rows.py`): then they are returned at admission, not computed.
Requests of one prefix that arrive together would each compute it (SGLang's in-batch prefix
caching answers the same): a waiting request whose first uncached block a running request is
computing and has not committed (equal chained hashes: equal prefixes) keeps its place while other
work fills the step (`_may_wait_for`, `_computing`), and is admitted in the next step as a hit.
The wait is bounded: with budget left for admissions every running prefill got all its tokens, so
the block is in this step, committed once the step is launched (`Policy.expect`: later steps run
after it and read its KV) or its results applied, whichever comes first (or its holder left);
where nothing else would run this step, the request goes at once.

Planned ahead (a step in flight whose results are not applied yet, its effects counted by
`Policy.expect`), a plan never preempts: it is None where it would have to, and the step after the
in-flight one's results plans instead.
"""

from __future__ import annotations

from collections import deque

import structlog

from contracts.detokenizer import Finish, FinishType
from services.scheduler.block_manager import BlockManager
from services.common.logprob_rows import HostRows
from services.scheduler.plan import SeqStep, StepPlan
from services.scheduler.policy.config import PolicyConfig
from services.scheduler.policy.forks import Forks
from services.scheduler.policy.outputs import Outputs
from services.scheduler.policy.running import RunningSet
from services.scheduler.policy.sequence import Sequence
from services.scheduler.policy.verify_budget import VerifyBudget
from services.scheduler.spec.step_cost import StepCost

log = structlog.get_logger(__name__)


class _WouldPreempt(Exception):
    """A plan made ahead needs KV blocks that only a preemption would free."""


class Planner:
    def __init__(self, config: PolicyConfig, blocks: BlockManager, running: RunningSet, waiting: deque[Sequence],
                 outputs: Outputs, forks: Forks) -> None:  # fmt: skip
        self.config = config
        self._blocks = blocks
        self._running = running
        self._waiting = waiting
        self._outputs = outputs
        self._forks = forks
        self._chunk_budget = config.chunk_budget
        self._prefill_budget = max(config.chunk_budget, config.prefill_budget or config.chunk_budget)
        compact = config.verify_mode == "compact"
        self._budget = VerifyBudget(StepCost(config.verify_step_cost)) if compact else None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens requests took from the prefix cache instead of computing

    def schedule(self, ahead: bool = False) -> tuple[StepPlan, list[Sequence]] | None:
        """The next step's plan and its sequences, in order; None only `ahead`, where it would preempt."""
        decoding = any(seq.num_tokens - seq.num_computed == 1 for seq in self._running)  # a decode (or verify) this step
        budget = self._chunk_budget if decoding else self._prefill_budget
        chosen: list[tuple[Sequence, int, int]] = []  # (seq, committed tokens, drafts)
        try:
            for seq in list(self._running):
                if seq not in self._running or (seq.num_unread and seq.num_outputs >= seq.max_outputs):
                    continue  # preempted for an older request this step; or its unread token is its last
                num_tokens, num_draft = self._query_size(seq, budget)
                if num_tokens <= 0:
                    continue
                if not self._reserve(seq, seq.num_computed + num_tokens + num_draft, ahead):
                    break  # seq itself was the newest: preempted (or failed)
                chosen.append((seq, num_tokens, num_draft))
                budget -= num_tokens + num_draft
        except _WouldPreempt:
            return None
        chosen.extend(self._admit(budget, busy=bool(chosen)))
        self._observe_blocks(chosen)
        return self._running.plan([self._seq_step(seq, n, k) for seq, n, k in chosen]), [seq for seq, _, _ in chosen]

    def _query_size(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(committed tokens, drafts) to compute: a decode always runs; a prefill chunk fits the budget;
        drafts ride along only once every committed token is in the query."""
        pending = seq.num_tokens - seq.num_computed
        if pending == 1 and not seq.drafts:
            return 1, 0  # a plain decode: the commonest query
        num_tokens = pending if pending == 1 else min(pending, budget)
        if num_tokens < pending:
            return num_tokens, 0
        # Drafts past max_new_tokens are verified anyway (the finish drops what follows it): a full block
        # for every decoding sequence keeps the step's queries uniform, so it replays a CUDA graph.
        room = self.config.max_model_len - seq.num_tokens  # KV positions left after the anchor
        left = budget - num_tokens if pending > 1 else len(seq.drafts)
        return num_tokens, max(0, min(self._num_to_verify(seq), room, left))

    def _num_to_verify(self, seq: Sequence) -> int:
        """`static`: the whole block. `compact`: the prefix the verify budget buys (verify_budget.py)."""
        if self._budget is None or seq.draft_confidence is None:
            return len(seq.drafts)
        return self._budget.num_to_verify(seq.draft_confidence, len(seq.drafts))

    def _observe_blocks(self, chosen: list[tuple[Sequence, int, int]]) -> None:
        """`compact`: this step's blocks set the verify budget's next lambda (lagged: lossless)."""
        blocks = [seq.draft_confidence[: len(seq.drafts)] for seq, _, _ in chosen if seq.drafts and seq.draft_confidence]
        if self._budget is not None and blocks:
            num_outputs = sum(seq.num_computed + n == seq.num_tokens for seq, n, _ in chosen)
            self._budget.observe(blocks, sum(n for _, n, _ in chosen), num_outputs)

    def _reserve(self, seq: Sequence, num_tokens: int, ahead: bool) -> bool:
        """Make room for `num_tokens` of `seq` in KV, preempting the newest running requests."""
        while not self._blocks.ensure(seq.rid, num_tokens):
            if ahead:
                raise _WouldPreempt
            victim = next(reversed(self._running))
            if victim is seq and len(self._running) == 1:
                if self._forks.drop_waiting_holds():
                    continue
                self._running.remove(seq)
                self._blocks.free(seq.rid)
                self.fail(seq, f"the KV cache cannot hold {num_tokens} tokens of this request")
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._blocks.free(seq.rid)
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("scheduler.preempt", rid=seq.rid, tokens=seq.num_tokens)

    def _admit(self, budget: int, busy: bool) -> list[tuple[Sequence, int, int]]:
        """Waiting requests in order while budget, running limit and KV allow; one whose prefix a
        running request is computing stays in its place (a step not `busy` takes it anyway)."""
        admitted, deferred = [], []
        computing: set[int] | None = None  # `_computing`, built when first asked, grown by each admission
        while self._waiting and budget > 0 and len(self._running) < self.config.max_running_requests:
            seq = self._waiting[0]
            prefix = self._cached_prefix(seq)
            if (busy or admitted) and self._may_wait_for(seq, len(prefix)):
                computing = self._computing() if computing is None else computing
                if seq.block_hashes[len(prefix)] in computing:
                    deferred.append(self._waiting.popleft())
                    continue
            seq.num_computed += len(prefix) * self._blocks.block_size  # cached blocks (a fork holds its shared ones already)
            num_tokens, num_draft = self._query_size(seq, budget)
            total = seq.num_computed + num_tokens + num_draft
            new_blocks = self._blocks.num_new_blocks(seq.rid, total, prefix)
            # keep one block per running request free so admissions rarely force a preemption
            if new_blocks + len(self._running) > self._blocks.num_free_blocks and self._running:
                seq.num_computed -= len(prefix) * self._blocks.block_size
                break
            if new_blocks > self._blocks.num_free_blocks:
                seq.num_computed -= len(prefix) * self._blocks.block_size
                if self._running:
                    break
                if self._forks.drop_waiting_holds():  # alone and still too big: it can never run
                    continue
                self._waiting.popleft()
                self._blocks.free(seq.rid)
                self.fail(seq, f"the KV cache cannot hold {num_tokens} tokens of this request")
                continue
            self._waiting.popleft()
            self._blocks.allocate(seq.rid, total, prefix)
            self._count_hit(seq, len(prefix) * self._blocks.block_size)
            if seq.next_prompt_logprob < min(seq.num_prompt, len(prefix) * self._blocks.block_size):
                self._give_rows(seq, len(prefix) * self._blocks.block_size + 1)
            self._running.add(seq)
            if computing is not None:
                computing.update(seq.block_hashes[len(prefix) :])
            admitted.append((seq, num_tokens, num_draft))
            budget -= num_tokens + num_draft
        self._waiting.extendleft(reversed(deferred))
        return admitted

    def _may_wait_for(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether block `num_cached_blocks` of `seq` (its first uncached one), once cached, would
        lengthen its hit: a request with no output yet, no blocks of its own, and no prompt row
        wanted from that block (rows from position p need position p - 1 computed)."""
        if not self._blocks.cache.enabled or seq.num_computed or seq.num_tokens > seq.num_prompt:
            return False
        limit = (seq.num_tokens - 1) // self._blocks.block_size  # the last token is always computed
        if seq.next_prompt_logprob < seq.num_prompt:
            limit = min(limit, max(0, seq.next_prompt_logprob - 1) // self._blocks.block_size)
        return num_cached_blocks < limit and not self._blocks.holds(seq.rid)

    def _computing(self) -> set[int]:
        """Hashes of the full blocks running requests compute (this step or next), not committed
        yet: past each one's committed blocks (`next_commit`)."""
        size = self._blocks.block_size
        return {h for seq in self._running for h in seq.block_hashes[max(0, seq.next_commit // size - 1) :]}

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can start from: none where it holds blocks already (a fork, a
        prefill under way) or the cache is off (see the module's doc for the other limits)."""
        cache, size = self._blocks.cache, self._blocks.block_size
        if not cache.enabled or seq.num_computed or self._blocks.holds(seq.rid):
            return []
        if seq.hash_salt != cache.salt:
            seq.block_hashes, seq.hash_salt = [], cache.salt
        hashes = cache.hashes(seq.block_hashes, seq.tokens)[: (seq.num_tokens - 1) // size]
        prefix = self._blocks.cached_prefix(seq.rid, hashes)
        start = seq.next_prompt_logprob
        if start < seq.num_prompt:  # prompt rows wanted from `start`: computed, or kept with the blocks
            del prefix[max(max(0, start - 1) // size, self._num_row_blocks(seq, hashes, start)) :]
        if prefix and len(prefix) * size == seq.sampled_position:
            prefix.pop()  # a resumed request's query never starts at a token its last step sampled
        return prefix

    def _num_row_blocks(self, seq: Sequence, hashes: list[int], start: int) -> int:
        """Blocks a request may start from whose prompt rows past `start` (the null entry's) are all
        kept, through the first position past them (0: not so)."""
        logprobs = seq.params.logprobs
        if not self.config.cache_prompt_rows or logprobs.token_ids_logprob:
            return 0
        end = min(seq.num_prompt, self._blocks.cache.rows.covered(hashes, seq.tokens, start + 1, logprobs.top_logprobs_num))
        return (end - 1) // self._blocks.block_size if end > start + 1 else 0

    def _give_rows(self, seq: Sequence, end: int) -> None:
        """The kept prompt rows of [next_prompt_logprob, end), the first the null entry, returned now."""
        start, cache = seq.next_prompt_logprob, self._blocks.cache
        rows = cache.rows.rows(seq.block_hashes, start + 1, end, seq.params.logprobs.top_logprobs_num)
        self._outputs.give_kept_prompt(seq, rows.with_null_row().at(start))
        seq.next_prompt_logprob = end

    def keep_rows(self, seq: Sequence, step: SeqStep, rows: HostRows) -> None:
        """A step's prompt rows, kept under their full prompt blocks' hashes (raw rows, top-k ones only)."""
        if not self.config.cache_prompt_rows or rows.num_rows == 0:
            return
        cache, size = self._blocks.cache, self._blocks.block_size
        hashes = cache.hashes(seq.block_hashes, seq.tokens[: seq.num_prompt])[: seq.num_prompt // size]
        first = step.prompt_lo + (step.prompt_lo == seq.params.prompt_logprob_start)  # the null entry has no row
        cache.rows.keep(hashes, seq.tokens, first, rows)

    def _count_hit(self, seq: Sequence, num_tokens: int) -> None:
        """A request's hits count once, prompt tokens only, before it generated any (a resumed
        request's hit on its own blocks is no query's: queries count each prompt once)."""
        seq.next_commit = (num_tokens // self._blocks.block_size + 1) * self._blocks.block_size
        if seq.num_tokens > seq.num_prompt:
            return
        cached = max(seq.num_cached, min(num_tokens, seq.num_prompt))
        self.num_cached_tokens += cached - seq.num_cached
        seq.num_cached = cached

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose KV is computed and tokens known in the prefix cache."""
        cache, size = self._blocks.cache, self._blocks.block_size
        num_full = min(seq.num_computed, len(seq.tokens)) // size
        if seq.hash_salt != cache.salt:
            seq.block_hashes, seq.hash_salt = [], cache.salt
        hashes = cache.hashes(seq.block_hashes, seq.tokens[: num_full * size]) if len(seq.block_hashes) < num_full else seq.block_hashes
        self._blocks.commit(seq.rid, hashes[:num_full])
        seq.next_commit = (num_full + 1) * size

    def _seq_step(self, seq: Sequence, num_tokens: int, num_draft: int) -> SeqStep:
        start, params, num_outputs = seq.num_computed, seq.params, seq.num_tokens - seq.num_prompt
        end = start + num_tokens  # committed tokens computed through this step
        from_pool = start == seq.sampled_position  # the query begins at the token its last step sampled
        tokens = seq.tokens[start + from_pool : end] + seq.drafts[:num_draft] if num_draft else seq.tokens[start + from_pool : end]
        samples = end == seq.num_tokens and num_outputs < seq.max_outputs
        hi = min(end, seq.num_prompt - 1)  # position p comes from row p - 1
        slots = self._blocks.slots(seq.rid, start, end + num_draft)
        table = self._blocks.block_table(seq.rid)
        history = seq.tokens if params.has_penalties or params.sampling.grammar is not None else None
        return SeqStep(params, start, from_pool, tokens, num_draft, samples, seq.next_prompt_logprob, hi, slots, table,
                       num_outputs, history)  # fmt: skip

    def fail(self, seq: Sequence, message: str) -> None:
        """Finish `seq` (holding no blocks) and the forks waiting on it: they share its prompt."""
        finish = Finish(FinishType.ABORT, message=message)
        for each in (seq, *seq.forks):
            self._outputs.finish(each, finish)
        seq.forks = []
