"""Which logprob rows a step computes, known before its forward (so their indices ride in the
step's one upload): every prompt row asked for, and the verify rows of each producer that wants
output logprobs. Prompt rows are a query per sequence; output rows are one query for the whole
step where its producers that want them all want the same (`RequestParams.output_logprob_key`,
and in processed mode the same filters: the commonest decode step), else one per producer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from services.scheduler.logprobs import LogprobQuery, logprob_inputs, split_logprobs
from services.scheduler.plan import RequestParams, SeqStep, StepPlan
from services.common.logprob_rows import HostRows, RowLogprobs, RowSpan
from services.scheduler.worker.layout import StepLayout

PROMPT_LP, OUTPUT_LP = "prompt_logprobs.", "output_logprobs."  # their inputs' names in the upload


class Owned(msgspec.Struct, frozen=True):
    """A query and the steps whose rows it holds, in order: step `steps[j]` owns its next
    `counts[j]` rows (None: one row each, or a single step owning them all). (A `msgspec.Struct`:
    one per step, or one per producer a step where producers ask different widths.)"""

    steps: list[int]  # indices into plan.steps
    counts: list[int] | None
    query: LogprobQuery

    @classmethod
    def one(cls, step: int, query: LogprobQuery) -> Owned:
        return cls([step], None, query)

    def split(self, rows: HostRows) -> dict[int, HostRows]:
        """The query's host rows (`split_logprobs`) -> each step's (by step index): spans of the same columns."""
        if len(self.steps) == 1 or rows.num_rows == 0:  # no rows: nothing computed (`split_logprobs`' empty rows)
            return dict.fromkeys(self.steps, rows)
        source, start = (rows.source, rows.first) if rows.__class__ is RowSpan else (rows, 0)
        if self.counts is None:
            spans = [RowSpan(source, first, 1) for first in range(start, start + len(self.steps))]
        else:
            firsts = itertools.accumulate(self.counts, initial=start)
            spans = [RowSpan(source, first, count) for first, count in zip(firsts, self.counts)]
        return dict(zip(self.steps, spans, strict=True))


@dataclass(frozen=True)
class LogprobAsks:
    """A step's prompt and output logprob queries."""

    prompt: list[Owned]  # a query per step with prompt rows
    output: list[Owned]  # rows of the verified logits, targets sampled
    num_verify_rows: int  # P * (K + 1): the rows of the verified logits that output queries index

    @property
    def num_output_steps(self) -> int:
        return sum(len(job.steps) for job in self.output)

    def inputs(self, processed: bool) -> dict[str, np.ndarray]:
        prompt = logprob_inputs([job.query for job in self.prompt], processed)
        output = logprob_inputs([job.query for job in self.output], processed, self.num_verify_rows)
        return {PROMPT_LP + k: v for k, v in prompt.items()} | {OUTPUT_LP + k: v for k, v in output.items()}


@dataclass(frozen=True)
class LogprobJobs:
    """A step's queries and their rows on the device, until the readback."""

    prompt: list[Owned]
    prompt_rows: RowLogprobs[torch.Tensor] | None
    output: list[Owned]
    output_rows: RowLogprobs[torch.Tensor] | None

    def host_rows(self, prompt: list[np.ndarray] | None, output: list[np.ndarray] | None) -> tuple[dict, dict]:
        """Each step's (by step index) prompt rows and output rows, from the readback's columns."""
        return _rows(self.prompt, prompt), _rows(self.output, output)


def _rows(jobs: list[Owned], columns: list[np.ndarray] | None) -> dict[int, HostRows]:
    if not jobs:
        return {}
    rows = split_logprobs([job.query for job in jobs], columns)
    if len(jobs) == 1:
        return jobs[0].split(rows[0])
    return {i: r for job, query_rows in zip(jobs, rows, strict=True) for i, r in job.split(query_rows).items()}


def section(arrays: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in arrays.items() if name.startswith(prefix)}


def ask(plan: StepPlan, layout: StepLayout, processed: bool) -> LogprobAsks:
    """The step's queries (module docstring); only steps with prompt rows left ask for prompt rows
    (none in a decode step), and a producer's output rows are its anchor's and its drafts' (its
    tokens come from those; the rows padding it to K + 1 would be computed for nothing)."""
    prompt = [Owned.one(i, _prompt_query(s, layout.row_start[i])) for i, s in enumerate(plan.steps) if s.prompt_lo <= s.prompt_hi]
    width = layout.max_draft + 1
    num_verify_rows = len(layout.producers) * width
    wanting = _wanting_output_rows(plan, layout, processed)
    if wanting is None:
        return LogprobAsks(prompt, [], num_verify_rows)
    positions, owners, keys = wanting
    rows = None
    if width > 1:
        rows = [np.arange(p * width, p * width + plan.steps[i].num_draft + 1, dtype=np.int64) for p, i in zip(positions, owners)]
    if keys.count(keys[0]) == len(keys):  # one query for the step's output rows
        query_rows = _row_indices(positions) if rows is None else np.concatenate(rows)
        counts = None if rows is None else [len(r) for r in rows]
        output = [Owned(owners, counts, _query(plan.steps[owners[0]].params, query_rows, None))]
    else:
        output = [Owned.one(i, _query(plan.steps[i].params, np.asarray([p], np.int64) if rows is None else rows[j], None))
                  for j, (p, i) in enumerate(zip(positions, owners))]  # fmt: skip
    return LogprobAsks(prompt, output, num_verify_rows)


def _wanting_output_rows(plan: StepPlan, layout: StepLayout, processed: bool) -> tuple[list[int] | range, list[int], list] | None:
    """The producers that want output logprob rows: their positions among the producers, their
    step indices, and their keys (a single key: they all share it); None where none does. From
    the plan's `output_logprob_keys` where every sequence shares one (in processed mode, only
    where that one is None), else asked of each producer."""
    shared = plan.output_logprob_keys
    if shared is not None and len(shared) == 1 and (shared[0] is None or not processed):
        if shared[0] is None or not layout.producers:
            return None
        return range(len(layout.producers)), layout.producers, list(shared)
    params = [plan.steps[i].params for i in layout.producers]
    positions = [p for p, each in enumerate(params) if each.wants_logprobs]
    if not positions:
        return None
    keys = [_output_key(params[p]) if processed else params[p].output_logprob_key for p in positions]
    return positions, [layout.producers[p] for p in positions], keys


def _prompt_query(step: SeqStep, row_start: int) -> LogprobQuery:
    """The rows of prompt positions [prompt_lo, prompt_hi] (a step with some: lo <= hi)."""
    params, lo, hi = step.params, step.prompt_lo, step.prompt_hi
    first = lo + 1 if lo == params.prompt_logprob_start else lo  # the first returned position is null
    positions = np.arange(first, hi + 1, dtype=np.int64)  # [p]
    rows = row_start + positions - 1 - step.start
    return _query(params, rows, params.prompt_ids[first : hi + 1].astype(np.int64))


def _query(params: RequestParams, rows: np.ndarray, targets: np.ndarray | None) -> LogprobQuery:
    logprobs = params.logprobs
    return LogprobQuery(rows, targets, logprobs.top_logprobs_num, logprobs.token_ids_logprob, params.sampling)


def _output_key(params: RequestParams) -> tuple:
    """In processed mode, what the work on a request's output rows reads of it: its widths
    (`output_logprob_key`, all it reads in raw mode) and its filters."""
    sampling = params.sampling
    return params.output_logprob_key, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p


def _row_indices(positions: list[int] | range) -> np.ndarray:
    """int64 [n]: the producers' rows of a step without drafts (one each)."""
    return np.arange(len(positions), dtype=np.int64) if positions.__class__ is range else np.asarray(positions, np.int64)
