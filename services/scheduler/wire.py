"""A step's `RequestOutput`s -> one columnar `TokenBatch` per detokenizer, every logprob row of the
step as the batch's `LogprobColumns` (`logprob_rows.to_columns`, the one encoder)."""

from __future__ import annotations

import numpy as np

from contracts.arrays import NDArray
from contracts.detokenizer import TokenBatch
from services.common.arrays import to_wire
from services.common.logprob_rows import RequestLogprobs, to_columns
from services.scheduler.request import RequestOutput


def to_token_batches(
    outputs: list[RequestOutput], scheduler_id: str, step: int, weight_version: str | None = None
) -> dict[str, TokenBatch]:
    """Group by detokenizer id, keeping each request's order within its group."""
    groups: dict[str, list[RequestOutput]] = {}
    for output in outputs:
        groups.setdefault(output.detokenizer_id, []).append(output)
    return {detokenizer_id: _token_batch(group, scheduler_id, step, weight_version) for detokenizer_id, group in groups.items()}


def _token_batch(outputs: list[RequestOutput], scheduler_id: str, step: int, weight_version: str | None) -> TokenBatch:
    new_ids = [token for output in outputs for token in output.new_token_ids]
    entries = [output.logprobs for output in outputs]
    any_logprobs = entries.count(None) < len(entries)
    return TokenBatch(
        scheduler_id=scheduler_id,
        step=step,
        rids=[output.rid for output in outputs],
        num_new_tokens=to_wire(np.asarray([len(o.new_token_ids) for o in outputs], np.int32)),  # [R]
        new_token_ids=to_wire(np.asarray(new_ids, np.int32)),  # [sum(num_new_tokens)]
        prompt_tokens=to_wire(np.asarray([o.prompt_tokens for o in outputs], np.int32)),  # [R]
        finish=[output.finish for output in outputs],
        spec_verify_ct=_verify_counts(outputs),
        cached_tokens=_cached_counts(outputs),
        output_logprobs=to_columns([None if e is None else e.output for e in entries]) if any_logprobs else None,
        prompt_logprobs=to_columns(_prompt_rows(entries, "prompt")) if any_logprobs else None,
        prompt_top_flat=to_columns(_prompt_rows(entries, "flat")) if any_logprobs else None,
        weight_version=weight_version,
    )


def _prompt_rows(entries: list[RequestLogprobs | None], kind: str) -> list:
    """Each request's rows of a prompt kind; the commonest batch (decodes) has none, found without a list."""
    if not any(e is not None and getattr(e, kind) is not None for e in entries):
        return []
    return [None if e is None else getattr(e, kind) for e in entries]


def _cached_counts(outputs: list[RequestOutput]) -> NDArray | None:
    """i32 [R], prompt tokens found in KV per request; absent when none found any."""
    if not any(o.cached_tokens for o in outputs):
        return None
    return to_wire(np.asarray([o.cached_tokens for o in outputs], np.int32))


def _verify_counts(outputs: list[RequestOutput]) -> NDArray | None:
    """i32 [R], cumulative verify passes per request; absent when no request runs speculatively."""
    if all(o.spec_verify_ct is None for o in outputs):
        return None
    return to_wire(np.asarray([o.spec_verify_ct or 0 for o in outputs], np.int32))
