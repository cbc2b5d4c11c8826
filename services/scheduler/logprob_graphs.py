"""Output logprobs (rows of a step's computed logits) replayed from CUDA graphs.

The eager path (`logprobs_on_device`) launches ~27 ops per step whatever the batch; at 1-64 rows
that launch time, not the GPU, is its cost. Its device work (`logprob_columns`: the distribution,
the targets' gather, top-k, the requested ids' gather) has shapes fixed by the rows, k, the ids'
width and which processed-mode inputs are present, so one graph per key (row rung, k rung, ids
rung, mode and inputs present) captures it over static buffers:

- inputs, shared by the keys of a row rung: logits f32 [R, V] (each step gathers its rows of the
  source logits into it, one index_select or copy: the source tensor is new every step; a copy the
  eager path, reading the source in place, does not pay), targets int64 [R], ids int64 [R, M],
  and in processed mode the per-row parameters [R] present;
- rows n..R-1 (and ids columns m..M-1) keep what an earlier step left there (at first: zeros and
  neutral sampling parameters), always valid inputs; every op is per row, so they change nothing
  in rows 0..n-1, and the result is the views [:n, :k] and [:n, :m].

Exact against the eager path, bit for bit: the same ops (torch's, or the fused kernels' where
`logprobs.runs_fused` picks them, each per row, and faster replayed than launched eagerly) on the
same rows; the top-K's first k columns are the top-k (its order, logprob descending and ties by the
smaller id, is total); the ids' gather's first m columns are the m requested. Keys off the
ladders (k > 20, more than 16 ids, more rows than `max_rows` or than one eager chunk) and keys past
`max_graphs` run eagerly. Graphs are captured on first use of a key, all in one memory pool. With
`capture=False` (the CPU twin CI tests) the same padded path runs eagerly. Prompt logprobs (LM head
over hidden states, up to a whole prompt's rows) stay on the eager chunked path.

`greedy` serves the commonest step with output logprobs: a plain greedy decode graph step whose
every sequence wants them. Its graph (keyed also by the decode graph's static logits, which it reads
in place: no rows copied in) takes each row's argmax too, the step's token, as its target (with the
fused kernels, in their first pass over the row: no argmax kernel of its own), and
writes tokens and columns into one buffer (each column 16-byte aligned, a few words of padding
between them: `_packed_buffer`), which `HostReadback` reads back as one part (`add_packed`): a
step launches two copies (logits rows, targets), an argmax and a concatenation fewer than `_verify`'s
argmax and `compute`, the host's time that bounds a small model's batch-1 decode through the stack.
Served by default (`--no-greedy-logprob-graphs` turns it off): it gives the same tokens and arrays
bit for bit, for less host time a step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import structlog
import torch

from services.scheduler.host_io import PackedView
from services.scheduler.logprobs import (
    SAMPLING_INPUTS,
    LogprobQuery,
    TopKKeys,
    logprob_columns,
    logprobs_on_device,
    max_chunk_rows,
)
from services.scheduler.model.graphs import capture_graph
from services.common.logprob_rows import RowLogprobs
from services.scheduler.sampler import TOP_K_OFF

log = structlog.get_logger(__name__)

ROW_LADDER = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)  # at most 1.5x padded rows past 64
K_LADDER = (0, 1, 5, 10, 20)
IDS_LADDER = (0, 1, 2, 4, 8, 16)
MAX_GRAPHS = 32
# More rows are device-bound (top-k over [rows, V]): a graph saves them nothing, and their static
# logits + pool (~1.5 GB at the 8B vocabulary) would sit outside the KV-cache reserve. Up to 128
# rows the static logits are ~78 MB.
DEFAULT_MAX_ROWS = 128
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_k": TOP_K_OFF, "top_p": 1.0, "min_p": 0.0}  # padded rows, at first


@dataclass(frozen=True)
class _Key:
    rows: int  # R
    k: int  # K
    num_ids: int  # M
    sampling: tuple[str, ...] | None  # None: raw mode; else processed mode's inputs present
    source: int = 0  # 0: `compute`'s (rows copied into static logits); else `greedy`'s (GREEDY_TWIN, or the source's address)


GREEDY_TWIN = 1  # the source of every uncaptured `greedy` key: the twin reads each call's logits


@dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]  # static: logits [R, V], targets [R] (not greedy), ids [R, M] (M > 0), sampling [R] each
    output: RowLogprobs[torch.Tensor] | None  # static: token [R], top-k [R, K] twice, ids [R, M]; None: eager
    graph: torch.cuda.CUDAGraph | None
    packed: torch.Tensor | None = None  # greedy: int32, tokens (int64) then output's columns, in order (`_packed_buffer`)
    greedy: GreedyRows | None = None  # greedy: what each call returns (views of `packed`)


class GreedyRows(NamedTuple):
    """`LogprobGraphs.greedy`'s step: its tokens and output rows, views of one buffer."""

    tokens: torch.Tensor  # int64 [R]: each row's argmax
    rows: RowLogprobs[torch.Tensor]  # token [R], top-k [R, K] twice, ids [R, M]
    packed: torch.Tensor  # int32: the buffer both are views of, padding between them
    views: tuple[PackedView, ...]  # tokens as [R, 1] (a block of one token a row), then rows' four columns


class LogprobGraphs:
    """`logprobs_on_device` for rows of given logits (no `to_logits`), replayed from graphs."""

    def __init__(self, keys: TopKKeys, capture: bool = True, max_graphs: int = MAX_GRAPHS, max_rows: int = DEFAULT_MAX_ROWS,
                 fused: bool = False, invariant: bool = False):  # fmt: skip
        """fused: `logprobs.runs_fused`'s switch, invariant: `logprobs.logprob_columns`', for the captured
        work and the eager fallback alike."""
        self.keys = keys
        self.fused = fused
        self.invariant = invariant
        self.capture = capture
        self.max_graphs = max_graphs
        self.vocab_size = keys.tied.shape[0]
        self.ladder = tuple(r for r in ROW_LADDER if r <= min(max_rows, max_chunk_rows(self.vocab_size)))
        self.num_captured = 0
        self._failed: set[_Key] = set()  # keys whose capture raised: eager, never retried
        self.capture_s = 0.0  # host seconds spent capturing (warm-up included)
        self._graphs: dict[_Key, _Graph] = {}
        # `greedy`'s calls by (rows, k, ids, sampling inputs, source) -> their key and graph: a decode
        # step asks the same every step, and working its key out again (rungs, `replace`, a dataclass
        # hash) costs far more host time than this lookup
        self._greedy_calls: dict[tuple, tuple[_Key, _Graph]] = {}
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # static inputs by (name, shape)
        self._pool = None

    def compute(
        self,
        queries: list[LogprobQuery],
        inputs: dict[str, torch.Tensor],
        logits: torch.Tensor,
        processed: bool,
        sampled: torch.Tensor | None = None,
    ) -> RowLogprobs[torch.Tensor] | None:
        """Equal to `logprobs_on_device(queries, inputs, logits, None, keys, processed, sampled)`.
        logits: f32 [N, V]; the result's columns are views of static outputs, valid until the next call."""
        num_rows = sum(len(q.rows) for q in queries)
        k = min(max((q.top_k for q in queries), default=0), self.vocab_size)  # the eager path's widths
        m = inputs["ids"].shape[1] if "ids" in inputs else 0
        sampling = tuple(name for name in SAMPLING_INPUTS if name in inputs) if processed else None
        key = self._key(num_rows, k, m, sampling)
        entry = None if key is None or key in self._failed else self._graphs.get(key) or self._build(key)
        if entry is None:
            return logprobs_on_device(queries, inputs, logits, None, self.keys, processed, sampled, self.fused, invariant=self.invariant)
        _fill(entry.inputs, inputs, logits, sampled, num_rows)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.output
        else:
            out = RowLogprobs(*_columns(entry.inputs, key, self.keys, self.fused, self.invariant))
        return RowLogprobs(out.token[:num_rows], out.top_values[:num_rows, :k], out.top_ids[:num_rows, :k], out.ids[:num_rows, :m])

    def greedy(
        self, queries: list[LogprobQuery], inputs: dict[str, torch.Tensor], static_logits: torch.Tensor, processed: bool
    ) -> GreedyRows | None:
        """A plain greedy decode step's tokens and output rows, when its every row (in order: `inputs`
        holds no rows and no targets) wants logprobs and its logits are a decode graph's static
        logits [R, V] (`ForwardOutput.static_logits`). Returns tokens int64 [R] (each row's argmax,
        the step's token) and the rows, both padded: R rows, the rungs' K and M columns (rows past the
        step's and columns past what it asked hold padding, which `split_logprobs` and the worker's
        results never read), all views of one buffer in that order, valid until the next call. Equal
        to `compute` given the same argmax, bit for bit. None: off the ladders or past max_graphs."""
        num_rows = static_logits.shape[0]
        k = min(max((q.top_k for q in queries), default=0), self.vocab_size)
        m = inputs["ids"].shape[1] if "ids" in inputs else 0
        sampling = tuple(name for name in SAMPLING_INPUTS if name in inputs) if processed else None
        source = static_logits.data_ptr() if self.capture else GREEDY_TWIN  # a captured graph reads that buffer
        call = (num_rows, k, m, sampling, source)
        found = self._greedy_calls.get(call) or self._greedy_graph(call, static_logits)
        if found is None:
            return None
        key, entry = found
        if not self.capture:
            entry.inputs["logits"] = static_logits
        _fill_parameters(entry.inputs, inputs, sum(len(q.rows) for q in queries))
        if entry.graph is not None:
            entry.graph.replay()
        else:
            _greedy_columns(entry, key, self.keys, self.fused, self.invariant)
        return entry.greedy

    def _greedy_graph(self, call: tuple, static_logits: torch.Tensor) -> tuple[_Key, _Graph] | None:
        """`greedy`'s key and graph for a call not seen before (built or captured now), kept for the
        calls after it; None: off the ladders, failed, or past max_graphs (not kept: asked again)."""
        num_rows, k, m, sampling, source = call
        key = self._key(num_rows, k, m, sampling)
        if key is None or num_rows > self.ladder[-1]:
            return None
        key = replace(key, rows=num_rows, source=source)  # the source's rows: a decode rung, no row rung of ours
        entry = None if key in self._failed else self._graphs.get(key) or self._build(key, static_logits)
        if entry is None:
            return None
        self._greedy_calls[call] = key, entry
        return key, entry

    def _key(self, num_rows: int, k: int, num_ids: int, sampling: tuple[str, ...] | None) -> _Key | None:
        """None: eager (no rows, or a size off the ladders)."""
        rungs = (_rung(self.ladder, num_rows), _rung(K_LADDER, k), _rung(IDS_LADDER, num_ids))
        if num_rows == 0 or None in rungs or rungs[1] > self.vocab_size:
            return None
        return _Key(*rungs, sampling)

    def _build(self, key: _Key, greedy_source: torch.Tensor | None = None) -> _Graph | None:
        if len(self._graphs) >= self.max_graphs:
            return None
        entry = self._graphs[key] = _Graph(self._static_inputs(key, greedy_source), None, None)
        views = ()
        if greedy_source is not None:
            entry.packed, entry.output, views = _packed_buffer(key, greedy_source.device)
        if self.capture:
            start = time.perf_counter()
            try:
                entry.graph, entry.output = self._capture(entry, key)
            except RuntimeError as exc:  # this key stays on the unpadded eager path (cheaper than the padded one)
                log.warning("logprob_graph_capture_failed", rows=key.rows, k=key.k, ids=key.num_ids, error=str(exc))
                del self._graphs[key]
                self._failed.add(key)
                return None
            self.num_captured += 1
            self.capture_s += time.perf_counter() - start
            log.info("logprob_graph_captured", rows=key.rows, k=key.k, ids=key.num_ids, sampling=key.sampling,
                     graphs=len(self._graphs), capture_ms=round(1e3 * (time.perf_counter() - start), 1))  # fmt: skip
        if entry.packed is not None:  # the capture's output is the buffer's views (`_greedy_columns` writes them)
            entry.greedy = GreedyRows(_packed_tokens(entry.packed, key.rows), entry.output, entry.packed, views)
        return entry

    def _static_inputs(self, key: _Key, greedy_source: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Shared by every key of the same row rung (one [R, V] logits buffer per rung, not per key);
        a greedy key's logits are its source, and its targets its argmax."""
        rows = key.rows
        if greedy_source is not None:
            inputs = {"logits": greedy_source}
        else:
            inputs = {"logits": self._buffer("logits", (rows, self.vocab_size), torch.float32, 0.0),
                      "targets": self._buffer("targets", (rows,), torch.int64, 0)}  # fmt: skip
        if key.num_ids:
            inputs["ids"] = self._buffer("ids", (rows, key.num_ids), torch.int64, 0)
        for name in key.sampling or ():
            inputs[name] = self._buffer(name, (rows,), torch.int64 if name == "top_k" else torch.float32, NEUTRAL_SAMPLING[name])
        return inputs

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> torch.Tensor:
        if (name, shape) not in self._buffers:
            self._buffers[name, shape] = torch.full(shape, fill, dtype=dtype, device=self.keys.tied.device)
        return self._buffers[name, shape]

    def _capture(self, entry: _Graph, key: _Key) -> tuple[torch.cuda.CUDAGraph, RowLogprobs]:
        if entry.packed is not None:
            run = lambda: _greedy_columns(entry, key, self.keys, self.fused, self.invariant)  # noqa: E731
        else:
            run = lambda: RowLogprobs(*_columns(entry.inputs, key, self.keys, self.fused, self.invariant))  # noqa: E731
        graph, output = capture_graph(run, self._pool)
        self._pool = graph.pool()
        return graph, output


def _rung(ladder: tuple[int, ...], size: int) -> int | None:
    index = bisect.bisect_left(ladder, size)
    return ladder[index] if index < len(ladder) else None


def _columns(static: dict[str, torch.Tensor], key: _Key, keys: TopKKeys, fused: bool, invariant: bool):
    sampling = None if key.sampling is None else {name: static[name] for name in key.sampling}
    return logprob_columns(static["logits"], static["targets"], key.k, static.get("ids"), sampling, keys, fused, invariant=invariant)


PACKED_ALIGN_WORDS = 4  # each column of a greedy key's buffer starts at a multiple of 16 bytes


def _packed_buffer(key: _Key, device: torch.device) -> tuple[torch.Tensor, RowLogprobs[torch.Tensor], tuple[PackedView, ...]]:
    """A greedy key's one int32 buffer, its columns' views, and where they lie (`GreedyRows.views`):
    tokens int64 [R] (2R words), then token f32 [R], top values f32 [R, K], top ids int32 [R, K], ids f32 [R, M], in that order, each
    from a multiple of 16 bytes (padding between them is never read). Triton compiles a kernel
    again for a pointer not 16-byte aligned, so unaligned columns (R = 1 or 2, any K) made the
    first step of such a rung compile the logprob kernels anew while serving; aligned, they run
    what `triton_logprobs.warm_kernels` compiled."""
    rows, k, m = key.rows, key.k, key.num_ids
    sizes = (2 * rows, rows, rows * k, rows * k, rows * m)  # int32 words
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + -(-size // PACKED_ALIGN_WORDS) * PACKED_ALIGN_WORDS)
    packed = torch.zeros(starts[-1] + sizes[-1], dtype=torch.int32, device=device)
    _, token, values, ids, requested = (packed[start : start + size] for start, size in zip(starts, sizes, strict=True))
    columns = RowLogprobs(token.view(torch.float32), values.view(torch.float32).view(rows, k), ids.view(rows, k),
                          requested.view(torch.float32).view(rows, m))  # fmt: skip
    views = [PackedView(torch.int64, (rows, 1), starts[0])]
    views += [PackedView(c.dtype, tuple(c.shape), start) for c, start in zip(columns.columns(), starts[1:], strict=True)]
    return packed, columns, tuple(views)


def _packed_tokens(packed: torch.Tensor, rows: int) -> torch.Tensor:
    return packed[: 2 * rows].view(torch.int64)


def _greedy_columns(entry: _Graph, key: _Key, keys: TopKKeys, fused: bool, invariant: bool) -> RowLogprobs[torch.Tensor]:
    """A greedy key's work: each row's argmax, then its columns with the argmax as targets, all into
    the key's buffer (what its graph captures; the twin runs it eagerly). The fused kernels take the
    argmax in their first pass over the logits (`logprob_columns`' argmax_targets)."""
    static, tokens = entry.inputs, _packed_tokens(entry.packed, key.rows)
    sampling = None if key.sampling is None else {name: static[name] for name in key.sampling}
    logprob_columns(static["logits"], tokens, key.k, static.get("ids"), sampling, keys, fused, out=entry.output.columns(),
                    argmax_targets=True, invariant=invariant)  # fmt: skip
    return entry.output


def _fill(static: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], logits: torch.Tensor,
          sampled: torch.Tensor | None, num_rows: int) -> None:  # fmt: skip
    """Copy the step's rows 0..n-1 into the static inputs (what `logprobs_on_device` reads from them)."""
    rows = inputs.get("rows")
    if rows is None:  # every row of the source, in order
        static["logits"][:num_rows].copy_(logits[:num_rows])
    else:
        torch.index_select(logits, 0, rows, out=static["logits"][:num_rows])
    targets = static["targets"][:num_rows]
    if sampled is None:
        targets.copy_(inputs["targets"])
    elif rows is None:
        targets.copy_(sampled[:num_rows])
    else:
        torch.index_select(sampled, 0, rows, out=targets)
    _fill_parameters(static, inputs, num_rows)


def _fill_parameters(static: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], num_rows: int) -> None:
    """The requested ids and the sampling parameters of rows 0..n-1 (each present only when asked)."""
    if "ids" in inputs:
        static["ids"][:num_rows, : inputs["ids"].shape[1]].copy_(inputs["ids"])
    for name in SAMPLING_INPUTS:
        if name in inputs:
            static[name][:num_rows].copy_(inputs[name])
