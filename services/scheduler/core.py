"""The scheduler core: continuous batching with chunked prefill, preemption, sampling, logprobs.

A plain object (no NATS, no asyncio). `add` and `abort` may be called from any thread: they only
append to a lock-protected inbox that `step` drains first. One `step`:

    1. drain the inbox           4. forward (one ragged batch)
    2. apply aborts              5. sample (rows that reached the end of their sequence)
    3. schedule                  6. logprobs (prompt rows, sampled rows)
                                 7. advance sequences, finish, build outputs

Scheduling: running requests first, oldest first (a decode is one token; a prefill chunk takes
what is left of `chunked_prefill_size`), then waiting requests while the token budget, the
running limit and free KV blocks allow. When a running request needs a block and none is free,
the newest running request is preempted: its blocks are freed and it goes back to the front of
the queue; on resume it re-prefills prompt + generated tokens, and since sampling depends only on
(seed, output position) and logprobs already returned are not returned again, its results are
those it would have had alone.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from contracts.detokenizer import Finish, FinishType
from services.common.flat_logprobs import FlatLogprobsError, build_flat_top_logprobs
from services.scheduler.block_manager import BlockManager
from services.scheduler.logprobs import LogprobQuery, RowLogprobs, compute_logprobs
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.request import LogprobEntries, RequestOutput, SchedulerRequest, Sequence
from services.scheduler.sampler import Sampler, SampleRow

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    row: int  # first row of this sequence in the step's hidden states

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def reaches_end(self) -> bool:
        return self.end == len(self.seq.tokens)


@dataclass
class _Pending:
    """One request's output under construction during a step."""

    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobEntries = field(default_factory=LogprobEntries)
    finish: Finish | None = None


class SchedulerCore:
    def __init__(
        self,
        runner,
        *,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_model_len: int | None = None,
        logprobs_mode: str = "raw",
        seed: int = 0,
        num_blocks: int | None = None,  # use only this many of the runner's KV blocks (tests)
    ) -> None:
        self._runner = runner
        self.vocab_size = runner.config.vocab_size
        self.max_model_len = max_model_len or runner.config.max_position_embeddings
        self._eos_ids = frozenset(runner.config.eos_token_ids)
        self._max_running = max_running_requests
        self._chunk_budget = chunked_prefill_size
        self._processed = logprobs_mode == "processed"
        self._blocks = BlockManager(min(num_blocks or runner.num_blocks, runner.num_blocks), runner.block_size)
        self._sampler = Sampler(seed)
        self._lock = threading.Lock()
        self._inbox: list[SchedulerRequest] = []
        self._inbox_aborts: list[tuple[str, str]] = []
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0

    # ---- thread-safe entry points ----

    def add(self, request: SchedulerRequest) -> None:
        with self._lock:
            self._inbox.append(request)

    def abort(self, rid: str, reason: str = "abort") -> None:
        with self._lock:
            self._inbox_aborts.append((rid, reason))

    def has_work(self) -> bool:
        with self._lock:
            inbox = bool(self._inbox or self._inbox_aborts)
        return inbox or bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._waiting)

    def rids(self) -> list[str]:
        return [seq.rid for seq in (*self._running, *self._waiting)]

    def claim_error(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run here; None when it can."""
        if num_prompt_tokens >= self.max_model_len:  # as the tokenizer: room for one new token at least
            return f"the prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}"
        if self._blocks.num_blocks_for(num_prompt_tokens + 1) > self._blocks.num_blocks:
            return f"the prompt has {num_prompt_tokens} tokens, more than the KV cache holds"
        return None

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request held (inbox included) with ABORT: fatal errors and shutdown.

        Not thread-safe with `step`: call it only when no step runs.
        """
        requests, _ = self._drain_inbox()
        held = [seq.request for seq in (*self._running, *self._waiting)]
        for request in held:
            self._blocks.free(request.rid)
        self._running.clear()
        self._waiting.clear()
        finish = Finish(FinishType.ABORT, message=message)
        return [
            RequestOutput(r.rid, r.detokenizer_id, [], len(r.prompt_ids), finish, None) for r in (*held, *requests)
        ]

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        pending: dict[str, _Pending] = {}
        requests, aborts = self._drain_inbox()  # 1
        self._enqueue(requests, pending)
        self._apply_aborts(aborts, pending)  # 2
        scheduled = self._schedule(pending)  # 3
        if scheduled:
            hidden = self._runner.forward(self._build_batch(scheduled)).hidden_states  # 4: [T, H]
            samplers = [s for s in scheduled if s.reaches_end and s.seq.num_outputs < s.seq.max_outputs]
            logits, token_ids = self._sample(samplers, hidden)  # 5
            self._logprobs(scheduled, samplers, hidden, logits, token_ids, pending)  # 6
            self._advance(scheduled, samplers, token_ids, pending)  # 7
        self.num_steps += 1
        return [self._to_output(p) for p in pending.values() if _has_news(p)]

    # 1. inbox

    def _drain_inbox(self) -> tuple[list[SchedulerRequest], list[tuple[str, str]]]:
        with self._lock:
            requests, self._inbox = self._inbox, []
            aborts, self._inbox_aborts = self._inbox_aborts, []
        return requests, aborts

    def _enqueue(self, requests: list[SchedulerRequest], pending: dict[str, _Pending]) -> None:
        for request in requests:
            seq = Sequence(request, next(self._arrivals), request.prompt_ids.tolist(), max_outputs=0)
            error = self.validate(request)
            if error is not None:
                self._entry(pending, seq).finish = Finish(FinishType.ABORT, message=error)
                continue
            seq.max_outputs = min(request.sampling.max_new_tokens, self.max_model_len - seq.num_prompt)
            start = seq.prompt_logprob_start
            seq.next_prompt_logprob = seq.num_prompt if start is None else start
            self._waiting.append(seq)

    def validate(self, request: SchedulerRequest) -> str | None:
        """Why the core cannot run `request`, in words for the user; None when it can."""
        num_prompt = len(request.prompt_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        too_long = self.claim_error(num_prompt)
        if too_long is not None:
            return too_long
        if request.prompt_ids.min() < 0 or request.prompt_ids.max() >= self.vocab_size:
            return f"prompt token ids must be in [0, {self.vocab_size})"
        ids = request.logprobs.token_ids_logprob
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            return f"token_ids_logprob must be in [0, {self.vocab_size})"
        if not 0 <= request.logprobs.top_logprobs_num <= self.vocab_size:
            return f"top_logprobs_num must be in [0, {self.vocab_size}]"
        if request.sampling.max_new_tokens < 0:
            return "max_new_tokens must be >= 0"
        return None

    # 2. aborts

    def _apply_aborts(self, aborts: list[tuple[str, str]], pending: dict[str, _Pending]) -> None:
        for rid, reason in aborts:
            seq = self._remove(rid)
            if seq is None:
                continue
            finish = Finish(FinishType.ABORT, message=reason)
            self._entry(pending, seq).finish = finish

    def _remove(self, rid: str) -> Sequence | None:
        for queue in (self._running, self._waiting):
            for seq in queue:
                if seq.rid == rid:
                    queue.remove(seq)
                    self._blocks.free(rid)
                    return seq
        return None

    # 3. schedule

    def _schedule(self, pending: dict[str, _Pending]) -> list[Scheduled]:
        budget = self._chunk_budget
        chosen: list[tuple[Sequence, int]] = []
        for seq in list(self._running):
            if seq not in self._running:
                continue  # preempted for an older request this step
            num_tokens = seq.num_pending if seq.num_pending == 1 else min(seq.num_pending, budget)
            if num_tokens <= 0:
                continue
            if not self._reserve(seq, seq.num_computed + num_tokens, pending):
                break  # seq itself was the newest: preempted (or failed)
            chosen.append((seq, num_tokens))
            budget -= num_tokens
        chosen.extend(self._admit(budget, pending))
        return self._layout(chosen)

    def _reserve(self, seq: Sequence, num_tokens: int, pending: dict[str, _Pending]) -> bool:
        """Make room for `num_tokens` of `seq` in KV, preempting the newest running requests."""
        while not self._blocks.can_allocate(seq.rid, num_tokens):
            victim = self._running[-1]
            if victim is seq and len(self._running) == 1:
                self._running.remove(seq)
                self._blocks.free(seq.rid)
                message = f"the KV cache cannot hold {num_tokens} tokens of this request"
                self._entry(pending, seq).finish = Finish(FinishType.ABORT, message=message)
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self._blocks.allocate(seq.rid, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._blocks.free(seq.rid)
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("scheduler.preempt", rid=seq.rid, tokens=len(seq.tokens))

    def _admit(self, budget: int, pending: dict[str, _Pending]) -> list[tuple[Sequence, int]]:
        admitted = []
        while self._waiting and budget > 0 and len(self._running) < self._max_running:
            seq = self._waiting[0]
            num_tokens = min(seq.num_pending, budget)
            # keep one block per running request free so admissions rarely force a preemption
            reserve = len(self._running)
            needed = self._blocks.num_new_blocks(seq.rid, num_tokens) + reserve
            if needed > self._blocks.num_free_blocks and self._running:
                break
            if not self._blocks.can_allocate(seq.rid, num_tokens):
                if not self._running:  # alone and still too big: it can never run
                    self._waiting.popleft()
                    message = f"the KV cache cannot hold {num_tokens} tokens of this request"
                    self._entry(pending, seq).finish = Finish(FinishType.ABORT, message=message)
                    continue
                break
            self._waiting.popleft()
            self._blocks.allocate(seq.rid, num_tokens)
            self._running.append(seq)
            admitted.append((seq, num_tokens))
            budget -= num_tokens
        return admitted

    def _layout(self, chosen: list[tuple[Sequence, int]]) -> list[Scheduled]:
        scheduled, row = [], 0
        for seq, num_tokens in chosen:
            scheduled.append(Scheduled(seq, seq.num_computed, num_tokens, row))
            row += num_tokens
        return scheduled

    # 4. forward

    def _build_batch(self, scheduled: list[Scheduled]) -> ForwardBatch:
        input_ids = np.concatenate([np.asarray(s.seq.tokens[s.start : s.end], np.int64) for s in scheduled])  # [T]
        positions = np.concatenate([np.arange(s.start, s.end, dtype=np.int64) for s in scheduled])  # [T]
        slots = np.concatenate([self._blocks.slots(s.seq.rid, s.start, s.end) for s in scheduled])  # [T]
        query_start_loc = np.zeros(len(scheduled) + 1, np.int32)  # [B + 1]
        query_start_loc[1:] = np.cumsum([s.num_tokens for s in scheduled])
        seq_lens = np.asarray([s.end for s in scheduled], np.int32)  # [B]
        tables = [self._blocks.block_table(s.seq.rid) for s in scheduled]
        block_tables = np.full((len(tables), max(map(len, tables))), -1, np.int32)  # [B, max_blocks]
        for index, table in enumerate(tables):
            block_tables[index, : len(table)] = table
        device = self._runner.device
        return ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
        )

    # 5. sample

    def _sample(self, samplers: list[Scheduled], hidden: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        if not samplers:
            return None, []
        rows = torch.tensor([s.row + s.num_tokens - 1 for s in samplers], device=hidden.device)  # [B]
        logits = self._runner.compute_logits(hidden[rows]).float()  # [B, V]
        sample_rows = [SampleRow(s.seq.request.sampling, s.seq.num_outputs) for s in samplers]
        token_ids = self._sampler.sample(logits, sample_rows).tolist()  # the step's one host sync
        return logits, token_ids

    # 6. logprobs

    def _logprobs(
        self,
        scheduled: list[Scheduled],
        samplers: list[Scheduled],
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        token_ids: list[int],
        pending: dict[str, _Pending],
    ) -> None:
        prompt_jobs = [(s, *self._prompt_positions(s)) for s in scheduled]
        prompt_jobs = [(s, lo, hi) for s, lo, hi in prompt_jobs if lo <= hi]
        if prompt_jobs:
            queries = [self._prompt_query(s, lo, hi) for s, lo, hi in prompt_jobs]
            results = compute_logprobs(queries, hidden, self._runner.compute_logits, self.vocab_size, self._processed)
            for (s, lo, hi), result in zip(prompt_jobs, results, strict=True):
                self._record_prompt(s.seq, lo, hi, result, pending)
        output_jobs = [(index, s) for index, s in enumerate(samplers) if s.seq.wants_logprobs]
        if output_jobs and logits is not None:
            queries = [self._output_query(index, s.seq, token_ids[index]) for index, s in output_jobs]
            results = compute_logprobs(queries, logits, None, self.vocab_size, self._processed)
            for (_, s), result in zip(output_jobs, results, strict=True):
                self._record_output(s.seq, result, pending)

    def _prompt_positions(self, s: Scheduled) -> tuple[int, int]:
        """Prompt positions whose entries this chunk completes: position p comes from row p - 1."""
        return s.seq.next_prompt_logprob, min(s.end, s.seq.num_prompt - 1)

    def _prompt_query(self, s: Scheduled, lo: int, hi: int) -> LogprobQuery:
        seq = s.seq
        first = lo + 1 if lo == seq.prompt_logprob_start else lo  # the first returned position is null
        positions = np.arange(first, hi + 1, dtype=np.int64)  # [p]
        rows = s.row + positions - 1 - s.start
        targets = np.asarray(seq.tokens[first : hi + 1], np.int64)
        return self._query(seq, rows, targets)

    def _output_query(self, index: int, seq: Sequence, token_id: int) -> LogprobQuery:
        return self._query(seq, np.asarray([index], np.int64), np.asarray([token_id], np.int64))

    def _query(self, seq: Sequence, rows: np.ndarray, targets: np.ndarray) -> LogprobQuery:
        params = seq.request.logprobs
        return LogprobQuery(rows, targets, params.top_logprobs_num, params.token_ids_logprob, seq.request.sampling)

    def _record_prompt(self, seq: Sequence, lo: int, hi: int, result: RowLogprobs, pending: dict[str, _Pending]) -> None:
        if lo == seq.prompt_logprob_start:
            result = _with_null_row(result)
        entries = self._entry(pending, seq).logprobs
        entries.input_start = lo
        entries.input_token_logprobs = result.token
        entries.input_ids_logprobs = result.ids if seq.request.logprobs.token_ids_logprob else None
        if seq.wants_flat:
            seq.flat_values.append(result.top_values)
            seq.flat_ids.append(result.top_ids)
        elif seq.request.logprobs.top_logprobs_num > 0:
            entries.input_top_logprobs = result.top_values
            entries.input_top_ids = result.top_ids
        seq.next_prompt_logprob = hi + 1

    def _record_output(self, seq: Sequence, result: RowLogprobs, pending: dict[str, _Pending]) -> None:
        entries = self._entry(pending, seq).logprobs
        entries.output_token_logprobs = result.token
        if seq.request.logprobs.top_logprobs_num > 0:
            entries.output_top_logprobs = result.top_values
            entries.output_top_ids = result.top_ids
        if seq.request.logprobs.token_ids_logprob:
            entries.output_ids_logprobs = result.ids

    def _attach_flat(self, seq: Sequence, pending: dict[str, _Pending]) -> None:
        """PRODUCT §5: build the flat prompt top arrays once, when the whole prompt is in."""
        k = seq.request.logprobs.top_logprobs_num
        values = np.concatenate(seq.flat_values) if seq.flat_values else np.zeros((0, k), np.float32)
        ids = np.concatenate(seq.flat_ids) if seq.flat_ids else np.zeros((0, k), np.int32)
        seq.flat_values, seq.flat_ids, seq.flat_sent = [], [], True
        try:
            flat = build_flat_top_logprobs(values, ids, k)
        except FlatLogprobsError as exc:
            log.error("scheduler.flat_logprobs_failed", rid=seq.rid, error=str(exc))
            return
        entries = self._entry(pending, seq).logprobs
        entries.input_top_logprobs_flat = flat.values
        entries.input_top_ids_flat = flat.ids
        entries.input_top_null_prefix = flat.null_prefix

    # 7. advance and finish

    def _advance(
        self, scheduled: list[Scheduled], samplers: list[Scheduled], token_ids: list[int], pending: dict[str, _Pending]
    ) -> None:
        sampled = {id(s.seq): token for s, token in zip(samplers, token_ids, strict=True)}
        for s in scheduled:
            seq = s.seq
            seq.num_computed = s.end
            if seq.wants_flat and not seq.flat_sent and s.end >= seq.num_prompt:
                self._attach_flat(seq, pending)
            if id(seq) in sampled:
                self._append_token(seq, sampled[id(seq)], pending)
            elif s.reaches_end and seq.num_outputs >= seq.max_outputs:
                self._finish(seq, Finish(FinishType.LENGTH), pending)  # nothing left to generate

    def _append_token(self, seq: Sequence, token_id: int, pending: dict[str, _Pending]) -> None:
        seq.tokens.append(token_id)
        self._entry(pending, seq).new_token_ids.append(token_id)
        finish = self._finish_reason(seq, token_id)
        if finish is not None:
            self._finish(seq, finish, pending)

    def _finish_reason(self, seq: Sequence, token_id: int) -> Finish | None:
        sampling = seq.request.sampling
        if token_id in sampling.stop_token_ids:
            return Finish(FinishType.STOP, matched=token_id)
        if token_id in self._eos_ids and not sampling.ignore_eos:
            return Finish(FinishType.STOP, matched=token_id)
        if seq.num_outputs >= seq.max_outputs:
            return Finish(FinishType.LENGTH)
        return None

    def _finish(self, seq: Sequence, finish: Finish, pending: dict[str, _Pending]) -> None:
        self._running.remove(seq)
        self._blocks.free(seq.rid)
        self._entry(pending, seq).finish = finish

    # outputs

    def _entry(self, pending: dict[str, _Pending], seq: Sequence) -> _Pending:
        entry = pending.get(seq.rid)
        if entry is None or entry.seq is not seq:
            entry = pending[seq.rid] = _Pending(seq)
        return entry

    def _to_output(self, entry: _Pending) -> RequestOutput:
        request = entry.seq.request
        logprobs = entry.logprobs if entry.seq.wants_logprobs else None
        return RequestOutput(
            rid=request.rid,
            detokenizer_id=request.detokenizer_id,
            new_token_ids=entry.new_token_ids,
            prompt_tokens=len(request.prompt_ids),
            finish=entry.finish,
            logprobs=logprobs,
        )


def _has_news(entry: _Pending) -> bool:
    return bool(entry.new_token_ids) or entry.finish is not None or not entry.logprobs.is_empty()


def _with_null_row(result: RowLogprobs) -> RowLogprobs:
    """Prepend the null entry of the first returned prompt position: NaN values, -1 ids."""
    k, m = result.top_values.shape[1], result.ids.shape[1]
    return RowLogprobs(
        token=np.concatenate([np.full(1, np.nan, np.float32), result.token]),
        top_values=np.concatenate([np.full((1, k), np.nan, np.float32), result.top_values]),
        top_ids=np.concatenate([np.full((1, k), -1, np.int32), result.top_ids]),
        ids=np.concatenate([np.full((1, m), np.nan, np.float32), result.ids]),
    )
