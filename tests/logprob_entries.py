"""Test helpers: a request's logprob rows from arrays named as the HTTP API names them, and a
batch's logprob columns from each request's rows (as the scheduler's wire builds them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from contracts.arrays import NDArray
from services.common.arrays import from_wire
from services.common.logprob_rows import RequestLogprobs, RowLogprobs, to_columns


def _array(value) -> np.ndarray | None:
    if value is None:
        return None
    return from_wire(value) if isinstance(value, NDArray) else np.asarray(value)


def logprobs_of(*, input_start: int | None = None, input_token_logprobs=None, input_top_logprobs=None, input_top_ids=None,
                input_ids_logprobs=None, output_token_logprobs=None, output_top_logprobs=None, output_top_ids=None,
                output_ids_logprobs=None, input_top_logprobs_flat=None, input_top_ids_flat=None,
                input_top_null_prefix: int | None = None) -> RequestLogprobs:  # fmt: skip
    """One request's rows of one step: prompt rows from `input_start`, output rows, flat prompt
    arrays after `input_top_null_prefix` null rows (kinds not given: width 0)."""
    prompt = output = flat = None
    if input_token_logprobs is not None:
        prompt = RowLogprobs.of(_array(input_token_logprobs), _array(input_top_logprobs), _array(input_top_ids),
                                _array(input_ids_logprobs), input_start or 0)  # fmt: skip
    if output_token_logprobs is not None:
        output = RowLogprobs.of(_array(output_token_logprobs), _array(output_top_logprobs), _array(output_top_ids),
                                _array(output_ids_logprobs))  # fmt: skip
    if input_top_logprobs_flat is not None:
        flat = RowLogprobs.of(None, _array(input_top_logprobs_flat), _array(input_top_ids_flat), start=input_top_null_prefix or 0)
    return RequestLogprobs(output, prompt, flat)


def batch_columns(logprobs: Sequence[RequestLogprobs | None] | None) -> dict:
    """A batch's `output_logprobs`, `prompt_logprobs` and `prompt_top_flat` of its requests' rows."""
    if logprobs is None:
        return {}
    rows = {kind: [None if lp is None else getattr(lp, kind) for lp in logprobs] for kind in ("output", "prompt", "flat")}
    return {"output_logprobs": to_columns(rows["output"]), "prompt_logprobs": to_columns(rows["prompt"]),
            "prompt_top_flat": to_columns(rows["flat"])}  # fmt: skip
