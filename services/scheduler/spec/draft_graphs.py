"""DSpark's `propose`, replayed from CUDA graphs for greedy batches.

An eager propose launches a few hundred small kernels (5 draft layers, the LM head over the block,
the Markov head's left-to-right loop); at small batch that launch time, not the GPU, is the
drafter's cost. `DSparkProposer.draft` is device work whose shapes are fixed by its inputs'
shapes, so one graph per (batch rung, context-block bucket) captures it: the batch is padded up to
the rung (padded rows: anchor 0 at position 0, every block the trash block), the context blocks
up to the bucket (extra blocks are masked by the anchor position, as any block past it is). With a
context window that binds, every row reads the same W / block_size + 1 blocks at any context length:
that is the bucket, unrounded.
Graphs are captured on first use. Batches with sampled rows stay eager (their q [B, gamma, V]
outputs would make every graph hundreds of MB). With `capture=False` (the CPU twin CI tests) the
same padded inputs run eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace

import structlog
import torch

from services.scheduler.model.graphs import capture_graph
from services.scheduler.spec.base import ContextRows, DraftProposal, DraftRequest
from services.scheduler.spec.dspark import DraftInputs, DSparkProposer

log = structlog.get_logger(__name__)

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class _Graph:
    inputs: DraftInputs  # static input buffers
    output: DraftProposal  # static outputs
    graph: torch.cuda.CUDAGraph | None


class DraftGraphs:
    """A `Proposer` that wraps a `DSparkProposer` and replays its greedy drafts from graphs."""

    def __init__(self, proposer: DSparkProposer, capture: bool = True, ladder: tuple[int, ...] = BATCH_LADDER) -> None:
        self.proposer = proposer
        self.num_draft_tokens = proposer.num_draft_tokens
        self.capture_layers = proposer.capture_layers
        self.has_confidence = proposer.has_confidence
        self.capture = capture
        self.ladder = ladder
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def inject(self, context: ContextRows) -> None:
        self.proposer.inject(context)

    def drop_graphs(self) -> None:
        """Graphs read the drafter's storage where it was when captured: after it moved, capture again on use."""
        self._graphs.clear()

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> DraftProposal:
        batch = len(request.rids)
        if batch > self.ladder[-1] or any(t > 0 for t in request.temperatures):
            return self.proposer.propose(request)
        size = self.proposer.kv_cache.block_size
        count = self.proposer.context_block_count(request.max_anchor_position)
        bucket = count if self.proposer.window_binds(request.max_anchor_position) else _bucket(count)  # a window: its own count
        # The bound only ever rises (to fill the bucket from the start): a lower one would cut rows' newest blocks.
        if bucket * size > request.max_anchor_position:
            request = replace(request, max_anchor_position=bucket * size)
        inputs = self.proposer.draft_inputs(request)
        rung = self.ladder[bisect.bisect_left(self.ladder, batch)]
        inputs = inputs.padded(rung, self.proposer.kv_cache.trash_block)
        inputs = _widen(inputs, bucket, self.proposer.kv_cache.trash_block)
        entry = self._graphs.get((rung, bucket)) or self._build(rung, bucket, inputs)
        _copy_into(entry.inputs, inputs)
        if entry.graph is not None:
            entry.graph.replay()
            output = entry.output
        else:
            output = self.proposer.draft(entry.inputs)
        return _head(output, batch)

    def _build(self, rung: int, bucket: int, example: DraftInputs) -> _Graph:
        static = DraftInputs(**{f.name: _clone(getattr(example, f.name)) for f in fields(DraftInputs)})
        graph, output = None, DraftProposal(torch.empty(0), None)
        if self.capture:
            try:
                graph, output = self._capture(static)
            except RuntimeError as exc:  # something in draft() cannot be captured: stay eager, say so once
                log.warning("dspark.draft_graphs_off", error=str(exc))
                self.capture, graph = False, None
        entry = self._graphs[(rung, bucket)] = _Graph(static, output, graph)
        if graph is not None:  # captured on first use, so one line each rather than a bar
            log.info("dspark.draft_graph_captured", rung=rung, context_blocks=bucket, graphs=len(self._graphs))
        return entry

    def _capture(self, static: DraftInputs) -> tuple[torch.cuda.CUDAGraph, DraftProposal]:
        graph, output = capture_graph(lambda: self.proposer.draft(static), self._pool)
        self._pool = graph.pool()
        return graph, output


def _bucket(num_blocks: int) -> int:
    """Context blocks rounded up: powers of two up to 64, then multiples of 64 (few graphs, little waste)."""
    if num_blocks <= 64:
        return 1 << max(0, (num_blocks - 1).bit_length())
    return -(-num_blocks // 64) * 64


def _widen(inputs: DraftInputs, bucket: int, trash_block: int) -> DraftInputs:
    blocks = inputs.context_blocks
    if blocks.shape[1] >= bucket:
        return replace(inputs, context_blocks=blocks[:, :bucket])
    extra = torch.full((blocks.shape[0], bucket - blocks.shape[1]), trash_block, dtype=blocks.dtype, device=blocks.device)
    return replace(inputs, context_blocks=torch.cat((blocks, extra), dim=1))


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _copy_into(static: DraftInputs, inputs: DraftInputs) -> None:
    for f in fields(DraftInputs):
        target = getattr(static, f.name)
        if target is not None:
            target.copy_(getattr(inputs, f.name))


def _head(output: DraftProposal, batch: int) -> DraftProposal:
    confidence = None if output.confidence is None else output.confidence[:batch].clone()
    return DraftProposal(output.tokens[:batch].clone(), None, confidence)
