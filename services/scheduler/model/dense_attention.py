"""Dense attention for the long queries of a ragged step (long prefill chunks): FlashAttention-4
where it runs, else torch SDPA.

On a long prompt's layers cuDNN's SDPA and FlashAttention-4 are both well ahead of the paged
varlen kernel (`triton_varlen.py`). So a sequence of the step whose query is at least
`DenseConfig.min_query_len` tokens leaves the varlen tile map (`attention.plan_varlen`) and is
attended here instead: its keys/values 0..seq_len-1 are gathered from the paged cache into
contiguous copies ([L, Hkv, D]) and its queries (positions ctx..ctx+q-1, ctx = seq_len - q) attend
them lower-right causally, by `DenseConfig.kernel`:

- "flash4" (`flash4_attention.py`; `resolve_dense_kernel` takes it where the optional package runs):
  one call whatever ctx, its causal mask lower-right aligned; the rows in their own [q, Hq, D]
  layout.
- "sdpa", ctx == 0 (the first chunk, or a whole prompt): top-left causal is lower-right, one SDPA
  call with is_causal, cuDNN first (`preferred_backends`);
- "sdpa", ctx > 0, mask "merge": two calls merged by log-sum-exp. (a) the queries against the
  prefix keys 0..ctx-1, unmasked; (b) against the chunk's own keys ctx..L-1, square causal. With
  each call's softmax normaliser lse = log sum_k exp(s_k), the exact softmax over both key sets is
      out = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse),  lse = logaddexp(lse_a, lse_b)
  (`merge_by_lse`). Public SDPA returns no LSE: on CUDA the private cuDNN op
  (`aten._scaled_dot_product_cudnn_attention`, compute_log_sumexp) does, else the flash one;
  on CPU a plain fp32 twin (`attention_with_lse_torch`);
- "sdpa", ctx > 0, mask "lower_right": one call with `causal_lower_right`. torch dispatches that
  mask to flash (its causal is lower-right) or memory-efficient attention and otherwise
  materialises a dense [q, L] mask: cuDNN never sees it as causal, which is why "merge" exists.

Lengths are host ints from the plan, so nothing here reads the device (no host sync); the shapes
change with every step, so this path is not captured in CUDA graphs (`ModelRunner.forward` sends
steps with a dense query to the eager path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.flags import DENSE_ATTENTION_CHOICES, DENSE_KERNELS
from services.scheduler.model.flash4_attention import attend_sequence_flash4, flash4_unavailable

# Below this many query tokens a sequence stays on the varlen kernel: one SDPA call per sequence
# (plus its K/V gather) costs a launch and a copy of the whole prefix, which a short query does
# not win back. Untuned: `sparkwire bench gpu-kernels prefill-attention` times 2048- and 8192-token
# chunks; 512 is a first guess below both.
DENSE_MIN_QUERY_LEN = 512
DENSE_MASKS = ("merge", "lower_right")
DEFAULT_DENSE_MASK = "merge"  # cuDNN on both halves; to be settled by that benchmark
LSE_BACKENDS = ("cudnn", "flash")  # the CUDA ops that return a log-sum-exp, tried in this order


@dataclass(frozen=True)
class DenseConfig:
    min_query_len: int = DENSE_MIN_QUERY_LEN
    kernel: str = "sdpa"  # one of DENSE_KERNELS (over the gathered K/V); mask, expand_kv and lse_backends are sdpa's
    mask: str = DEFAULT_DENSE_MASK  # one of DENSE_MASKS, for queries with context (see the module doc)
    expand_kv: bool = False  # repeat K/V to every query head before the calls (instead of native GQA)
    lse_backends: tuple[str, ...] = LSE_BACKENDS  # "merge" on CUDA: the ops tried, in order

    def __post_init__(self) -> None:
        if self.kernel not in DENSE_KERNELS:
            raise ValueError(f"kernel must be one of {DENSE_KERNELS}, got {self.kernel!r}")
        if self.mask not in DENSE_MASKS:
            raise ValueError(f"mask must be one of {DENSE_MASKS}, got {self.mask!r}")
        if not self.lse_backends or not set(self.lse_backends) <= set(LSE_BACKENDS):
            raise ValueError(f"lse_backends must be drawn from {LSE_BACKENDS}, got {self.lse_backends}")
        if self.min_query_len < 1:
            raise ValueError(f"min_query_len must be positive, got {self.min_query_len}")


def resolve_dense_kernel(choice: str, device: torch.device) -> str:
    """The kernel of `--dense-attention CHOICE` on this device: auto takes flash4 where it runs,
    else sdpa; flash4 asked for where it cannot run is an error that says why."""
    why = flash4_unavailable(device)
    if choice == "flash4" and why is not None:
        raise ValueError(f"--dense-attention flash4: {why}")
    if choice not in DENSE_ATTENTION_CHOICES:
        raise ValueError(f"--dense-attention must be one of {', '.join(DENSE_ATTENTION_CHOICES)}; got {choice!r}")
    return "flash4" if choice != "sdpa" and why is None else "sdpa"


@dataclass(frozen=True)
class DenseSequence:
    seq: int  # the sequence's row in the step's block table
    token_start: int  # its first query row in the step's [T] tokens
    query_len: int
    seq_len: int  # keys it attends: 0 .. seq_len - 1


@dataclass(frozen=True)
class DensePlan:
    sequences: tuple[DenseSequence, ...]
    config: DenseConfig

    def whole_step(self, num_tokens: int) -> DenseSequence | None:
        """The one sequence that is every row of a step of num_tokens (a prompt alone), else None."""
        if len(self.sequences) == 1 and self.sequences[0].query_len == num_tokens:
            return self.sequences[0]
        return None


def plan_dense(starts: list[int], seq_lens: list[int], config: DenseConfig) -> DensePlan:
    """The sequences of a step (host query_start_loc [B + 1], seq_lens [B]) whose query is long enough."""
    sequences = (
        DenseSequence(b, start, end - start, seq_len)
        for b, (start, end, seq_len) in enumerate(zip(starts, starts[1:], seq_lens))
        if end - start >= config.min_query_len
    )
    return DensePlan(tuple(sequences), config)


def attend_dense(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: DensePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write the dense sequences' rows of out [T, Hq, D]. query [T, Hq, D]; caches [N, page, Hkv, D]."""
    for s in plan.sequences:
        rows = slice(s.token_start, s.token_start + s.query_len)
        out[rows] = attend_dense_sequence(query, key_cache, value_cache, block_tables, s, scale, plan.config)


def attend_dense_sequence(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    s: DenseSequence,
    scale: float,
    config: DenseConfig,
) -> torch.Tensor:
    """One dense sequence's attention: its rows of query [T, Hq, D] over its keys in the caches -> [q, Hq, D]."""
    q = query[s.token_start : s.token_start + s.query_len]  # [q, Hq, D]
    k = gather_keys(key_cache, block_tables[s.seq], s.seq_len)  # [L, Hkv, D]
    v = gather_keys(value_cache, block_tables[s.seq], s.seq_len)
    if config.kernel == "flash4":
        return attend_sequence_flash4(q, k, v, scale)
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]: the BSHD strides SDPA takes as they are
    return sequence_attention(q, k, v, scale, config)[0].transpose(0, 1)


def gather_keys(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Keys 0..seq_len-1 of one sequence, gathered into one contiguous [L, Hkv, D] copy: cache
    [N, page, Hkv, D], table int32 [M]."""
    blocks = table[: -(-seq_len // cache.shape[1])].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, config: DenseConfig) -> torch.Tensor:
    """Lower-right causal attention of q [1, Hq, q, D] (the last q positions) over k, v [1, Hkv, L, D] -> [1, Hq, q, D]."""
    if config.expand_kv:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_len, num_keys = q.shape[2], k.shape[2]
    context = num_keys - q_len
    if context == 0:
        return sdpa(q, k, v, scale, is_causal=True)
    if config.mask == "lower_right":
        from torch.nn.attention.bias import causal_lower_right

        return sdpa(q, k, v, scale, attn_mask=causal_lower_right(q_len, num_keys))
    backends = config.lse_backends
    o_a, lse_a = attention_with_lse(q, k[:, :, :context], v[:, :, :context], scale, False, backends)
    o_b, lse_b = attention_with_lse(q, k[:, :, context:], v[:, :, context:], scale, True, backends)
    return merge_by_lse(o_a, lse_a, o_b, lse_b).to(q.dtype)


def preferred_backends(device: torch.device | None = None) -> list:
    """cuDNN, flash, memory-efficient on CUDA, and never the math backend there: for a long query it
    would build the whole score matrix ([Hq, q, L] floats: ~32 GiB at 8192 x 32k x 32 heads) and run
    out of memory; with none of the three, SDPA raises instead. The CPU twin runs math."""
    from torch.nn.attention import SDPBackend

    if device is not None and device.type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool = False, attn_mask=None) -> torch.Tensor:
    """Public SDPA with cuDNN first, then flash, memory-efficient (torch >= 2.6: set_priority); math on CPU only."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(preferred_backends(q.device), set_priority=True):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )


def merge_by_lse(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output o [B, H, q, D] and
    log-sum-exp lse [B, H, q] (fp32): o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse), fp32 out."""
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, q]
    w_a = (lse_a - lse).exp()[..., None]  # [B, H, q, 1]
    w_b = (lse_b - lse).exp()[..., None]
    return o_a.float() * w_a + o_b.float() * w_b


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    backends: tuple[str, ...] = LSE_BACKENDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, q, D], lse fp32 [B, Hq, q]); causal: top-left (square calls only). On CUDA the
    first of `backends` whose op takes these inputs; elsewhere the fp32 twin."""
    if not q.is_cuda:
        return attention_with_lse_torch(q, k, v, scale, causal)
    errors = []
    for backend in backends:
        try:
            return _checked(q, k, *_lse_op(backend, q, k, v, scale, causal))
        except (RuntimeError, TypeError) as exc:  # raised on the host before any launch: unsupported shape, build, schema
            errors.append(f"{backend}: {exc}")
    raise RuntimeError("no SDPA op returned a log-sum-exp: " + " | ".join(errors))


def _lse_op(backend: str, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "cudnn":
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return result[0], result[1]


def _checked(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The private ops' outputs as documented here, or an error (cuDNN's lse is [B, H, q, 1] on some
    versions, [B, H, q] on others; metadata only, no sync)."""
    b, h, q_len = q.shape[0], q.shape[1], q.shape[2]
    if tuple(out.shape) != (b, h, q_len, q.shape[3]) or out.dtype != q.dtype:
        raise RuntimeError(f"unexpected output {tuple(out.shape)} {out.dtype} for query {tuple(q.shape)} {q.dtype}")
    if lse.numel() != b * h * q_len or lse.dtype != torch.float32:
        raise RuntimeError(f"unexpected logsumexp {tuple(lse.shape)} {lse.dtype} for query {tuple(q.shape)}")
    return out, lse.reshape(b, h, q_len)


def attention_with_lse_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin, fp32: q [B, Hq, q, D], k, v [B, Hkv, L, D] -> (out fp32 [B, Hq, q, D], lse [B, Hq, q])."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # [B, Hq, L, D]
    scores = q.float() @ k.transpose(-1, -2) * scale  # [B, Hq, q, L]
    if causal:
        q_len, num_keys = scores.shape[-2], scores.shape[-1]
        above = torch.ones(q_len, num_keys, dtype=torch.bool, device=q.device).triu(1)  # top-left
        scores = scores.masked_fill(above, float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [B, Hq, q]
    return (scores - lse[..., None]).exp() @ v, lse
