"""Tensor parallelism (Megatron's layout): one model sharded over the N ranks of a process group.

q/k/v and gate/up are column-parallel (each rank holds its heads' rows, its block of the
intermediate size; a mixture of experts: every expert's block, the router whole), o_proj and
down_proj row-parallel (the matching input columns) and followed by one all-reduce each
(`DecoderLayer.tp`, `MoeDecoderLayer`); KV heads split across ranks, or replicated where there
are fewer KV heads than ranks (rank r then keeps KV head r // (N / Hkv)); the embedding and the LM
head are vocabulary-parallel (rank r holds rows [r Vs, (r + 1) Vs) of Vs = ceil(V / N), the last
shard padded with zero rows). Each rank builds its model from `shard_config` (the local head
counts and intermediate size: its KV cache, kernels and plans see its own shapes), and the loader
slices every checkpoint tensor to this rank's part with `TensorParallel.shard` as it is read: a
rank never holds another rank's weights.

`TensorParallel` holds the device group (gloo on CPU, NCCL on CUDA) as an explicit object, never
torch.distributed's default group. N = 1 builds no `TensorParallel` at all: the layers' hooks are
`None` and run today's code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model.config import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "MixtralForCausalLM")
COLUMN_HEADS = ("q_proj",)  # rows in blocks of this rank's query heads
COLUMN_KV = ("k_proj", "v_proj")  # rows of this rank's KV heads
COLUMN = ("gate_proj", "up_proj", "w1", "w3")  # rows in blocks of the (each expert's) intermediate size
ROW = ("o_proj", "down_proj", "w2")  # input columns; the bias added once (rank 0) before the all-reduce
VOCAB = ("embed_tokens.weight", "lm_head.weight")


class RowDraw(msgspec.Struct, frozen=True):
    """How one sampled row picks its token (`TensorParallel.sample`), as plain values rank 0 sends."""

    temperature: float  # <= 0: greedy (the raw logits' argmax)
    seed: int | None  # the request's; None for a greedy row
    position: int  # its output position: the noise is keyed by (seed, position), as `sampler.draw_noise`'s
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # the request's (id, bias): `logits_processing.apply_id_edits`
    blocked: tuple[int, ...] = ()  # ids min_tokens holds back at this row (`logits_processing.blocked_ids`)


class TensorParallelError(ValueError):
    """A model or setting tensor parallelism cannot shard."""


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise `TensorParallelError` (one line) unless `config` can be split over `size` ranks (FP8
    checkpoints: their scales sliced with their weights, block-wise tiles never straddling ranks)."""
    if size == 1:
        return
    if config.architecture not in SUPPORTED:
        raise TensorParallelError(f"--tensor-parallel-size {size}: {config.architecture} is not sharded (supported: {', '.join(SUPPORTED)})")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    inter = config.moe_intermediate_size if config.num_experts else config.intermediate_size
    if heads % size or config.intermediate_size % size or inter % size or (kv_heads % size and size % kv_heads):
        raise TensorParallelError(
            f"--tensor-parallel-size {size} must divide the {heads} attention heads and the intermediate size "
            f"{inter}, and divide or be a multiple of the {kv_heads} KV heads"
        )
    if config.num_experts and config.quantization is not None:
        raise TensorParallelError(f"--tensor-parallel-size {size}: FP8 MoE checkpoints are not sharded yet (their expert scales)")
    _check_fp8_tiles(config, size)


def _check_fp8_tiles(config: ModelConfig, size: int) -> None:
    """Block-wise FP8: each rank's rows (q, k/v, gate/up) and input columns (o, down) whole tiles."""
    block = None if config.quantization is None else config.quantization.block
    if block is None:
        return
    local = shard_config(config, size)
    rows = (local.num_attention_heads * config.head_dim, local.num_key_value_heads * config.head_dim, local.intermediate_size)
    columns = (local.num_attention_heads * config.head_dim, local.intermediate_size)
    if any(r % block[0] for r in rows) or any(c % block[1] for c in columns):
        raise TensorParallelError(f"--tensor-parallel-size {size}: each rank's projections {rows} x {columns} are not "
                                  f"whole FP8 tiles of {block[0]} x {block[1]}")  # fmt: skip


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's shapes: its query heads, KV heads (at least one) and intermediate block (each
    expert's too: every rank holds every expert's block, the router whole); the vocabulary stays whole."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
    )


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group, the group's collectives and the slicing of checkpoint tensors."""

    rank: int
    size: int
    group: object  # a torch.distributed ProcessGroup{Gloo,NCCL}, used through its own methods
    config: ModelConfig  # the whole model's
    explain: Callable[[Exception], Exception] | None = None  # a failed collective's error in the group's words (a dead rank)

    @property
    def vocab_shard(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, in place (a row-parallel projection's partial outputs)."""
        self._wait(self.group.allreduce([x]))
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (KV blocks: each rank sizes its cache from its own free memory)."""
        return int(self._reduce(torch.tensor([value], dtype=torch.int64, device=device), "MIN").item())

    def whole_amax(self, projection: str, amax: torch.Tensor) -> torch.Tensor:
        """`fp8.quantize_linears`' per-row amax [N, 1] over the whole weight: a row-parallel projection's
        rows span every rank's columns (the scale TP = 1 computes); a column-parallel one's are here."""
        return self._reduce(amax, "MAX") if projection in ROW else amax

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, Vs] shards -> the whole [N, V], the padding rows dropped."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [logits.contiguous()]))
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]

    def logprob_columns(
        self, logits: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`logprobs.logprob_columns`' raw columns (token [c], top-k values and ids [c, k], ids [c, m])
        from this rank's logits shard f32 [c, Vs], exact across shards with no whole row anywhere:
        log-sum-exp from every shard's maximum and sum, each wanted id's value from the shard that owns
        it (the others add 0), the top-k merged from every shard's own top-k (ties: the smaller id)."""
        shard = logits.shape[-1]
        global_ids = torch.arange(self.vocab_start, self.vocab_start + shard, device=logits.device)
        logits = logits.masked_fill(global_ids >= self.config.vocab_size, float("-inf"))  # the last shard's padding
        logprobs = logits - self._log_sum_exp(logits)[:, None]  # [c, Vs]
        wanted = targets[:, None] if ids is None else torch.cat([targets[:, None], ids], dim=1)  # [c, 1 + m]
        values = self._owned(logprobs, wanted)
        if k == 0:
            no_ids = torch.empty(logits.shape[0], 0, dtype=torch.int32, device=logits.device)
            return values[:, 0], logprobs[:, :0], no_ids, values[:, 1:]
        return values[:, 0], *self._merged_top_k(logprobs, global_ids, k), values[:, 1:]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [c]: the whole rows' first argmax, from this rank's shard [c, Vs] (every rank gets it)."""
        return self.sample(logits, (RowDraw(0.0, None, 0),) * logits.shape[0])

    def sample(self, logits: torch.Tensor, draws: tuple[RowDraw, ...]) -> torch.Tensor:
        """Token ids int64 [c] drawn from this rank's logits shard f32 [c, Vs] (every rank gets them),
        the very tokens TP = 1 draws from whole rows (`accept` with no drafts), after the rows' per-id
        edits (logit bias, min_tokens), each shard editing the ids it holds: greedy rows the first
        argmax, sampled rows the exponential race argmax(w_i / E_i) on the unnormalised weights
        w = exp(logits / T - max) (`sampler.sampling_weights`) and `sampler.draw_noise`'s E, each rank
        taking its shard's columns of the row's noise (keyed by seed, position and global id). The
        maximum is exact over shards and no sum enters w, so every w_i / E_i and the winner are bitwise
        TP = 1's. Only each shard's winner (value, id) and the maximum cross ranks; top-k from the
        merged per-shard top-k, min-p from w's largest, exactly 1. Top-p needs the sorted whole row:
        the worker gathers those rows instead (`worker/layout.ShardSplit`)."""
        from services.scheduler.logits_processing import apply_id_edits

        global_ids = torch.arange(self.vocab_start, self.vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(global_ids >= self.config.vocab_size, float("-inf"))  # the last shard's padding
        if any(d.logit_bias or d.blocked for d in draws):
            logits = apply_id_edits(logits, [d.logit_bias for d in draws], [d.blocked for d in draws], self.vocab_start)
        greedy = self._merged_argmax(logits, global_ids)  # [c]
        if all(d.temperature <= 0 for d in draws):
            return greedy
        sampled = self._merged_argmax(self._race_scores(logits, draws, global_ids), global_ids)
        is_greedy = torch.tensor([d.temperature <= 0 for d in draws], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)

    def _race_scores(self, logits: torch.Tensor, draws: tuple[RowDraw, ...], global_ids: torch.Tensor) -> torch.Tensor:
        """w_i / E_i over this shard [c, Vs]: w = exp(logits / T - the row's maximum) after top-k and min-p (0 where they drop i)."""
        from services.scheduler.sampler import draw_noise, exp_from_max

        device = logits.device
        temps = torch.tensor([max(d.temperature, 1e-6) for d in draws], device=device)  # [c], as `sampling_weights`
        scaled = logits / temps[:, None]  # [c, Vs]
        weights = exp_from_max(scaled, self._reduce(scaled.amax(dim=-1), "MAX"))  # the whole row's maximum
        weights = weights.masked_fill(self._filtered_out(weights, draws, global_ids), 0.0)
        seeds = [d.seed if d.temperature > 0 else None for d in draws]
        noise, _ = draw_noise(seeds, [d.position for d in draws], 0, self.config.vocab_size, device)  # [c, V]
        noise = F.pad(noise, (0, self.size * self.vocab_shard - noise.shape[1]), value=1.0)
        return weights / noise[:, self.vocab_start : self.vocab_start + logits.shape[-1]]

    def _filtered_out(self, weights: torch.Tensor, draws: tuple[RowDraw, ...], global_ids: torch.Tensor) -> torch.Tensor:
        """bool [c, Vs]: what `sampler.filtered_out` drops of the whole row (top-p aside): below min_p times
        the row's largest w (exactly 1: exp(0)), or past the top_k-th in (w descending, id ascending) order."""
        device = weights.device
        drop = torch.zeros_like(weights, dtype=torch.bool)
        if any(d.min_p > 0 for d in draws):
            drop |= weights < torch.tensor([d.min_p for d in draws], device=device)[:, None]
        ks = [min(d.top_k, self.config.vocab_size) if d.top_k > 0 else 0 for d in draws]
        if max(ks) == 0:
            return drop
        values, ids = self._merged_top_k(weights, global_ids, max(ks))  # [c, K]
        kth = torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None]  # [c, 1]
        kth_value, kth_id = values.gather(1, kth), ids.gather(1, kth).long()  # [c, 1]
        past_k = (weights < kth_value) | ((weights == kth_value) & (global_ids[None, :] > kth_id))
        return drop | (past_k & torch.tensor([k > 0 for k in ks], device=device)[:, None])

    def _merged_argmax(self, values: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
        """int64 [c]: the global argmax of rows sharded [c, Vs], the smallest id among equal maxima
        (`torch.argmax`'s first one: shards hold ascending id ranges)."""
        local = values.argmax(dim=-1)  # [c]
        best = values.gather(1, local[:, None])[:, 0]
        stats = self._gather(torch.stack([best, global_ids[local].to(values.dtype)]))  # [N, 2, c]; ids < 2^24 exact
        winner = stats[:, 0].argmax(dim=0)  # [c], the first rank holding the maximum
        return stats[:, 1].gather(0, winner[None])[0].long()

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """x reduced over ranks (a new tensor; x is left as it was)."""
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = getattr(dist.ReduceOp, op)
        out = x.clone()
        self._wait(self.group.allreduce([out], options))
        return out

    def _log_sum_exp(self, logits: torch.Tensor) -> torch.Tensor:
        """[c] over the whole vocabulary, from every shard's maximum and sum of exp(logit - maximum)."""
        local_max = logits.max(dim=-1).values  # [c]
        stats = self._gather(torch.stack([local_max, torch.exp(logits - local_max[:, None]).sum(dim=-1)]))  # [N, 2, c]
        top = stats[:, 0].max(dim=0).values
        return top + torch.log((stats[:, 1] * torch.exp(stats[:, 0] - top)).sum(dim=0))

    def _owned(self, logprobs: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """The logprob of each wanted id [c, w], from the shard that owns it (every other shard adds 0)."""
        shard = logprobs.shape[-1]
        local = wanted - self.vocab_start
        mine = (local >= 0) & (local < shard)
        return self.all_reduce(torch.where(mine, logprobs.gather(1, local.clamp(0, shard - 1)), 0.0))

    def _merged_top_k(self, logprobs: torch.Tensor, global_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """values f32 [c, k], ids int32 [c, k] over the whole vocabulary: descending, ties by the smaller id,
        from every shard's own top-k (the whole top-k lies among them)."""
        from services.scheduler.logprobs import TopKKeys, top_k_sorted

        keys = TopKKeys(above=((1 << 30) - global_ids).to(torch.int32), tied=(-global_ids).to(torch.int32))
        values, ids = top_k_sorted(logprobs, min(k, logprobs.shape[-1]), keys)
        candidates = torch.cat(list(self._gather(values)), dim=-1)  # [c, N k]
        candidate_ids = torch.cat(list(self._gather(ids + self.vocab_start)), dim=-1)
        by_id = candidate_ids.argsort(dim=-1, stable=True)  # then by value, stably: ties keep the smaller id first
        candidates, candidate_ids = candidates.gather(1, by_id), candidate_ids.gather(1, by_id)
        order = candidates.argsort(dim=-1, descending=True, stable=True)[:, :k]
        return candidates.gather(1, order), candidate_ids.gather(1, order).to(torch.int32)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, stacked [N, ...]."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [x.contiguous()]))
        return torch.stack(parts)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            if self.explain is None:
                raise
            raise self.explain(exc) from exc

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a Hugging Face name), given the whole of it."""
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if name.endswith(VOCAB):
            return self._vocab_rows(full)
        if parts[-1] == "weight_scale" and (proj in ROW or full.ndim == 0):
            return full  # FP8: one scale per output row (or one in all): a row-parallel rank's rows are whole
        if proj in COLUMN_HEADS:
            return _block(full, 0, self.rank, self.size)
        if proj in COLUMN_KV:
            kv_heads = self.config.num_key_value_heads
            if kv_heads >= self.size:
                return _block(full, 0, self.rank, self.size)
            return _block(full, 0, self.rank // (self.size // kv_heads), kv_heads)
        if proj in COLUMN:
            return _block(full, 0, self.rank, self.size)
        if proj in ROW:
            if parts[-1] == "bias":
                return full if self.rank == 0 else torch.zeros_like(full)
            return _block(full, 1, self.rank, self.size)
        return full  # norms: every rank's whole

    def _vocab_rows(self, full: torch.Tensor) -> torch.Tensor:
        rows = full[self.vocab_start : self.vocab_start + self.vocab_shard]
        if rows.shape[0] == self.vocab_shard:
            return rows
        return torch.cat([rows, rows.new_zeros(self.vocab_shard - rows.shape[0], *rows.shape[1:])])


def _block(full: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    return full.chunk(count, dim=dim)[index]  # `check_shardable` made every split even


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + Vs) of the embedding; other ids look up zeros, and the all-reduce makes every row whole."""

    def __init__(self, tp: TensorParallel, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.vocab_shard, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.tp.vocab_start
        mine = (local >= 0) & (local < self.tp.vocab_shard)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ShardedRows:
    """Hidden rows [c, H] through a vocabulary-sharded LM head, every rank's shard taking part: their
    raw logprob columns (`TensorParallel.logprob_columns`; prompt and output logprobs,
    `logprobs_on_device`'s to_columns) and their sampled tokens (`TensorParallel.sample`), with no
    whole logits row anywhere. On rank 0 each call goes to the other ranks first."""

    def __init__(self, runner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def columns(
        self, hidden: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        runner = self.runner
        hidden = hidden.to(runner.device, runner.dtype)
        if runner.leader is not None:
            runner.leader.columns(hidden, targets, k, ids)
        logits = F.linear(hidden, runner.model.lm_head_weight).float()  # [c, Vs]
        return runner.model.tp.logprob_columns(logits, targets.to(runner.device), k, None if ids is None else ids.to(runner.device))

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, draws: tuple[RowDraw, ...]) -> torch.Tensor:
        """int64 [c]: each row's token, as `RowDraw` says."""
        runner = self.runner
        hidden = hidden.to(runner.device, runner.dtype)
        if runner.leader is not None:
            runner.leader.sample(hidden, draws)
        return runner.model.tp.sample(F.linear(hidden, runner.model.lm_head_weight).float(), draws)  # [c, Vs] -> [c]


def shard_model(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Swap a model built from `shard_config` (on the meta device) to vocabulary-parallel embedding
    and LM head, and hand every layer the group for its two all-reduces."""
    hidden = tp.config.hidden_size
    dtype = model.model.embed_tokens.weight.dtype
    model.model.embed_tokens = VocabParallelEmbedding(tp, hidden).to(dtype)
    if not tp.config.tie_word_embeddings:
        model.lm_head = nn.Linear(hidden, tp.vocab_shard, bias=False).to(dtype)
    for layer in model.model.layers:
        layer.tp = tp
    model.tp = tp
    return model
