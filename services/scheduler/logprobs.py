"""Logprobs of chosen rows: the target token's, the top-k, and those of requested token ids.

Rows from many requests are computed together in row chunks, so a 32k-token prompt with top-20
never holds a [32k, V] fp32 tensor at once; each request then takes its own slice (its k and its
requested ids). Top-k rows are sorted by logprob descending, ties by the smaller token id.
`raw` mode is log_softmax of the model's logits. `processed` is the distribution the sampler
draws from: logits over the request's temperature (0 counts as 1), then its top-k, top-p and min-p
filters, renormalised; a filtered-out token gets `FILTERED_LOGPROB` (JSON has no -inf; vLLM uses
the same floor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from contracts.scheduler import SamplingParams
from services.scheduler.request import RowLogprobs
from services.scheduler.sampler import filtered_out, unfiltered

CHUNK_BYTES = 256 * 1024 * 1024  # fp32 logits held at once per chunk, at most (and 1024 rows)
MAX_CHUNK_ROWS = 1024
FILTERED_LOGPROB = -9999.0  # processed mode: tokens the request's sampling filters remove


@dataclass(frozen=True)
class LogprobQuery:
    """One request's rows and what it wants from each of them."""

    rows: np.ndarray  # int64 [n], rows of the step's hidden states (or of the given logits)
    targets: np.ndarray | None  # int64 [n], the token whose logprob each row gives; None: sampled this step
    top_k: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()  # used in processed mode only


def top_k_sorted(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, V] -> values f32 [n, k], ids int64 [n, k]: descending, ties by the smaller id. No host sync."""
    n, vocab = logprobs.shape
    if k == 0 or n == 0:
        return logprobs.new_empty(n, k), torch.empty(n, k, dtype=torch.int64, device=logprobs.device)
    kth = logprobs.topk(k, dim=-1).values[:, -1:]  # [n, 1]
    above = logprobs > kth  # [n, V]
    tied = logprobs == kth  # [n, V]
    room = k - above.sum(dim=-1, keepdim=True)  # [n, 1]: how many tied ids fit, lowest ids first
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))  # exactly k per row (NaN rows: none)
    # The chosen ids in ascending order, without nonzero() (a host sync): smaller ids get larger keys.
    key = chosen.long() * (vocab - torch.arange(vocab, device=logprobs.device))  # [n, V]
    ids = key.topk(k, dim=-1).indices.sort(dim=-1).values  # [n, k]
    values = logprobs.gather(1, ids)
    order = values.sort(dim=-1, descending=True, stable=True).indices  # stable keeps id order on ties
    return values.gather(1, order), ids.gather(1, order)


def compute_logprobs(
    queries: list[LogprobQuery],
    source: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
    vocab_size: int,
    processed: bool,
) -> list[RowLogprobs]:
    """`source` is hidden states [N, H] (then `to_logits` maps rows to f32 logits) or logits [N, V]."""
    inputs = {name: torch.from_numpy(a).to(source.device) for name, a in logprob_inputs(queries).items()}
    on_device = logprobs_on_device(queries, inputs, source, to_logits, vocab_size, processed)
    host = [t.cpu().numpy() for t in on_device.columns()] if on_device is not None else None
    return split_logprobs(queries, host)


def logprob_inputs(queries: list[LogprobQuery]) -> dict[str, np.ndarray]:
    """The host arrays `logprobs_on_device` reads (the worker sends them in the step's one upload):
    rows int64 [n], requested ids int64 [n, max_m] (-1 = not asked), targets int64 [n] when every
    query's targets are on the host."""
    rows = np.concatenate([q.rows for q in queries]).astype(np.int64) if queries else np.zeros(0, np.int64)
    if rows.size == 0:
        return {}
    inputs = {"rows": rows, "ids": _padded_ids(queries)}
    if all(q.targets is not None for q in queries):
        inputs["targets"] = np.concatenate([q.targets for q in queries]).astype(np.int64)
    return inputs


def logprobs_on_device(
    queries: list[LogprobQuery],
    inputs: dict[str, torch.Tensor],
    source: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
    vocab_size: int,
    processed: bool,
    targets: torch.Tensor | None = None,
) -> RowLogprobs[torch.Tensor] | None:
    """Every query's rows, concatenated (k padded to the largest: [n, max_k], ids to [n, max_m]), still on
    the device; computed in chunks, so a 32k-row prompt never holds [32k, V] logits. None if no rows.

    inputs: `logprob_inputs(queries)` on the device. targets: int64 [n] on the device, for queries
    whose targets were sampled this step (their `targets` is None).
    """
    if not inputs:
        return None
    targets = inputs["targets"] if targets is None else targets
    sampling = [q.sampling if processed else None for q in queries for _ in range(len(q.rows))]  # [n]
    max_k = max(q.top_k for q in queries)
    ids, row_index = inputs["ids"], inputs["rows"]
    num_rows = row_index.shape[0]
    chunk_rows = max(1, min(MAX_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab_size)))
    parts = []
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        rows_logprobs = _RowsLogprobs(source, to_logits, sampling[start:end])
        parts.append(rows_logprobs.gather(row_index[start:end], targets[start:end], max_k, ids[start:end]))
    return RowLogprobs(*(torch.cat(column) for column in zip(*parts, strict=True)))


def split_logprobs(queries: list[LogprobQuery], host: list[np.ndarray] | None) -> list[RowLogprobs]:
    """Host copies of `logprobs_on_device(...).columns()` -> each query's own slice (its k, its ids)."""
    if host is None:
        return [_empty(q) for q in queries]
    return _split(queries, *host)


@dataclass(frozen=True)
class _RowsLogprobs:
    """One chunk of rows: their logits, the (raw or processed) log-distribution, the gathers."""

    source: torch.Tensor
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None
    sampling: list[SamplingParams | None]  # [c]; None = raw

    def gather(
        self, rows: torch.Tensor, targets: torch.Tensor, max_k: int, ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        picked = self.source[rows]
        logits = self.to_logits(picked) if self.to_logits is not None else picked.float()  # [c, V]
        logprobs = self._log_distribution(logits.float())  # [c, V]
        token = logprobs.gather(1, targets[:, None].long().clamp_min(0))[:, 0]  # [c]
        top_values, top_ids = top_k_sorted(logprobs, min(max_k, logprobs.shape[1]))
        ids_lp = logprobs.gather(1, ids.clamp_min(0))  # [c, max_m]
        return token, top_values, top_ids.to(torch.int32), ids_lp

    def _log_distribution(self, logits: torch.Tensor) -> torch.Tensor:
        if all(params is None for params in self.sampling):
            return torch.log_softmax(logits, dim=-1)
        params = [p or SamplingParams(temperature=1.0) for p in self.sampling]
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
        logits = logits / temps[:, None]  # [c, V]
        if not all(unfiltered(p) for p in params):
            logits = logits.masked_fill(filtered_out(torch.softmax(logits, dim=-1), params), float("-inf"))
        return torch.log_softmax(logits, dim=-1).clamp_min(FILTERED_LOGPROB)


def _padded_ids(queries: list[LogprobQuery]) -> np.ndarray:
    width = max(len(q.token_ids) for q in queries)
    blocks = []
    for q in queries:
        block = np.full((len(q.rows), width), -1, np.int64)  # [n_q, max_m], -1 = not asked
        block[:, : len(q.token_ids)] = np.asarray(q.token_ids, np.int64)
        blocks.append(block)
    return np.concatenate(blocks)


def _split(queries, token, top_values, top_ids, ids_lp) -> list[RowLogprobs]:
    out, start = [], 0
    for q in queries:
        end = start + len(q.rows)
        m = len(q.token_ids)
        out.append(
            RowLogprobs(
                token=token[start:end],
                top_values=np.ascontiguousarray(top_values[start:end, : q.top_k]),
                top_ids=np.ascontiguousarray(top_ids[start:end, : q.top_k]),
                ids=np.ascontiguousarray(ids_lp[start:end, :m]),
            )
        )
        start = end
    return out


def _empty(query: LogprobQuery) -> RowLogprobs:
    return RowLogprobs(
        token=np.zeros(0, np.float32),
        top_values=np.zeros((0, query.top_k), np.float32),
        top_ids=np.zeros((0, query.top_k), np.int32),
        ids=np.zeros((0, len(query.token_ids)), np.float32),
    )
