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
from services.scheduler.request import HostRows, LogprobEntries, RequestOutput

log = structlog.get_logger(__name__)


class _Pending(msgspec.Struct):
    """One request's output under construction during a step."""

    seq: Sequence
    new_token_ids: list[int] = []  # an empty default is copied per instance
    logprobs: LogprobEntries = msgspec.field(default_factory=LogprobEntries)
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
        """The step's prompt rows: nested entries now, or kept for the flat arrays (`attach_flat`)."""
        if result.prompt_logprobs is None:
            return
        rows = result.prompt_logprobs
        if step.prompt_lo == seq.params.prompt_logprob_start:
            rows = rows.with_null_row()
        entries = self._entry(seq).logprobs
        entries.input_start = step.prompt_lo
        entries.input_token_logprobs = rows.token
        entries.input_ids_logprobs = rows.ids if seq.params.logprobs.token_ids_logprob else None
        if seq.wants_flat:
            seq.flat_values.append(rows.top_values)
            seq.flat_ids.append(rows.top_ids)
        elif seq.params.logprobs.top_logprobs_num > 0:
            entries.input_top_logprobs = rows.top_values
            entries.input_top_ids = rows.top_ids

    def attach_flat(self, seq: Sequence) -> None:
        """PRODUCT §5: build the flat prompt top arrays once, when the whole prompt is in. Rows that
        cannot be represented fall back to nested rows (with a warning) for this request only."""
        k = seq.params.logprobs.top_logprobs_num
        values = np.concatenate(seq.flat_values) if seq.flat_values else np.zeros((0, k), np.float32)
        ids = np.concatenate(seq.flat_ids) if seq.flat_ids else np.zeros((0, k), np.int32)
        seq.flat_values, seq.flat_ids, seq.flat_sent = [], [], True
        entries = self._entry(seq).logprobs
        try:
            flat = build_flat_top_logprobs(values, ids, k)
        except FlatLogprobsError as exc:
            log.warning("scheduler.flat_logprobs_fallback", rid=seq.rid, error=str(exc))
            entries.input_top_logprobs, entries.input_top_ids = values, ids  # every prompt row, in order
            return
        entries.input_top_logprobs_flat = flat.values
        entries.input_top_ids_flat = flat.ids
        entries.input_top_null_prefix = flat.null_prefix

    def prompt_part(self, seq: Sequence) -> LogprobEntries | None:
        """The prompt entries `seq` got this step (a parent keeps them for its forks); None: none."""
        entry = self._pending.get(seq.rid)
        if entry is None or entry.seq is not seq or entry.logprobs.is_empty():
            return None
        return entry.logprobs.prompt_part()

    def give_prompt(self, seq: Sequence, prompt: LogprobEntries) -> None:
        """A fork's copy of its parent's prompt entries, returned with its first output."""
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
    )


def _has_news(entry: _Pending) -> bool:
    return bool(entry.new_token_ids) or entry.finish is not None or not entry.logprobs.is_empty()
