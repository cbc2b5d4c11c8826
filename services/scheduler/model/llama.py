"""The shared decoder: Llama, Mistral, Qwen2, Qwen3 and Phi-3 as they are, Gemma 2/3 through
`gemma.py`'s overrides; ragged flattened tokens over a paged KV cache.

The Llama-shaped families differ only by `ModelConfig`: q/k/v (and o) biases, Qwen3's per-head
RMSNorm on q and k, sliding-window layers (Mistral, Phi-3, Qwen with `use_sliding_window`), RoPE
scaling (`rope.py`), tied embeddings. Parameter names match the Hugging Face checkpoints
(`model.layers.0.self_attn.q_proj.weight`, ...) through `checkpoint_tensors`: q/k/v live in one
fused `qkv_proj` and gate/up in one `gate_up_proj` (one matmul each instead of three and two, fewer
launches per decode step), and each Hugging Face name maps to a row slice of those (Phi-3 ships
them fused: `phi3.py`). A family whose layer differs subclasses the parts here (`DecoderLayer`'s
`mlp_class` is where a mixture-of-experts MLP slots in; `make_linear` where a quantized one does),
and `registry.MODEL_CLASSES` maps each config `architectures` entry to its class.

`CausalLM.fused_kernels` (the runner sets it: `ModelRunner.fused_kernels`) swaps the small ops
between the matmuls for the Triton kernels of `triton_fused.py`, with the torch code here as their
twin (same rounding): residual add + RMSNorm (`add_rms_norm`), Qwen3's q/k RMSNorm + RoPE + the
K/V write into the paged cache (`Attention.rotate_and_store`), and SiLU(gate) * up (`silu_mul`);
at one token (`GEMV_TOKENS`) the norms take the matmul after them along (`norm_linear`: q/k/v,
gate/up) and SiLU * up the down projection (`silu_linear`), as GEMVs in the same launch (FP8
projections: `Fp8Linear.norm_gemv` / `silu_gemv`), and o_proj is a GEMV of its own (`project`).
Norms whose rounding the kernels do not compute (Gemma's, `fusable` False) and other activations
than SiLU stay on the torch ops.
Layers carry the residual stream beside the sublayer output, so each add meets the norm after it:
layer l takes (its input's last sublayer output, the stream before it) and returns the same pair.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model import fp8
from services.scheduler.model.attention import AttentionPlan, DecodePlan, VarlenPlan, paged_attention, plan_attention
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.batch_invariant import Linear, invariant_linear
from services.scheduler.model.config import SLIDING, ModelConfig
from services.scheduler.model.fp8 import Fp8Linear
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.rope import apply_rope, default_inv_freq, rope_cos_sin, rope_frequencies

GEMV_TOKENS = 1  # rows that triton_fused's one-token GEMVs take when fused: a batch-1 decode step's
GLOBAL, LOCAL = "global", "local"  # RoPE tables: every layer's, and Gemma 3's sliding layers' own

Plan = AttentionPlan | DecodePlan | VarlenPlan
Ropes = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (cos, sin) [T, 1, D]


class RMSNorm(nn.Module):
    fusable = True  # triton_fused's norms compute this rounding
    unit_offset = False  # Gemma's norms multiply by (1 + weight) (`gemma.GemmaRMSNorm`)
    row_kernel = False  # `batch_invariant.set_batch_invariant`: each row by triton_fused's one-program-per-row norm

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernel:
            return norm_rows(x, self)
        # rms_norm normalises in fp32 and rounds once to x's dtype, then the weight multiplies in that
        # dtype: the reference's numerics, in 2 kernels instead of 8 (decode is launch-bound).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def norm_rows(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(x) of x [..., H] by triton_fused's norm kernel, one program per row: a row's sums never
    meet another row, whatever the batch (torch's reduction picks its split from the whole shape)."""
    from services.scheduler.model.triton_fused import add_rms_norm_triton

    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, H]
    return add_rms_norm_triton(rows, None, norm.weight, norm.eps, norm.unit_offset)[0].view(*x.shape[:-1], -1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the sum rounded once to x's dtype; residual None (the first
    layer's input): (norm(x), x). x, residual [T, H]."""
    if fused and norm.fusable:
        from services.scheduler.model.triton_fused import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, norm.weight, norm.eps)
    if residual is not None:
        x = x + residual
    return norm(x), x


def silu_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2I] = [gate | up] -> [T, I]; SiLU rounds to the dtype before the product."""
    if fused:
        from services.scheduler.model.triton_fused import silu_mul_triton

        return silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up of gate_up [T, 2I] -> [T, I]: Gemma's GeGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def takes_gemv(x: torch.Tensor, fused: bool, linear: nn.Module) -> bool:
    """Whether a matmul of x [T, K] by `linear` runs as a one-token GEMV that takes the small op before
    it along: triton_fused's for float weights, `Fp8Linear`'s (triton_fp8) where its W8A8 path runs;
    never a batch-invariant one (a row must round as it does among others)."""
    if not fused or x.shape[0] != GEMV_TOKENS or getattr(linear, "invariant", False):
        return False
    return isinstance(linear, nn.Linear) or (isinstance(linear, Fp8Linear) and fp8.fp8_matmul_available(x.device))


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, linear: nn.Module, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual) as `add_rms_norm`; fused at one token, one launch."""
    if takes_gemv(x, fused, linear) and norm.fusable:
        if isinstance(linear, Fp8Linear):
            return linear.norm_gemv(x, residual, norm.weight, norm.eps)
        from services.scheduler.model.triton_fused import norm_gemv_triton

        return norm_gemv_triton(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    normed, residual = add_rms_norm(x, residual, norm, fused)
    return linear(normed), residual


def project(x: torch.Tensor, linear: nn.Linear, fused: bool = False) -> torch.Tensor:
    """linear(x) for x [T, K]; fused at one token, the one-token GEMV (an Fp8Linear's own path already)."""
    if takes_gemv(x, fused, linear) and isinstance(linear, nn.Linear):
        from services.scheduler.model.triton_fused import gemv_triton

        return gemv_triton(x, linear.weight, linear.bias)
    return linear(x)


def silu_linear(gate_up: torch.Tensor, linear: nn.Module, fused: bool = False) -> torch.Tensor:
    """linear(SiLU(gate) * up) for gate_up [T, 2I]; fused at one token, one launch."""
    if takes_gemv(gate_up, fused, linear):
        if isinstance(linear, Fp8Linear):
            return linear.silu_gemv(gate_up)
        from services.scheduler.model.triton_fused import silu_gemv_triton

        return silu_gemv_triton(gate_up, linear.weight, linear.bias)
    return linear(silu_mul(gate_up, fused))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype (Gemma 2's logit soft-capping); cap None: x."""
    return x if cap is None else torch.tanh(x / cap) * cap


def make_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """Every projection of the decoder (a quantized checkpoint's linear would be built here)."""
    return Linear(in_features, out_features, bias=bias)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], fp32: the global layers' RoPE, or (local) Gemma 3's sliding layers'."""
    return rope_parameters(config, local)[0]


def rope_parameters(config: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies fp32 [head_dim // 2], attention factor) of the global or the local RoPE."""
    if local:
        return default_inv_freq(config.local_rope_theta or config.rope_theta, config.head_dim), 1.0
    return rope_frequencies(config.rope_scaling, config.rope_theta, config.head_dim, config.max_position_embeddings,
                            config.served_len)  # fmt: skip


class Attention(nn.Module):
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = make_linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = make_linear(q_size, config.hidden_size, config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = self.norm_class(self.head_dim, config.rms_norm_eps)
            self.k_norm = self.norm_class(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.scale
        self.window = config.layer_window(layer_index)  # 0: every key
        self.softcap = config.attn_logit_softcap or 0.0  # 0: none
        local = config.local_rope_theta is not None and config.layer_window(layer_index) > 0
        self.rope_table = LOCAL if local else GLOBAL

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from _fused_slices(self.qkv_proj, ("q_proj", "k_proj", "v_proj"), self.split_sizes)

    def forward(
        self, qkv: torch.Tensor, ropes: Ropes, batch: ForwardBatch, cache: PagedKVCache, plan: Plan, fused: bool = False,
    ) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D], the `qkv_proj` of the normed stream (the layer applies it with
        the norm: `norm_linear`) -> the o_proj output [T, H]."""
        num_tokens = qkv.shape[0]
        q = self.rotate_and_store(qkv, ropes[self.rope_table], batch.slot_mapping, cache, fused)  # [T, Hq, D]
        key_cache, value_cache = cache.key_cache(self.layer_index), cache.value_cache(self.layer_index)
        out = paged_attention(q, key_cache, value_cache, plan, self.scale, self.window, self.softcap)  # [T, Hq, D]
        return project(out.reshape(num_tokens, -1), self.o_proj, fused)

    def rotate_and_store(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor, cache: PagedKVCache,
        fused: bool = False,
    ) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], q/k normed (Qwen3) and rotated; k and v written to
        this layer's cache at `slot_mapping` (attention reads them from there)."""
        if fused and (not self.qk_norm or self.q_norm.fusable):
            from services.scheduler.model.triton_fused import rotate_and_store_triton

            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            key_cache, value_cache = cache.key_cache(self.layer_index), cache.value_cache(self.layer_index)
            return rotate_and_store_triton(qkv, *rope, slot_mapping, key_cache, value_cache, self.num_heads, norms)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # One rotation over q and k together: half the RoPE launches.
        q, k = apply_rope(torch.cat((q, k), dim=1), *rope).split((self.num_heads, self.num_kv_heads), dim=1)
        cache.write(self.layer_index, slot_mapping, k, v)
        return q


class MLP(nn.Module):
    """Gated MLP, down(act(gate) * up): SiLU (SwiGLU) or, for Gemma, tanh-GELU (GeGLU)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.silu = config.hidden_act == "silu"

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        sizes = (self.intermediate_size, self.intermediate_size)
        yield from _fused_slices(self.gate_up_proj, ("gate_proj", "up_proj"), sizes)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.down(self.gate_up_proj(x), fused)

    def down(self, gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """gate_up [T, 2I] -> [T, H]."""
        if self.silu:
            return silu_linear(gate_up, self.down_proj, fused)
        return self.down_proj(gelu_tanh_mul(gate_up))


def _fused_slices(
    fused: nn.Linear, names: tuple[str, ...], sizes: tuple[int, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint-relative name, row view of the fused parameter) for each part: weight, bias (and an
    FP8 weight's scales, `fp8.Fp8Linear.row_parts`, a row of them per `rows` output rows)."""
    parts = fused.row_parts() if hasattr(fused, "row_parts") else (("weight", fused.weight, 1), ("bias", fused.bias, 1))
    for suffix, param, rows in parts:
        if param is None:
            continue
        for name, part in zip(names, param.split([size // rows for size in sizes], dim=0)):
            yield f"{name}.{suffix}", part


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention
    mlp_class: type[nn.Module] = MLP  # a mixture of experts takes the same [T, H] -> [T, H]
    norm_class: type[nn.Module] = RMSNorm
    tp = None  # tensor_parallel.TensorParallel: sums o_proj's and down_proj's partial outputs over ranks

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_index)
        self.mlp = self.make_mlp(config, layer_index)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return self.mlp_class(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ropes: Ropes, batch: ForwardBatch,
        cache: PagedKVCache, plan: Plan, fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the stream before it); their sum is the layer's
        output. residual None: x is the whole stream (the embeddings, or a layer output made whole)."""
        qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj, fused)
        x = self.self_attn(qkv, ropes, batch, cache, plan, fused)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        gate_up, residual = norm_linear(x, residual, self.post_attention_layernorm, self.mlp.gate_up_proj, fused)
        x = self.mlp.down(gate_up, fused)
        return (x if self.tp is None else self.tp.all_reduce(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_class: type[nn.Module], norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward` returns final-normed hidden states [T, H] and the captured layers' outputs."""

    layer_class: type[nn.Module] = DecoderLayer
    tp = None  # tensor_parallel.TensorParallel: the LM head holds a vocabulary shard, gathered whole

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_class, self.layer_class.norm_class)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_rope()
        self.fused_kernels = False  # the Triton kernels of triton_fused.py (CUDA; the interpreter in tests)
        self.batch_invariant = False  # `batch_invariant.set_batch_invariant`: every product row by row

    def init_rope(self, device: torch.device | None = None) -> None:
        """The RoPE tables' inverse frequencies (fp32: positions need the precision), on `device` (None:
        the default one); a model built on the meta device calls this again once it is on a real one."""
        inv_freq, self.rope_factor = rope_parameters(self.config)
        self.register_buffer("rope_inv_freq", inv_freq.to(device), persistent=False)
        if SLIDING in self.config.layer_types and self.config.local_rope_theta is not None:
            self.register_buffer("rope_local_inv_freq", rope_inv_freq(self.config, local=True).to(device), persistent=False)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        ropes = {GLOBAL: rope_cos_sin(self.rope_inv_freq, positions, dtype, self.rope_factor)}
        if hasattr(self, "rope_local_inv_freq"):
            ropes[LOCAL] = rope_cos_sin(self.rope_local_inv_freq, positions, dtype)
        return ropes

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight  # [V, H]

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a checkpoint fills, by its Hugging Face name (fused parts as row views)."""
        fused = (".self_attn.qkv_proj.", ".mlp.gate_up_proj.")
        for name, param in self.named_parameters():
            if not any(part in name for part in fused):
                yield name, param
        for index, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{index}"
            for name, part in layer.self_attn.checkpoint_slices():
                yield f"{prefix}.self_attn.{name}", part
            for name, part in layer.mlp.checkpoint_slices():
                yield f"{prefix}.mlp.{name}", part

    def forward(
        self, batch: ForwardBatch, cache: PagedKVCache, plan: Plan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`plan` None: plan the ragged SDPA path here (a host sync unless the batch carries its lengths);
        a DecodePlan or VarlenPlan keeps it sync-free."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        ropes = self.rope_tables(batch.positions, x.dtype)
        if plan is None:
            plan = plan_attention(batch, cache.block_size)
        captured: dict[int, torch.Tensor] = {-1: x}  # -1: the embedding output (a DSpark context layer)
        residual = None
        for index, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, ropes, batch, cache, plan, self.fused_kernels)
            if index in batch.capture_layers:
                x, residual = x + residual, None  # the layer's output, whole; the next layer adds nothing
                captured[index] = x
        hidden, _ = add_rms_norm(x, residual, self.model.norm, self.fused_kernels)  # [T, H]
        if not batch.capture_layers:
            return hidden, None
        return hidden, torch.cat([captured[i] for i in batch.capture_layers], dim=-1)  # [T, C * H]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] in the model's dtype, soft-capped where the config says (Gemma 2), as transformers does."""
        product = invariant_linear if self.batch_invariant else F.linear
        logits = product(hidden, self.lm_head_weight)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        return softcap(logits, self.config.final_logit_softcap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden).float()  # [N, V]
