"""The outputs a step builds per request: new tokens, finishes, logprob entries (prompt rows as
they come, output rows cut to the tokens kept, the flat prompt arrays once the prompt is in)."""

from __future__ import annotations

import msgspec
import numpy as np
import structlog

from contracts.detokenizer import Finish
from services.common.flat_logprobs import FlatLogprobsError, build_flat_top_logprobs
from services.scheduler.plan import SeqResult, SeqStep
from services.scheduler.policy.sequence import Sequence
from services.common.logprob_rows import HostRows, RequestLogprobs, RowLogprobs
from services.scheduler.request import RequestOutput

log = structlog.get_logger(__name__)


class _Pending(msgspec.Struct):
    """One request's output under construction during a step."""

    seq: Sequence
    new_token_ids: list[int] = []  # an empty default is copied per instance
    logprobs: RequestLogprobs = msgspec.field(default_factory=RequestLogprobs)
    finish: Finish | None = None


class Outputs:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def take(self) -> list[RequestOutput]:
        """The outputs built since the last call (requests with news only)."""
        pending, self._pending = self._pending, {}
        return [_to_output(p) for p in pending.values() if _has_news(p)]

    def has_pending(self) -> bool:
        return bool(self._pending)

    def finish(self, seq: Sequence, finish: Finish) -> None:
        self._entry(seq).finish = finish

    def add_tokens(self, seq: Sequence, tokens: list[int], rows: HostRows | None) -> None:
        """`tokens` kept of a step, and their output logprob rows (one per token, or more: cut here)."""
        entry = self._entry(seq)
        entry.new_token_ids.extend(tokens)
        if rows is not None:
            # a step without drafts has one row and keeps its one token: no cut (a call per request a step)
            entry.logprobs.output = rows if rows.num_rows == len(tokens) else rows.head(len(tokens))

    def record_prompt(self, seq: Sequence, step: SeqStep, result: SeqResult) -> None:
        """The step's prompt rows, from their first position: returned now, or, for a request that
        wants flat arrays, held until the whole prompt is in (`attach_flat`)."""
        if result.prompt_logprobs is None:
            return
        rows = result.prompt_logprobs
        if step.prompt_lo == seq.params.prompt_logprob_start:
            rows = rows.with_null_row()
        rows = (rows if rows.__class__ is RowLogprobs else rows.rows()).at(step.prompt_lo)
        self.give_kept_prompt(seq, rows)

    def give_kept_prompt(self, seq: Sequence, rows: RowLogprobs) -> None:
        """Prompt rows in position order (a step's, or kept with cached blocks): after any this step gave already."""
        if seq.wants_flat:
            seq.held_prompt.append(rows)
            return
        entry = self._entry(seq)
        entry.logprobs.prompt = rows if entry.logprobs.prompt is None else RowLogprobs.joined([entry.logprobs.prompt, rows])

    def attach_flat(self, seq: Sequence) -> None:
        """PRODUCT §5: the whole prompt's rows, once it is in, their top-k as the flat arrays. Rows
        that cannot be represented fall back to nested rows (with a warning) for this request only."""
        k = seq.params.logprobs.top_logprobs_num
        held = seq.held_prompt or [RowLogprobs.of(np.zeros(0, np.float32), np.zeros((0, k), np.float32), np.zeros((0, k), np.int32))]
        rows = RowLogprobs.joined(held)
        seq.held_prompt, seq.flat_sent = [], True
        entries = self._entry(seq).logprobs
        try:
            entries.flat = build_flat_top_logprobs(rows.top_values, rows.top_ids, k)
        except FlatLogprobsError as exc:
            log.warning("scheduler.flat_logprobs_fallback", rid=seq.rid, error=str(exc))
            entries.prompt = rows  # every prompt row, nested, in order
            return
        entries.prompt = RowLogprobs.of(rows.token, None, None, rows.ids, start=rows.start)  # the top-k goes flat

    def prompt_part(self, seq: Sequence) -> RequestLogprobs | None:
        """The prompt rows `seq` got this step (a parent keeps them for its forks); None: none."""
        entry = self._pending.get(seq.rid)
        if entry is None or entry.seq is not seq or (entry.logprobs.prompt is None and entry.logprobs.flat is None):
            return None
        return RequestLogprobs(prompt=entry.logprobs.prompt, flat=entry.logprobs.flat)

    def give_prompt(self, seq: Sequence, prompt: RequestLogprobs) -> None:
        """A fork's copy of its parent's prompt rows, returned with its first output."""
        self._entry(seq).logprobs = msgspec.structs.replace(prompt)

    def _entry(self, seq: Sequence) -> _Pending:
        entry = self._pending.get(seq.rid)
        if entry is None or entry.seq is not seq:
            entry = self._pending[seq.rid] = _Pending(seq)
        return entry


def _to_output(entry: _Pending) -> RequestOutput:
    seq = entry.seq
    request = seq.request
    return RequestOutput(
        rid=request.rid,
        detokenizer_id=request.detokenizer_id,
        new_token_ids=entry.new_token_ids,
        prompt_tokens=len(request.prompt_ids),
        finish=entry.finish,
        logprobs=entry.logprobs if seq.params.wants_logprobs else None,
        spec_verify_ct=seq.spec_verify_ct if seq.speculative else None,
        cached_tokens=seq.num_cached,
    )


def _has_news(entry: _Pending) -> bool:
    return bool(entry.new_token_ids) or entry.finish is not None or not entry.logprobs.is_empty()
