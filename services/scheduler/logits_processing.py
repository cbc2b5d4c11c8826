"""Result-changing logit processors, as pure torch functions over a batch of rows.

Applied to the target's raw logits f32 [B, V] before temperature, top-k/top-p/min-p and the
draw, in vLLM's order, each row with its own parameters:

1. `logit_bias` (OpenAI): `l[t] += bias[t]` for the listed token ids.
2. `min_tokens`: while a row has produced fewer than `min_tokens` tokens, its stop tokens (EOS
   unless `ignore_eos`, and `stop_token_ids`) get `-inf`, so the row cannot finish on them.
3. `repetition_penalty` r (CTRL / Hugging Face): for every token t seen in the prompt or the
   output so far, `l[t] = l[t] / r` if `l[t] > 0` else `l[t] * r` (r > 1 discourages, r < 1
   encourages; r = 1 is the identity).
4. `frequency_penalty` f and `presence_penalty` p (OpenAI): over the output so far only,
   `l[t] -= f * count(t) + p * [count(t) > 0]`.
5. a grammar (structured output): tokens its bitmask does not allow get `-inf`
   (`apply_token_bitmask`; the bitmasks come from `grammar.GrammarMatchers`).

A row is one position a token is drawn for. Under speculative decoding the rows of one request's
verify block differ in their output so far (row j has also seen draft tokens 1..j), which is
why every row brings its own context rather than one per request.

`process_logits` reads each row's `RowContext` (the prompt's and the output's ids, as lists: the
reference, and what tests hold the processors to). The worker serves from `apply_processors` over
`ProcessorRows` instead, whose per-row counts come from each request's `PenaltyCounts`: its prompt's
ids as a device mask built once and its output's counts grown by the tokens new since the last step,
so a step's host work does not grow with the context (rebuilding both from lists each step made it
grow with every penalized request's context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from contracts.scheduler import SamplingParams
from services.scheduler.request import has_penalties, is_identity


@dataclass(frozen=True)
class RowContext:
    """What one row's processors read besides its logits."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # the request's prompt (repetition penalty)
    output_ids: Sequence[int]  # every token generated before this row (draft tokens before it included)
    eos_ids: frozenset[int] = frozenset()  # the model's EOS ids (min_tokens holds them back unless ignore_eos)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V]; rows, token_ids int64 [N], bias f32 [N] (sparse (row, id, value) triples)."""
    return logits.index_put((rows, token_ids), bias, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V]; blocked bool [B, V]: ids each row may not produce yet -> -inf."""
    return logits.masked_fill(blocked, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V]; bitmask int32 [B, ceil(V / 32)], bit t % 32 of word t // 32 set where
    token t is allowed (xgrammar's layout) -> the others -inf."""
    ones = torch.ones(8, dtype=torch.uint8, device=logits.device)
    bits = ones << torch.arange(8, dtype=torch.uint8, device=logits.device)  # [8]: 1, 2, 4, ..., 128 (made on the device: no copy)
    words = bitmask.contiguous().view(torch.uint8)  # [B, 4W]: little-endian, byte k of a word holds its bits 8k..8k+7
    allowed = (words.unsqueeze(-1) & bits).view(bitmask.shape[0], -1)[:, : logits.shape[1]]  # uint8 [B, V], 0: refused
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits f32 [B, V]; seen bool [B, V] (in the prompt or the output so far); penalty f32 [B]."""
    r = penalty[:, None].expand_as(logits)  # [B, V]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """logits f32 [B, V]; counts f32 [B, V] of each id in the output so far; frequency, presence f32 [B]."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def token_counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each id occurs in each row's list: f32 [B, V]."""
    lengths = [len(ids) for ids in rows]
    flat = torch.tensor([t for ids in rows for t in ids], dtype=torch.int64, device=device)  # [sum(lengths)]
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(lengths, device=device))
    counts = torch.zeros(len(rows), vocab, device=device)  # [B, V]
    return counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)


@dataclass(frozen=True)
class ProcessorRows:
    """What `apply_processors` reads for a batch of B rows besides their logits."""

    params: list[SamplingParams]  # [B]
    num_outputs: list[int]  # [B]: tokens generated before each row (min_tokens)
    eos_ids: list[frozenset[int]]  # [B]: the model's EOS ids (min_tokens holds them back unless ignore_eos)
    output_counts: torch.Tensor | None  # f32 [B, V] of each id in the row's output so far; None: no row has penalties
    prompt_seen: torch.Tensor | None  # bool [B, V]: in the row's prompt; None: no row has a repetition penalty

    @classmethod
    def from_contexts(cls, contexts: Sequence[RowContext], vocab: int, device: torch.device) -> ProcessorRows:
        params = [c.params for c in contexts]
        counts = seen = None
        if any(has_penalties(p) for p in params):
            counts = token_counts([c.output_ids for c in contexts], vocab, device)  # [B, V]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = token_counts([c.prompt_ids for c in contexts], vocab, device) > 0
        return cls(params, [len(c.output_ids) for c in contexts], [c.eos_ids for c in contexts], counts, seen)


class PenaltyCounts:
    """One request's penalty inputs on the device, kept across steps: the prompt's ids as a mask
    (built once) and the output's counts, grown by each step's new committed tokens (`catch_up`)."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # bool [V]
        self.prompt_seen[torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64), device=device)] = True  # no per-id Python
        self.output_counts = torch.zeros(vocab, device=device)  # f32 [V]
        self.num_counted = 0

    def catch_up(self, outputs: Sequence[int]) -> None:
        """outputs: the tokens committed past `num_counted` (in order); counted once."""
        if outputs:
            ids = torch.tensor(list(outputs), dtype=torch.int64, device=self.output_counts.device)
            self.output_counts.index_put_((ids,), torch.ones(len(ids), device=ids.device), accumulate=True)
            self.num_counted += len(ids)


@dataclass(frozen=True)
class PenalizedBlock:
    """One request's verify block, as `KeptPenalties.rows` reads it."""

    rid: str
    params: SamplingParams
    prompt_ids: Sequence[int]
    tokens: Sequence[int]  # prompt + committed outputs (+ anything after: never read), not copied
    num_outputs: int  # committed outputs before the block's first row
    drafts: Sequence[int]  # row j has seen drafts 1..j too


class KeptPenalties:
    """Each penalized request's `PenaltyCounts`, by request id, from its first step to its `release`."""

    def __init__(self) -> None:
        self._counts: dict[str, PenaltyCounts] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def release(self, rid: str) -> None:
        self._counts.pop(rid, None)

    def rows(self, blocks: Sequence[PenalizedBlock | None], width: int, vocab: int, device: torch.device):
        """`ProcessorRows`' (output_counts f32 [B * width, V], prompt_seen bool [B * width, V] or None)
        for `width` rows of each block (None: a request without penalties, zero rows), as
        `verify_row_contexts` would give them; (None, None) when no block has penalties."""
        penalized = [(b, block) for b, block in enumerate(blocks) if block is not None]
        if not penalized:
            return None, None
        counts = torch.zeros(len(blocks) * width, vocab, device=device)
        repetition = any(block.params.repetition_penalty != 1.0 for _, block in penalized)
        seen = torch.zeros(len(blocks) * width, vocab, dtype=torch.bool, device=device) if repetition else None
        draft_rows, draft_ids = [], []
        for b, block in penalized:
            state = self._counts.get(block.rid)
            if state is None:
                state = self._counts[block.rid] = PenaltyCounts(block.prompt_ids, vocab, device)
            first = len(block.prompt_ids)
            state.catch_up(block.tokens[first + state.num_counted : first + block.num_outputs])
            rows = slice(b * width, (b + 1) * width)
            counts[rows] = state.output_counts
            if seen is not None:
                seen[rows] = state.prompt_seen
            for j in range(1, width):
                draft_ids += block.drafts[:j]
                draft_rows += [b * width + j] * len(block.drafts[:j])
        if draft_rows:
            index = (torch.tensor(draft_rows, device=device), torch.tensor(draft_ids, device=device))
            counts.index_put_(index, torch.ones(len(draft_rows), device=device), accumulate=True)
        return counts, seen


def process_logits(logits: torch.Tensor, contexts: Sequence[RowContext]) -> torch.Tensor:
    """Steps 1-4 of the module docstring for every row; a new tensor, `logits` is not modified."""
    if all(is_identity(c.params) for c in contexts):
        return logits
    return apply_processors(logits, ProcessorRows.from_contexts(contexts, logits.shape[1], logits.device))


def apply_processors(logits: torch.Tensor, rows: ProcessorRows) -> torch.Tensor:
    """Steps 1-4 for every row of logits f32 [B, V]; a new tensor (or `logits` when nothing applies)."""
    if all(is_identity(p) for p in rows.params):
        return logits
    blocked = [blocked_ids(p, n, eos) for p, n, eos in zip(rows.params, rows.num_outputs, rows.eos_ids, strict=True)]
    logits = apply_id_edits(logits, [p.logit_bias for p in rows.params], blocked)
    return _penalties(logits, rows)


def apply_id_edits(
    logits: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]], blocked: Sequence[Sequence[int]], first_id: int = 0
) -> torch.Tensor:
    """Steps 1-2 (per-id edits) on logits f32 [B, Vs] holding ids [first_id, first_id + Vs): each row's
    (id, bias) pairs added, its blocked ids (`blocked_ids`) -inf; ids outside the slice skipped, so a
    vocabulary shard (`TensorParallel.sample`) edits what it holds exactly as the whole row is edited."""
    width, device = logits.shape[1], logits.device
    triples = [(row, t - first_id, b) for row, pairs in enumerate(biases) for t, b in pairs if 0 <= t - first_id < width]
    if triples:
        rows, ids, values = zip(*triples, strict=True)
        as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        logits = apply_logit_bias(logits, as_long(rows), as_long(ids), torch.tensor(values, dtype=logits.dtype, device=device))
    pairs = [(row, t - first_id) for row, ids in enumerate(blocked) for t in ids if 0 <= t - first_id < width]
    if pairs:
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask[tuple(torch.tensor(pairs, device=device).T)] = True
        logits = apply_min_tokens(logits, mask)
    return logits


def blocked_ids(params: SamplingParams, num_outputs: int, eos_ids: frozenset[int]) -> tuple[int, ...]:
    """Token ids a row may not produce yet, ascending: its stop tokens until min_tokens are out (then none)."""
    if num_outputs >= params.min_new_tokens:
        return ()
    return tuple(sorted((frozenset() if params.ignore_eos else eos_ids) | frozenset(params.stop_token_ids)))


def _penalties(logits: torch.Tensor, rows: ProcessorRows) -> torch.Tensor:
    params = rows.params
    as_float = lambda values: torch.tensor(values, dtype=logits.dtype, device=logits.device)  # noqa: E731
    if rows.output_counts is not None:
        counts = rows.output_counts  # [B, V]
        if rows.prompt_seen is not None:
            seen = (counts > 0) | rows.prompt_seen
            logits = apply_repetition_penalty(logits, seen, as_float([p.repetition_penalty for p in params]))
        frequency, presence = as_float([p.frequency_penalty for p in params]), as_float([p.presence_penalty for p in params])
        logits = apply_frequency_presence(logits, counts, frequency, presence)
    return logits


def verify_row_contexts(
    params: SamplingParams, prompt_ids: Sequence[int], outputs: Sequence[int], drafts: Sequence[int], width: int,
    eos_ids: frozenset[int],
) -> list[RowContext]:  # fmt: skip
    """The `width` rows of one request's verify block: row j follows the committed `outputs` and
    draft tokens 1..j (rows past the drafts are padding and see all of them)."""
    return [RowContext(params, prompt_ids, [*outputs, *drafts[:j]], eos_ids) for j in range(width)]
