"""DSpark serving: the `Proposer` the model worker calls (inject every row, propose every anchor).

The drafter owns a paged KV cache shaped like the target's (same num_blocks and block_size, one
trash block after them, the draft layers' kv heads) and addressed by the same slots and block
tables, so the target's block manager allocates for both. `inject` writes each row's context K/V
(see dspark_model: fc + RMSNorm of the captured target layers, then each draft layer's k/v
projection, k-norm and RoPE at the row's position) at the row's slot. `propose` drafts a block
from each anchor at position a: its queries read the cached context at positions < a, which are
exactly the committed tokens before the anchor (rows past a are stale and masked), or only the last
`context_window` W of them (the draft config's: what its training sequences held), plus the block's
own keys, which are never cached. With a window that binds, each row reads only the W / block_size + 1
cache blocks that hold its window (`context_start`: the position of the first), so a block costs
the same at any context length.

Drafting, per slot k = 0..gamma-1, left to right (the Markov head needs the previous draft):
logits_k = z_k + W2 W1[prev_k]; q_k = softmax(logits_k / T); greedy rows (T <= 0) take the argmax,
the others sample d_k = the first token whose cumulative q_k (float64) exceeds u_k, one uniform per
slot from `counter_rng` keyed by the row's seed: a row's drafts depend neither on the batch around
it nor on the device, and no generator object is involved (B x gamma numbers per step, capturable
in a CUDA graph). No host sync: anchors stay on the device; the host inputs are the temperatures and
seeds (uploaded without waiting) and `max_anchor_position`, which sizes how many context blocks are read.

`propose` = `draft(draft_inputs(request))`: `draft_inputs` does the uploads, `draft` only device work
whose shapes follow its inputs' (B, n context blocks, greedy or not), so it can be captured in a
CUDA graph per (B, n, greedy) with `DraftInputs.padded` rows filling B up to a captured size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.spec.base import ContextRows, DraftProposal, DraftRequest
from services.scheduler.spec.counter_rng import fold_seed, seeded_uniforms
from services.scheduler.spec.dspark_model import DSparkDrafter, block_positions


class DSparkProposer:
    def __init__(self, drafter: DSparkDrafter, num_blocks: int, block_size: int, num_draft_tokens: int | None = None,
                 context_window: int | None = None, confidence_temperature: float | None = 1.0) -> None:  # fmt: skip
        """num_blocks/block_size: the target cache's; num_draft_tokens: <= the config's block_size (default all).

        A shorter gamma still runs the whole trained block and keeps its first tokens. context_window:
        a block's queries see only the last that many context positions before its anchor; None: the
        draft config's `context_window`, 0: the whole context. confidence_temperature: the head's
        calibration (calibration.py); None: no block carries confidences (`static` reads none).
        """
        gamma = drafter.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if not 1 <= gamma <= drafter.num_draft_tokens:
            raise ValueError(f"num_draft_tokens must be in [1, {drafter.num_draft_tokens}] (the draft's block_size), got {gamma}")
        if context_window is not None and context_window < 0:
            raise ValueError(f"context_window must be >= 0 (0: the whole context), got {context_window}")
        self.context_window = drafter.config.context_window if context_window is None else context_window or None
        weight = drafter.fc.weight
        self.drafter = drafter
        self.num_draft_tokens = gamma
        self.capture_layers = drafter.config.target_layer_ids
        self.has_confidence = drafter.confidence_head is not None
        self.confidence_temperature = confidence_temperature
        self.kv_cache = PagedKVCache(drafter.config.backbone, num_blocks, block_size, weight.dtype, weight.device)
        self.leader = None  # rank_group.Leader on rank 0 of a tensor-parallel group: each propose sent to the other ranks first

    @property
    def device(self) -> torch.device:
        return self.kv_cache.kv.device

    @torch.inference_mode()
    def inject(self, context: ContextRows) -> None:
        projected = self.drafter.project_context(context.hidden.to(self.device, self.kv_cache.kv.dtype))  # [T, H]
        key_values = self.drafter.context_key_values(projected, context.positions.to(self.device))
        for layer, (key, value) in enumerate(key_values):
            self.kv_cache.write(layer, context.slots.to(self.device), key, value)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> DraftProposal:
        return self.draft(self.draft_inputs(request))

    def draft_inputs(self, request: DraftRequest) -> DraftInputs:
        """Upload the request's host fields (without waiting on the device) and cut the context blocks;
        on rank 0 of a tensor-parallel group, first send the request to the other ranks, which propose it too."""
        if self.leader is not None:
            self.leader.draft(request)
        anchors = request.anchor_positions.to(self.device)
        blocks, start = self._context_blocks(request, anchors)
        inputs = DraftInputs(
            anchor_tokens=request.anchor_tokens.to(self.device), anchor_positions=anchors, context_blocks=blocks, context_start=start
        )
        temperatures = request.temperatures
        if all(t <= 0 for t in temperatures):
            return inputs
        inputs = replace(
            inputs,
            temperatures=_to_device([t if t > 0 else 1.0 for t in temperatures], torch.float32, self.device),
            is_greedy=_to_device([t <= 0 for t in temperatures], torch.bool, self.device),
            seeds=_to_device([fold_seed(seed) for seed in request.seeds], torch.int64, self.device),
        )
        if self.drafter.tp is None:
            return inputs
        return replace(inputs, sampled_rows=_to_device([i for i, t in enumerate(temperatures) if t > 0], torch.int64, self.device))

    @torch.inference_mode()
    def draft(self, inputs: DraftInputs) -> DraftProposal:
        """Device work only, shapes fixed by the inputs' shapes: a CUDA graph can capture it per (B, n, greedy)."""
        hidden = self.block_hidden(inputs)[:, : self.num_draft_tokens]  # [B, gamma, H]
        return self._draft(hidden, inputs)

    def block_hidden(self, inputs: DraftInputs) -> torch.Tensor:
        """The drafter's final-normed block outputs [B, block_size, H] for each anchor."""
        anchors, blocks = inputs.anchor_positions, inputs.context_blocks  # [B], [B, n]
        key_positions = inputs.context_start[:, None] + torch.arange(blocks.shape[1] * self.kv_cache.block_size, device=anchors.device)
        mask = _serving_mask(anchors, key_positions, self.drafter.num_draft_tokens, self.context_window)
        x = self.drafter.block_embeddings(inputs.anchor_tokens)  # [B, G, H]
        positions = block_positions(anchors, self.drafter.num_draft_tokens)  # [B, G]

        def context(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            key_cache, value_cache = self.kv_cache.key_cache(layer), self.kv_cache.value_cache(layer)
            return key_cache[blocks].flatten(1, 2), value_cache[blocks].flatten(1, 2)  # [B, n * block_size, Hkv, D]

        return self.drafter.run_block(x, positions, context, mask)

    def window_binds(self, max_anchor_position: int) -> bool:
        """Whether rows with anchors up to max_anchor_position read fewer blocks than all those below it;
        in the deterministic mode whenever there is a window: a row's context then starts where its
        own anchor says, alone or batched (`triton_draft_attention`)."""
        if self.context_window is not None and getattr(self.drafter, "batch_invariant", False):
            return True
        return self.context_window is not None and self._window_blocks() < -(-max_anchor_position // self.kv_cache.block_size)

    def context_block_count(self, max_anchor_position: int) -> int:
        """Cache blocks a row reads for anchors up to max_anchor_position: all those below it, or, where
        the window binds, the W / block_size + 1 that hold any W consecutive positions."""
        if self.window_binds(max_anchor_position):
            return self._window_blocks()
        return -(-max_anchor_position // self.kv_cache.block_size)

    def _window_blocks(self) -> int:
        return -(-self.context_window // self.kv_cache.block_size) + 1

    def _context_blocks(self, request: DraftRequest, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's context blocks [B, n], the position of their first slot [B]), on the device."""
        # Context keys sit at positions < anchor <= max_anchor_position: that many blocks cover them.
        size, table = self.kv_cache.block_size, request.block_tables.to(self.device)
        count = self.context_block_count(request.max_anchor_position)
        if not self.window_binds(request.max_anchor_position):  # every block from the start
            return table[:, : min(count, table.shape[1])].long().clamp_min(0), torch.zeros_like(anchors)  # -1 padding: any block, masked
        first = (anchors - self.context_window).clamp_min(0) // size  # [B]: the block of each row's oldest window position
        columns = (first[:, None] + torch.arange(count, device=self.device)).clamp_max(table.shape[1] - 1)  # past the table: masked
        return table.gather(1, columns).long().clamp_min(0), first * size

    def _draft(self, hidden: torch.Tensor, inputs: DraftInputs) -> DraftProposal:
        sampler = _BlockSampler(inputs, hidden.shape[1], self.drafter.tp)
        base = self.drafter.base_logits(hidden)  # [B, gamma, V]
        prev, state = inputs.anchor_tokens, None  # state: the recurrent Markov head's
        tokens, probs = [], []
        for slot in range(hidden.shape[1]):
            bias, state = self.drafter.markov_step(prev, hidden[:, slot], state)
            token, q = sampler.draw(base[:, slot] + bias, slot)
            tokens.append(token)
            probs.append(q)
            prev = token
        tokens = torch.stack(tokens, dim=1)  # [B, gamma]
        # The confidence head needs every slot's prev only, so it runs once, after the left-to-right loop.
        prevs = torch.cat((inputs.anchor_tokens[:, None], tokens[:, :-1]), dim=1)  # [B, gamma]
        temperature = self.confidence_temperature
        confidence = None if temperature is None else self.drafter.confidence_logit(hidden, prevs)
        return DraftProposal(
            tokens=tokens,
            probs=None if sampler.all_greedy else torch.stack(probs, dim=1),
            confidence=None if confidence is None else (confidence / temperature).sigmoid(),
        )


@dataclass(frozen=True)
class DraftInputs:
    """One propose's device inputs; the sampling fields are None when every row is greedy."""

    anchor_tokens: torch.Tensor  # int64 [B]
    anchor_positions: torch.Tensor  # int64 [B]
    context_blocks: torch.Tensor  # int64 [B, n], blocks holding positions < anchor (any valid block past them)
    context_start: torch.Tensor  # int64 [B], the position of context_blocks[:, 0]'s first slot (0 without a window)
    temperatures: torch.Tensor | None = None  # f32 [B], 1.0 on greedy rows
    is_greedy: torch.Tensor | None = None  # bool [B]
    seeds: torch.Tensor | None = None  # int64 [B], each in [0, 2^32) (counter_rng.fold_seed)
    sampled_rows: torch.Tensor | None = None  # int64 [S], the rows that sample (tensor parallelism only)

    def padded(self, batch: int, block: int) -> DraftInputs:
        """Rows appended up to `batch` (a graph's size): anchor 0 at position 0, every block `block`
        (the cache's trash block); they see no context and never touch a real row's result."""
        extra = batch - self.anchor_tokens.shape[0]
        fills = {"anchor_tokens": 0, "anchor_positions": 0, "context_blocks": block, "context_start": 0, "temperatures": 1.0,
                 "is_greedy": True, "seeds": 0}  # fmt: skip
        return DraftInputs(**{name: _pad(getattr(self, name), extra, fill) for name, fill in fills.items()})


def _pad(tensor: torch.Tensor | None, extra: int, fill) -> torch.Tensor | None:
    if tensor is None:
        return None
    return torch.cat((tensor, torch.full((extra, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)))


class _BlockSampler:
    """Per-slot draws for one block: argmax for greedy rows, inverse-CDF sampling of q for the others."""

    def __init__(self, inputs: DraftInputs, gamma: int, tp=None) -> None:
        self.tp = tp  # tensor_parallel.TensorParallel where the logits are this rank's vocabulary shard
        self.all_greedy = inputs.temperatures is None
        if self.all_greedy:
            return
        self.is_greedy = inputs.is_greedy  # [B]
        self.temperatures = inputs.temperatures[:, None]  # [B, 1]
        self.uniforms = seeded_uniforms(inputs.seeds, gamma)  # f64 [B, gamma]
        self.sampled_rows = inputs.sampled_rows  # [S] under tensor parallelism

    def draw(self, logits: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits f32 [B, V] (Markov-corrected) -> (token int64 [B], q f32 [B, V] or None when all greedy)."""
        if self.tp is not None:
            return self._draw_on_shards(logits, slot)
        greedy = logits.argmax(dim=-1)
        if self.all_greedy:
            return greedy, None
        q = (logits / self.temperatures).softmax(dim=-1)  # greedy rows: softmax at T = 1, ignored by accept
        sampled = _inverse_cdf(q, self.uniforms[:, slot : slot + 1])
        return torch.where(self.is_greedy, greedy, sampled), q

    def _draw_on_shards(self, logits: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draw` from this rank's shard [B, Vs]: every row's argmax merged from the shards (no whole row),
        the sampled rows [S] alone gathered whole on every rank (their verify reads the whole q:
        max(p - q, 0)) and drawn as TP = 1 draws them, the same token on every rank; greedy rows' q are
        zeros (the accept rule reads none)."""
        greedy = self.tp.argmax(logits)  # [B]
        if self.all_greedy:
            return greedy, None
        rows = self.sampled_rows
        q_rows = (self.tp.gather_vocab(logits[rows]) / self.temperatures[rows]).softmax(dim=-1)  # [S, V]
        sampled = _inverse_cdf(q_rows, self.uniforms[rows, slot : slot + 1])
        q = q_rows.new_zeros(logits.shape[0], q_rows.shape[1]).index_copy(0, rows, q_rows)
        return greedy.index_copy(0, rows, sampled), q


def _inverse_cdf(q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """q f32 [R, V], uniforms f64 [R, 1] -> int64 [R]: the first token whose cumulative q exceeds
    u * total (zero-probability tokens are never drawn)."""
    cdf = q.double().cumsum(dim=-1)  # [R, V]; float64 so the drawn law is q to ~1e-16, not 1e-7
    point = uniforms * cdf[:, -1:]  # [R, 1]
    return torch.searchsorted(cdf, point, right=True)[:, 0].clamp_max(q.shape[1] - 1)


def _serving_mask(anchors: torch.Tensor, key_positions: torch.Tensor, gamma: int, window: int | None = None) -> torch.Tensor:
    """key_positions [B, C] -> bool [B, 1, gamma, C + gamma]: context keys at positions < anchor (and
    >= anchor - window), and the whole block."""
    batch, num_context_keys = key_positions.shape
    sees_context = key_positions < anchors[:, None]  # [B, C]
    if window is not None:
        sees_context &= key_positions >= anchors[:, None] - window
    sees_context = sees_context[:, None, :].expand(batch, gamma, num_context_keys)
    sees_block = torch.ones(batch, gamma, gamma, dtype=torch.bool, device=anchors.device)
    return torch.cat((sees_context, sees_block), dim=2)[:, None]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # no wait on the queued work
    return host
