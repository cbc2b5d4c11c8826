"""A step's host-side shape, and the host arrays its forward and accept rule read (they ride in
the step's one upload). One numpy call per array, none per sequence where it can be helped: at 64
decodes a per-sequence call would cost more than the work."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from services.scheduler.logits_processing import blocked_ids
from services.scheduler.model.tensor_parallel import RowDraw
from services.scheduler.plan import SeqStep, StepPlan


@dataclass(frozen=True)
class StepLayout:
    """Step i owns rows [row_start[i], row_start[i] + its query length) of the forward."""

    row_start: list[int]
    producers: list[int]  # indices into plan.steps of the sequences that produce tokens
    max_draft: int  # K: drafts per producer, padded
    verifies_every_row: bool  # one query token per sequence, every one a producer: verify rows are 0..T-1

    @classmethod
    def of(cls, plan: StepPlan) -> StepLayout:
        row_start, row = [], 0
        for step in plan.steps:
            row_start.append(row)
            row += step.num_query
        producers = [i for i, step in enumerate(plan.steps) if step.samples]
        max_draft = max((plan.steps[i].num_draft for i in producers), default=0)
        every_row = max_draft == 0 and len(producers) == len(plan.steps) == row
        return cls(row_start, producers, max_draft, every_row)

    def verify_rows(self, plan: StepPlan) -> np.ndarray:
        """int64 [P, K + 1]: rows of each producer's anchor and drafts (padding repeats the last)."""
        steps = [plan.steps[i] for i in self.producers]
        first = np.asarray([self.row_start[i] + s.num_committed - 1 for i, s in zip(self.producers, steps)], np.int64)
        num_draft = np.asarray([s.num_draft for s in steps], np.int64)
        return first[:, None] + np.minimum(np.arange(self.max_draft + 1)[None, :], num_draft[:, None])


@dataclass(frozen=True)
class ShardSplit:
    """Tensor parallelism: the producers (positions in `StepLayout.producers`) whose verify rows are
    drawn from vocabulary shards (`ShardedRows.sample`; logit bias and min_tokens edit each shard's
    own ids), and those whose rows are gathered whole: penalties or a grammar (their inputs, token
    counts and bitmasks over the whole vocabulary, live on rank 0), top-p (the sorted row's cumulative
    mass: one gather beats a distributed sort and sums in TP = 1's order) or drafts to verify by
    sampling (the residual max(p - q, 0) over the drafter's whole q). docs/architecture.md weighs each."""

    on_shards: list[int]
    whole: list[int]
    draws: tuple[RowDraw, ...]  # [len(on_shards) * (K + 1)]: every row its argmax, a sampled producer's first its draw

    @classmethod
    def of(cls, plan: StepPlan, layout: StepLayout, eos_ids: frozenset[int]) -> ShardSplit:
        on_shards, whole, draws = [], [], []
        for p, i in enumerate(layout.producers):
            step = plan.steps[i]
            params = step.params
            sampling, sampled = params.sampling, params.samples_randomly
            if params.has_penalties or sampling.grammar is not None or sampling.top_p < 1.0 or (sampled and step.num_draft > 0):
                whole.append(p)
                continue
            on_shards.append(p)
            draws += _row_draws(step, layout.max_draft + 1, eos_ids)
        return cls(on_shards, whole, tuple(draws))

    def rows(self, producers: list[int], width: int) -> np.ndarray:
        """int64 [len(producers) * width]: the verify rows of these producers."""
        return (np.asarray(producers, np.int64)[:, None] * width + np.arange(width)).reshape(-1)


def _row_draws(step: SeqStep, width: int, eos_ids: frozenset[int]) -> list[RowDraw]:
    """A producer's `width` verify rows: each its argmax, a sampled one's first its draw; row j with its
    logit bias and the ids min_tokens holds back after the outputs and drafts 1..j before it
    (`Worker._processed_logits`' rows)."""
    params, sampling = step.params, step.params.sampling
    draws = []
    for j in range(width):
        blocked = blocked_ids(sampling, step.output_position + min(j, step.num_draft), eos_ids)
        if j == 0 and params.samples_randomly:
            draws.append(RowDraw(sampling.temperature, params.seed, step.output_position, sampling.top_k, sampling.min_p,
                                 sampling.logit_bias, blocked))  # fmt: skip
        else:
            draws.append(RowDraw(0.0, None, 0, logit_bias=sampling.logit_bias, blocked=blocked))
    return draws


def forward_arrays(plan: StepPlan, layout: StepLayout, trash_block: int) -> dict[str, np.ndarray]:
    """The forward's host arrays: query tokens the host has, positions, slots, query starts,
    sequence lengths, block tables, and the verify rows of a ragged step."""
    steps = plan.steps
    tables = [s.block_table for s in steps]
    # past a sequence's own blocks: the trash block, a valid id no real sequence owns (graphs read it)
    block_tables = np.full((len(steps), max(map(len, tables))), trash_block, np.int32)
    for index, table in enumerate(tables):
        block_tables[index, : len(table)] = table
    arrays = _one_token_arrays(steps) if layout.verifies_every_row else _ragged_arrays(steps)
    arrays["block_tables"] = block_tables
    if not layout.verifies_every_row:
        arrays["verify_rows"] = layout.verify_rows(plan)  # [P, K + 1]
    return arrays


def accept_arrays(plan: StepPlan, layout: StepLayout) -> dict[str, np.ndarray]:
    """What the accept rule and the proposer read of a step's producers."""
    producers = [plan.steps[i] for i in layout.producers]
    drafts = np.zeros((len(producers), layout.max_draft), np.int64)  # [P, K]
    for p, step in enumerate(producers):
        drafts[p, : step.num_draft] = step.drafts
    return {
        "drafts": drafts,
        "num_draft": np.asarray([s.num_draft for s in producers], np.int64),  # [P]
        "anchor_base": np.asarray([s.start + s.num_committed - 1 for s in producers], np.int64),  # [P]
        "is_greedy": np.asarray([not s.params.samples_randomly for s in producers], np.int64),  # [P]
        "producers": np.asarray(layout.producers, np.int64),  # [P], rows of the batch's tables
    }


def _query_tokens(step: SeqStep) -> list[int]:
    """The step's query tokens as the host writes them: a token the pool gives (`from_pool`) is 0
    here until the worker copies the pool's in, on the device."""
    return [0, *step.tokens] if step.from_pool else step.tokens


def _ragged_arrays(steps: list[SeqStep]) -> dict[str, np.ndarray]:
    """A step's query tokens, positions, slots, query starts and sequence lengths, for queries of any
    length; a position is its row plus its sequence's offset."""
    lengths = np.asarray([s.num_query for s in steps], np.int64)  # [B]
    query_start = np.zeros(len(steps) + 1, np.int32)  # [B + 1]
    query_start[1:] = np.cumsum(lengths)
    num_tokens = int(query_start[-1])
    offsets = np.asarray([s.start for s in steps], np.int64) - query_start[:-1]  # [B]
    return {
        "input_ids": np.fromiter(itertools.chain.from_iterable(map(_query_tokens, steps)), np.int64, num_tokens),  # [T]
        "positions": np.arange(num_tokens, dtype=np.int64) + np.repeat(offsets, lengths),  # [T]
        "slots": _flat_slots(steps),  # [T]
        "query_start_loc": query_start,
        "seq_lens": (lengths + [s.start for s in steps]).astype(np.int32),  # [B]
    }


def _one_token_arrays(steps: list[SeqStep]) -> dict[str, np.ndarray]:
    """`_ragged_arrays` where every query is one token (a decode step, T = B): a position is its
    sequence's start, a query starts at its row, each read in one pass. Its tokens come from the
    pool where every one does (a decode step: no `input_ids` then)."""
    num_steps = len(steps)
    positions = np.fromiter([s.start for s in steps], np.int64, num_steps)  # [B]
    arrays = {
        "positions": positions,
        "slots": np.fromiter([s.slots[0] for s in steps], np.int64, num_steps),  # [B]
        "query_start_loc": np.arange(num_steps + 1, dtype=np.int32),
        "seq_lens": (positions + 1).astype(np.int32),  # [B]
    }
    if not all(s.from_pool for s in steps):
        arrays["input_ids"] = np.fromiter([_query_tokens(s)[0] for s in steps], np.int64, num_steps)  # [B]
    return arrays


def _flat_slots(steps: list[SeqStep]) -> np.ndarray:
    if all(isinstance(s.slots, list) for s in steps):
        return np.asarray([slot for s in steps for slot in s.slots], np.int64)
    return np.concatenate([np.asarray(s.slots, np.int64) for s in steps])
