"""Logprobs of chosen rows: the target token's, the top-k, and those of requested token ids.

Rows from many requests are computed together, in one pass over all of a step's rows (in row
chunks, so a 32k-token prompt with top-20 never holds a [32k, V] fp32 tensor at once); each request
then takes its own slice (its k and its requested ids) on the host. Top-k rows are sorted by logprob
descending, ties by the smaller token id. `raw` mode is log_softmax of the model's logits.
`processed` is the distribution the sampler draws from: logits over the request's temperature (0
counts as 1), then its top-k, top-p and min-p filters, renormalised; a filtered-out token gets
`FILTERED_LOGPROB` (JSON has no -inf; vLLM uses the same floor).

Every per-row input (row indices, targets, requested ids, processed-mode parameters) comes from the
host arrays of `logprob_inputs`, which ride in the step's one upload: the device work is a fixed
handful of ops per chunk, whatever the number of requests, their k and their ids.

Two implementations of one chunk's work, picked in one place (`runs_fused`): the torch ops below
(every mode, every device: the reference), and in raw mode with k <= `MAX_FUSED_K`, where
the caller's `fused` switch is on (the worker sets it on CUDA with Triton), the fused Triton kernels of
`triton_logprobs.py`, which read the logits in the model's dtype and write nothing of size [c, V].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from contracts.scheduler import SamplingParams
from services.common.logprob_rows import HostRows, RowLogprobs, RowSpan, are_all_rows
from services.scheduler.sampler import exp_from_max, filter_arrays, filtered_out, unfiltered

CHUNK_BYTES = 512 * 1024 * 1024  # a chunk's fp32 logprobs, at most (and 1024 rows); with its logits and the
# top-k's int32 keys and masks, a chunk holds ~4x this (the int64 temporaries of the first top-k held ~8x)
# Rows whose logits the chunk computes itself (prompt rows, through the LM head): bulk work whose
# launches are few against its FLOPs, so a smaller chunk costs little and keeps a 32k-token prompt's
# top-k within ~0.5 GiB of working memory (issue 12: <= 1 GiB extra, which 512 MiB chunks exceeded).
PROMPT_CHUNK_BYTES = 128 * 1024 * 1024
# The fused kernels' prompt chunk holds only its logits in the model's dtype (and [c, S, K_PAD] int64
# candidates): at the 8B vocabulary 1024 bf16 rows are 311 MB.
FUSED_PROMPT_CHUNK_BYTES = 320 * 1024 * 1024
MAX_CHUNK_ROWS = 1024
MAX_FUSED_K = 64  # the fused kernels' largest top-k (their per-split candidates, K_PAD, are in registers)
FILTERED_LOGPROB = -9999.0  # processed mode: tokens the request's sampling filters remove


class LogprobQuery(msgspec.Struct, frozen=True):
    """One request's rows and what it wants from each of them (a `msgspec.Struct`: one per request
    per step, built in a twentieth of a frozen dataclass's time)."""

    rows: np.ndarray  # int64 [n], rows of the step's hidden states (or of the given logits)
    targets: np.ndarray | None  # int64 [n], the token whose logprob each row gives; None: sampled this step
    top_k: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()  # used in processed mode only


@dataclass(frozen=True)
class TopKKeys:
    """int32 [V] per token id, built once per vocabulary and device (`top_k_sorted` reads them): keys
    that make one top-k over a row pick that row's top-k set, ids ascending in each of two groups."""

    above: torch.Tensor  # 2^30 - id: for logprobs above the row's k-th largest (all in the set)
    tied: torch.Tensor  # -id: for logprobs equal to it (the smallest ids fill the set), below every `above`

    @classmethod
    def build(cls, vocab_size: int, device: torch.device | str) -> TopKKeys:
        ids = torch.arange(vocab_size, dtype=torch.int32, device=device)
        return cls(above=(1 << 30) - ids, tied=-ids)


BELOW_KTH = torch.iinfo(torch.int32).min  # the key of logprobs below the k-th largest: never chosen


def top_k_sorted(logprobs: torch.Tensor, k: int, keys: TopKKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, V] -> values f32 [n, k], ids int32 [n, k]: descending, ties by the smaller id. No host sync.

    torch.topk may take any of several tied ids; the second top-k, over unique keys, takes every id
    above the k-th value and then the smallest ids equal to it, so exactly k per row (NaN rows: any k).
    """
    kth = logprobs.topk(k, dim=-1).values[:, -1:]  # [n, 1]
    key = torch.where(logprobs == kth, keys.tied, BELOW_KTH)  # [n, V]
    key = torch.where(logprobs > kth, keys.above, key)
    ids = key.topk(k, dim=-1).indices  # [n, k]: the ids above kth by id, then those tied with it by id
    values, order = logprobs.gather(1, ids).sort(dim=-1, descending=True, stable=True)  # stable: ties keep id order
    return values, ids.gather(1, order).to(torch.int32)


def logprob_inputs(
    queries: list[LogprobQuery], processed: bool = False, num_source_rows: int | None = None
) -> dict[str, np.ndarray]:
    """The host arrays `logprobs_on_device` reads (the worker sends them in the step's one upload), per row:

    - rows int64 [n]; left out when they are exactly rows 0..N-1 of a source of N = `num_source_rows`;
    - targets int64 [n], when every query's targets are on the host;
    - ids int64 [n, max_m], the requested ids padded with 0 (never read back); left out when none are asked;
    - processed mode only: temperature f32 [n] (left out when every row's is 1), and top_k int64,
      top_p f32, min_p f32 [n] (`sampler.filter_arrays`; left out when no row filters).
    """
    rows = np.concatenate([q.rows for q in queries]).astype(np.int64, copy=False) if queries else np.zeros(0, np.int64)
    if rows.size == 0:
        return {}
    counts = [len(q.rows) for q in queries]
    inputs = {} if are_all_rows(rows, num_source_rows) else {"rows": rows}
    if all(q.targets is not None for q in queries):
        inputs["targets"] = np.concatenate([q.targets for q in queries]).astype(np.int64, copy=False)
    if any(q.token_ids for q in queries):
        inputs["ids"] = np.repeat(_padded_ids(queries), counts, axis=0)  # [n, max_m]
    if processed:
        inputs |= {name: np.repeat(a, counts) for name, a in _processed_inputs(queries).items()}
    return inputs


def logprobs_on_device(
    queries: list[LogprobQuery],
    inputs: dict[str, torch.Tensor],
    source: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
    keys: TopKKeys,
    processed: bool,
    sampled: torch.Tensor | None = None,
    fused: bool = False,
    to_columns: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    invariant: bool = False,
) -> RowLogprobs[torch.Tensor] | None:
    """Every query's rows, concatenated (k padded to the largest: [n, max_k], ids to [n, max_m]), still on
    the device; computed in chunks, so a 32k-row prompt never holds [32k, V] logits. None if no rows.

    inputs: `logprob_inputs(queries, processed, ...)` on the device (in processed mode, with the sampling
    parameters). to_logits: hidden rows [c, H] -> logits [c, V] in the model's dtype (None: `source` is
    logits). sampled: int64 [N], one per row of `source`, the token sampled from it this step, for
    queries whose `targets` are None. fused: `runs_fused`'s switch. to_columns: hidden rows, targets,
    k, ids -> raw columns, where the LM head is vocabulary-sharded (`ModelRunner.sharded_rows.columns`):
    raw rows take it instead of whole logits. invariant: `logprob_columns`'.
    """
    if not queries or sum(len(q.rows) for q in queries) == 0:
        return None
    rows = inputs.get("rows")
    targets = inputs["targets"] if sampled is None else (sampled if rows is None else sampled[rows])  # [n]
    num_rows, vocab = targets.shape[0], keys.tied.shape[0]
    k = min(max(q.top_k for q in queries), vocab)
    fused_rows = runs_fused(fused, processed, k)
    chunk_rows = _chunk_rows(vocab, to_logits is not None, fused_rows, source.element_size())
    parts = []
    for start in range(0, num_rows, chunk_rows):
        chunk = slice(start, min(start + chunk_rows, num_rows))
        picked = source[chunk] if rows is None else source[rows[chunk]]
        ids = inputs["ids"][chunk] if "ids" in inputs else None
        if to_columns is not None and not processed:
            parts.append(to_columns(picked, targets[chunk], k, ids))
            continue
        logits = to_logits(picked) if to_logits is not None else picked  # [c, V]
        if not fused_rows:
            logits = logits.float()  # the torch ops work in f32: the model-dtype chunk goes now, not with the chunk
        sampling = {name: t[chunk] for name, t in inputs.items() if name in SAMPLING_INPUTS} if processed else None
        parts.append(logprob_columns(logits, targets[chunk], k, ids, sampling, keys, fused, invariant=invariant))
        del logits  # freed before the next chunk's are made: one chunk's logits at a time
    if len(parts) == 1:
        return RowLogprobs(*parts[0])
    return RowLogprobs(*(torch.cat(column) for column in zip(*parts, strict=True)))


def split_logprobs(queries: list[LogprobQuery], host: list[np.ndarray] | None) -> list[HostRows]:
    """Host copies of `logprobs_on_device(...).columns()` -> each query's own slice (its k, its ids)."""
    if host is None:
        return [_empty(q) for q in queries]
    return _split(queries, *host)


SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "min_p")  # processed mode's inputs, each present when it changes something


def max_chunk_rows(vocab_size: int, budget: int = CHUNK_BYTES, bytes_per_logit: int = 4) -> int:
    """Rows `logprobs_on_device` computes at once: given logits (verify rows) by default, else hidden states."""
    return max(1, min(MAX_CHUNK_ROWS, budget // (bytes_per_logit * vocab_size)))


def _chunk_rows(vocab_size: int, through_head: bool, fused: bool, model_bytes: int) -> int:
    """Prompt rows (through the LM head) on the fused path: a chunk holds only model-dtype logits."""
    if not through_head:
        return max_chunk_rows(vocab_size)
    return max_chunk_rows(vocab_size, FUSED_PROMPT_CHUNK_BYTES, model_bytes) if fused else max_chunk_rows(vocab_size, PROMPT_CHUNK_BYTES)


def runs_fused(fused: bool, processed: bool, k: int) -> bool:
    """The one choice of implementation: the Triton kernels where the caller's switch is on (it is only
    where Triton runs: CUDA, or the interpreter in tests), in raw mode, for k <= MAX_FUSED_K."""
    return fused and not processed and k <= MAX_FUSED_K


def logprob_columns(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    ids: torch.Tensor | None,
    sampling: dict[str, torch.Tensor] | None,
    keys: TopKKeys,
    fused: bool = False,
    out: tuple[torch.Tensor, ...] | None = None,
    argmax_targets: bool = False,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's device work: logits [c, V] (f32, or the model's dtype) -> the columns of `RowLogprobs`
    (token [c], top-k [c, k] twice, ids [c, m]). sampling: None in raw mode, else processed mode's present
    inputs [c]. fused: `runs_fused`'s switch. out: the four columns' tensors to write (the kernels
    write them as they are; the torch path copies into them), None: new ones. argmax_targets:
    targets int64 [c] is written first, each row's `torch.argmax` of the logits, then read as the
    targets (a greedy step's tokens; the kernels take it in their first pass over the row). invariant
    (`--deterministic`): the kernels split a row by the vocabulary alone, never by the row count. Every op
    is per row (what lets `LogprobGraphs` run it on padded rows), and neither path syncs with the host
    (what lets it capture them)."""
    if runs_fused(fused, sampling is not None, k):
        from services.scheduler.triton_logprobs import raw_logprob_columns

        return raw_logprob_columns(logits, targets, k, ids, out=out, argmax_targets=argmax_targets, invariant=invariant)
    if argmax_targets:
        torch.argmax(logits, dim=-1, out=targets)
    columns = _gather(_log_distribution(logits.float(), sampling), targets, k, ids, keys)
    if out is None:
        return columns
    for target, column in zip(out, columns, strict=True):
        target.copy_(column)
    return tuple(out)


def _gather(logprobs: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor | None, keys: TopKKeys):
    """logprobs f32 [c, V] -> the columns of `RowLogprobs`: token [c], top-k [c, k] twice, ids [c, m]."""
    token = logprobs.gather(1, targets[:, None])[:, 0]  # [c]
    if k > 0:
        top_values, top_ids = top_k_sorted(logprobs, k, keys)
    else:
        top_values, top_ids = logprobs[:, :0], torch.empty(logprobs.shape[0], 0, dtype=torch.int32, device=logprobs.device)
    ids_lp = logprobs.gather(1, ids) if ids is not None else logprobs[:, :0]  # [c, max_m]
    return token, top_values, top_ids, ids_lp


def _log_distribution(logits: torch.Tensor, sampling: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """Raw (`sampling` None) or processed log-probabilities of f32 logits [c, V]."""
    if sampling is None:
        return torch.log_softmax(logits, dim=-1)
    if "temperature" in sampling:
        logits = logits / sampling["temperature"][:, None]  # [c, V]
    if "top_k" in sampling:
        removed = filtered_out(exp_from_max(logits), sampling["top_k"], sampling["top_p"], sampling["min_p"])
        logits = logits.masked_fill(removed, float("-inf"))
    return torch.log_softmax(logits, dim=-1).clamp_min(FILTERED_LOGPROB)


def _padded_ids(queries: list[LogprobQuery]) -> np.ndarray:
    """int64 [num_queries, max_m]: each query's requested ids, padded with 0."""
    width = max(len(q.token_ids) for q in queries)
    return np.asarray([(*q.token_ids, *(0,) * (width - len(q.token_ids))) for q in queries], np.int64)


def _processed_inputs(queries: list[LogprobQuery]) -> dict[str, np.ndarray]:
    """Per query: the temperature (0 counts as 1) and the filters, each left out when it changes nothing."""
    temperatures = np.asarray([q.sampling.temperature if q.sampling.temperature > 0 else 1.0 for q in queries], np.float32)
    inputs = {} if (temperatures == 1.0).all() else {"temperature": temperatures}
    if not all(unfiltered(q.sampling) for q in queries):
        inputs |= filter_arrays([q.sampling for q in queries])
    return inputs


def _split(queries, token, top_values, top_ids, ids_lp) -> list[HostRows]:
    """Each query's rows: a `RowSpan` of the columns where it asked for their widths, else its rows
    cut to its own widths and copied (contiguous, as the wire sends them)."""
    columns = RowLogprobs(token, top_values, top_ids, ids_lp)
    max_k, max_m = top_values.shape[1], ids_lp.shape[1]
    out, start = [], 0
    for q in queries:
        count = len(q.rows)
        if q.top_k < max_k or len(q.token_ids) < max_m:
            end = start + count
            out.append(RowLogprobs(token[start:end], np.ascontiguousarray(top_values[start:end, : q.top_k]),
                                   np.ascontiguousarray(top_ids[start:end, : q.top_k]),
                                   np.ascontiguousarray(ids_lp[start:end, : len(q.token_ids)])))  # fmt: skip
        else:
            out.append(RowSpan(columns, start, count))
        start += count
    return out


def _empty(query: LogprobQuery) -> RowLogprobs:
    return RowLogprobs(
        token=np.zeros(0, np.float32),
        top_values=np.zeros((0, query.top_k), np.float32),
        top_ids=np.zeros((0, query.top_k), np.int32),
        ids=np.zeros((0, len(query.token_ids)), np.float32),
    )
