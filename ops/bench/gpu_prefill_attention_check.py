"""Long-prefill attention on one GPU: the project's Triton varlen kernel against torch's SDPA
backends and FlexAttention, for one layer of a 32,768-token prompt (issue 12, point 5: attention
is ~1.0 s of the 32k prefill's 1.86 s, 36 layers at ~28 ms).

Every candidate computes the same causal attention of one sequence (Qwen3-8B heads: 32 q / 8 kv,
d 128, bf16), either in one call over the whole prompt or chunk by chunk as chunked prefill does
(each chunk's queries against every key up to its own last position). Each row: ms for the whole
prompt (CUDA events, median of --repeats after a warm-up), TFLOP/s of the causal FLOPs
(2 * 2 * S^2 / 2 * d * Hq), and the max |difference| against the varlen kernel's output on the
same inputs. A candidate that fails records its error; one that would start more than --budget-s
after the start is skipped.

    sparkwire bench gpu-kernels prefill-attention --out $OUT/gpu_prefill_attention.json
    sparkwire bench gpu-kernels prefill-attention --device cpu --tiny --out /tmp/pa.json  # smoke

Candidates:
- `varlen` (the paged Triton kernel, `triton_varlen.py`) at its default launch and a few others,
  in one call and in 2048-token chunks (default launch, and 256 rows / 64 keys / 8 warps / 3
  stages); where Triton is not (CPU smoke) it is the torch twin.
- `dense_chunks<N>_<mask>`: the serving path, `attention.varlen_attention` on a `plan_varlen(dense=...)`
  plan, chunk by chunk (N = 2048 and 8192; the tiny shape: its chunk and 4x): each chunk's K/V
  gathered from the paged cache, SDPA cuDNN first (`dense_attention.py`); mask `merge` (prefix and
  chunk calls merged by log-sum-exp, LSE from the private cuDNN op, else flash), `merge_flash`
  (flash's LSE only), `merge_expanded` (K/V repeated to every head), `lower_right` (one call with
  `causal_lower_right`, which torch sends to flash).
- `sdpa_<backend>`: `F.scaled_dot_product_attention(is_causal=True)` over contiguous K/V in one
  call, each backend forced (flash, cudnn, efficient), GQA by `enable_gqa` and by expanded K/V.
- `sdpa_flash_chunks`: chunked, each chunk's K/V prefix gathered from the paged cache into a
  contiguous copy (the gather is timed with it), lower-right causal mask (`causal_lower_right`);
  `sdpa_cudnn_lower_right_chunks`: the same with cuDNN forced, to see whether cuDNN takes that mask
  (torch materialises it when flash and memory-efficient are off; the error is recorded if not).

Besides the rows, `lse_ops` says, for each private SDPA op the merge can take its LSE from (cuDNN,
flash), with native GQA and expanded K/V, whether it ran on a (2048 queries, 2048 keys) causal
call, the LSE shape it returned, and its max |difference| from the fp32 twin (out and LSE): the
merge's rows are only right if the LSE is the natural-log normaliser.
- `flex`: `flex_attention` compiled, causal block mask, GQA.
- `flash4_*` (where `flash4_attention.flash4_unavailable` says none): FlashAttention-4's CuTe
  kernels. `flash4_whole` / `flash4_chunks<N>` the serving path (`DenseConfig(kernel="flash4")`
  through `varlen_attention`: K/V gathered from the paged cache, one lower-right causal call, no
  merge), `flash4_whole_contiguous` the same call without the gather, `flash4_whole_paged<P>` FA4
  reading the cache in place through its page table, as 16-token pages (the cache's) and as
  128-token pages (one page a key tile: its TMA path).
  `dense_chunks16384_merge` is cuDNN's row for the 16k steps of `--max-prefill-tokens`.
Each row also has `first_call_s`, the first call's wall time (FA4: its JIT compile). `--only`
keeps the candidates whose name starts with one of its prefixes (the reference always runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops.bench.common import add_check_arguments, bench_dtype, deadline_sections, median_ms, script, write_json
from services.scheduler.model.attention import plan_varlen, varlen_attention, varlen_attention_torch
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.dense_attention import DENSE_MIN_QUERY_LEN, DenseConfig, attention_with_lse, attention_with_lse_torch
from services.scheduler.model.flash4_attention import flash4_unavailable
from services.scheduler.model.runner import triton_available



@dataclass(frozen=True)
class Shape:
    seq_len: int
    chunk: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 16

    @property
    def causal_tflop(self) -> float:
        return 4 * self.seq_len**2 / 2 * self.head_dim * self.heads / 1e12


FULL = Shape(seq_len=32768, chunk=2048)
TINY = Shape(seq_len=96, chunk=32, heads=4, kv_heads=2, head_dim=16)


@dataclass
class Inputs:
    q: torch.Tensor  # [S, Hq, D]
    k: torch.Tensor  # [S, Hkv, D]
    v: torch.Tensor
    key_cache: torch.Tensor  # [S / page, page, Hkv, D], the sequence's blocks in order
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [1, S / page]
    scale: float


def make_inputs(shape: Shape, device: str, dtype: torch.dtype) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    s, d = shape.seq_len, shape.head_dim
    q = torch.randn(s, shape.heads, d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(s, shape.kv_heads, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(s, shape.kv_heads, d, generator=gen, device=device, dtype=dtype)
    blocks = s // shape.page
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    cache_shape = (blocks, shape.page, shape.kv_heads, d)
    return Inputs(q, k, v, k.reshape(cache_shape), v.reshape(cache_shape), table, d**-0.5)


def varlen_call(inputs: Inputs, first: int, last: int, config: dict | None, max_rows: int | None) -> torch.Tensor:
    """Queries first..last-1 against keys 0..last-1 through the varlen kernel (or its twin)."""
    from services.scheduler.model.attention import MAX_TILE_ROWS, query_tiles, tile_tokens

    device = inputs.q.device
    q_len = last - first
    starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([last], dtype=torch.int32, device=device)
    query = inputs.q[first:last]
    if device.type != "cuda" or not triton_available():
        return varlen_attention_torch(query, inputs.key_cache, inputs.value_cache, starts, seq_lens, inputs.block_table, inputs.scale)
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    group = inputs.q.shape[1] // inputs.k.shape[1]
    block_m = tile_tokens(q_len, group, max_rows or MAX_TILE_ROWS)
    tiles = torch.tensor(query_tiles([q_len], [last], block_m), dtype=torch.int32).reshape(-1, 2).T.contiguous().to(device)
    launch = LaunchConfig(**config) if config else None
    return varlen_attention_triton(
        query, inputs.key_cache, inputs.value_cache, starts, seq_lens, inputs.block_table, tiles, block_m, inputs.scale, launch
    )


def chunked(shape: Shape, attend: Callable[[int, int], torch.Tensor], chunk: int | None = None) -> Callable[[], torch.Tensor]:
    chunk = chunk or shape.chunk

    def run() -> torch.Tensor:
        return torch.cat([attend(first, min(first + chunk, shape.seq_len)) for first in range(0, shape.seq_len, chunk)])

    return run


def chunk_batch(inputs: Inputs, first: int, last: int) -> ForwardBatch:
    """The step of chunk first..last-1 as the runner sees it: lengths on the host, K/V cached."""
    device = inputs.q.device
    tokens = torch.zeros(last - first, dtype=torch.int64, device=device)  # unread by attention
    starts = torch.tensor([0, last - first], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([last], dtype=torch.int32, device=device)
    return ForwardBatch(tokens, tokens, starts, seq_lens, inputs.block_table, tokens,
                        host_query_lens=(last - first,), host_seq_lens=(last,))  # fmt: skip


def dense_call(inputs: Inputs, first: int, last: int, config: DenseConfig) -> torch.Tensor:
    """Queries first..last-1 through `varlen_attention` with the dense path on (plan built per chunk, as serving does)."""
    group = inputs.q.shape[1] // inputs.k.shape[1]
    use_kernel = inputs.q.is_cuda and triton_available()
    plan = plan_varlen(chunk_batch(inputs, first, last), group, use_kernel=use_kernel, dense=config)
    return varlen_attention(inputs.q[first:last], inputs.key_cache, inputs.value_cache, plan, inputs.scale)


def dense_configs(shape: Shape) -> dict[str, DenseConfig]:
    """The dense variants by row-name suffix; the threshold lowered to the tiny shape's chunk."""
    base = DenseConfig(min_query_len=min(DENSE_MIN_QUERY_LEN, shape.chunk))
    return {
        "merge": dataclasses.replace(base, mask="merge"),
        "merge_flash": dataclasses.replace(base, mask="merge", lse_backends=("flash",)),
        "merge_expanded": dataclasses.replace(base, mask="merge", expand_kv=True),
        "lower_right": dataclasses.replace(base, mask="lower_right"),
    }


def sdpa_whole(inputs: Inputs, backend: str, expand: bool) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]  # fmt: skip
    q = inputs.q.transpose(0, 1)[None]  # [1, Hq, S, D]
    k, v = inputs.k.transpose(0, 1)[None], inputs.v.transpose(0, 1)[None]
    group = q.shape[1] // k.shape[1]
    if expand:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def run() -> torch.Tensor:
        with sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=inputs.scale, enable_gqa=not expand)
        return out[0].transpose(0, 1)

    return run


def sdpa_lower_right_chunk(inputs: Inputs, first: int, last: int, backend: str = "flash") -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    blocks = inputs.block_table[0, : -(-last // inputs.key_cache.shape[1])].long()
    k = inputs.key_cache[blocks].flatten(0, 1)[:last].transpose(0, 1)[None]  # gathered: [1, Hkv, last, D]
    v = inputs.value_cache[blocks].flatten(0, 1)[:last].transpose(0, 1)[None]
    q = inputs.q[first:last].transpose(0, 1)[None]
    mask = causal_lower_right(last - first, last)
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(chosen):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inputs.scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def flex_whole(inputs: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = inputs.q.shape[0]
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, s, s, device=str(inputs.q.device))
    compiled = torch.compile(flex_attention)
    q = inputs.q.transpose(0, 1)[None]
    k, v = inputs.k.transpose(0, 1)[None], inputs.v.transpose(0, 1)[None]

    def run() -> torch.Tensor:
        return compiled(q, k, v, block_mask=mask, scale=inputs.scale, enable_gqa=True)[0].transpose(0, 1)

    return run


def flash4_paged(inputs: Inputs, page: int) -> Callable[[], torch.Tensor]:
    """FA4 reading the cache in place through its page table, the sequence's K/V viewed as `page`-token pages."""
    s, kv_heads, d = inputs.k.shape
    cache_shape = (s // page, page, kv_heads, d)
    key_cache, value_cache = inputs.k.reshape(cache_shape), inputs.v.reshape(cache_shape)
    table = torch.arange(s // page, dtype=torch.int32, device=inputs.q.device)[None]
    used = torch.full((1,), s, dtype=torch.int32, device=inputs.q.device)

    def run() -> torch.Tensor:
        from flash_attn.cute import flash_attn_varlen_func

        from services.scheduler.model.flash4_attention import flash4_output

        result = flash_attn_varlen_func(inputs.q[None], key_cache, value_cache, seqused_k=used, page_table=table,
                                        softmax_scale=inputs.scale, causal=True)  # fmt: skip
        return flash4_output(result)[0]

    return run


def flash4_candidates(shape: Shape, inputs: Inputs) -> dict[str, Callable[[], torch.Tensor]]:
    from services.scheduler.model.flash4_attention import attend_sequence_flash4

    s = shape.seq_len
    flash4 = DenseConfig(min_query_len=min(DENSE_MIN_QUERY_LEN, shape.chunk), kernel="flash4")
    out: dict[str, Callable[[], torch.Tensor]] = {"flash4_whole": lambda: dense_call(inputs, 0, s, flash4)}
    for chunk in (shape.chunk, 8 * shape.chunk):
        out[f"flash4_chunks{chunk}"] = chunked(shape, lambda a, b: dense_call(inputs, a, b, flash4), chunk)
    out["flash4_whole_contiguous"] = lambda: attend_sequence_flash4(inputs.q, inputs.k, inputs.v, inputs.scale)
    for page in (shape.page, 128):
        if s % page == 0:
            out[f"flash4_whole_paged{page}"] = flash4_paged(inputs, page)
    return out


def flash4_new_lengths(shape: Shape, inputs: Inputs) -> list[dict]:
    """The wall time of the serving call at (query, keys) lengths not seen before, once the kernels
    are compiled: a recompile per length would show here as seconds."""
    from services.scheduler.model.flash4_attention import attend_sequence_flash4

    rows = []
    for q_len, seq_len in ((1000, 1000), (3000, 7001), (517, 20000), (1000, 1000)):
        q_len, seq_len = min(q_len, shape.seq_len), min(seq_len, shape.seq_len)
        torch.cuda.synchronize()
        start = time.perf_counter()
        attend_sequence_flash4(inputs.q[:q_len], inputs.k[:seq_len], inputs.v[:seq_len], inputs.scale)
        torch.cuda.synchronize()
        rows.append({"query": q_len, "keys": seq_len, "s": round(time.perf_counter() - start, 4)})
    return rows


def candidates(shape: Shape, inputs: Inputs, device: str) -> dict[str, Callable[[], torch.Tensor]]:
    s = shape.seq_len
    out: dict[str, Callable[[], torch.Tensor]] = {
        "varlen_chunks": chunked(shape, lambda a, b: varlen_call(inputs, a, b, None, None)),
        "varlen_whole": lambda: varlen_call(inputs, 0, s, None, None),
    }
    for chunk in (shape.chunk, 4 * shape.chunk):
        for suffix, config in dense_configs(shape).items():
            attend = lambda a, b, config=config: dense_call(inputs, a, b, config)  # noqa: E731
            out[f"dense_chunks{chunk}_{suffix}"] = chunked(shape, attend, chunk)
    if device == "cuda":
        for name, config, rows in (
            ("varlen_whole_n128_w8_s3", {"block_n": 128, "num_warps": 8, "num_stages": 3}, None),
            ("varlen_whole_n64_w8_s4", {"block_n": 64, "num_warps": 8, "num_stages": 4}, None),
            ("varlen_whole_rows256_n64_w8_s3", {"block_n": 64, "num_warps": 8, "num_stages": 3}, 256),
            ("varlen_whole_rows256_n128_w8_s2", {"block_n": 128, "num_warps": 8, "num_stages": 2}, 256),
        ):
            out[name] = lambda config=config, rows=rows: varlen_call(inputs, 0, s, config, rows)
        rows256 = {"block_n": 64, "num_warps": 8, "num_stages": 3}
        out["varlen_chunks_rows256_n64_w8_s3"] = chunked(shape, lambda a, b: varlen_call(inputs, a, b, rows256, 256))
        for backend in ("cudnn", "flash", "efficient"):
            out[f"sdpa_{backend}_gqa"] = sdpa_whole(inputs, backend, expand=False)
            out[f"sdpa_{backend}_expanded"] = sdpa_whole(inputs, backend, expand=True)
        out["sdpa_flash_chunks"] = chunked(shape, lambda a, b: sdpa_lower_right_chunk(inputs, a, b))
        out["sdpa_cudnn_lower_right_chunks"] = chunked(shape, lambda a, b: sdpa_lower_right_chunk(inputs, a, b, "cudnn"))
        out["flex"] = flex_whole(inputs)
        merge = dense_configs(shape)["merge"]
        out[f"dense_chunks{8 * shape.chunk}_merge"] = chunked(shape, lambda a, b: dense_call(inputs, a, b, merge), 8 * shape.chunk)
        if flash4_unavailable(inputs.q.device) is None:
            out |= flash4_candidates(shape, inputs)
    else:
        out["sdpa_math_gqa"] = sdpa_whole(inputs, "math", expand=False)
    return out


def measure(shape: Shape, fn: Callable[[], torch.Tensor], reference: torch.Tensor, device: str, repeats: int) -> dict:
    start = time.perf_counter()
    got = fn()
    diff = (got.float() - reference.float()).abs().max().item()  # reads the result: the first call has ended
    first_call_s = time.perf_counter() - start
    ms = median_ms(fn, device, repeats, warmup=1)
    return {"ms": round(ms, 3), "tflops": round(shape.causal_tflop / (ms / 1e3), 1), "max_abs_diff": diff,
            "first_call_s": round(first_call_s, 3)}  # fmt: skip


def lse_ops(shape: Shape, inputs: Inputs) -> list[dict]:
    """Each LSE op, native GQA and expanded, on the first chunk (square, causal) against the fp32 twin."""
    n = min(shape.chunk, shape.seq_len)
    q = inputs.q[:n].transpose(0, 1)[None]  # [1, Hq, n, D]
    k, v = inputs.k[:n].transpose(0, 1)[None], inputs.v[:n].transpose(0, 1)[None]  # [1, Hkv, n, D]
    want_out, want_lse = attention_with_lse_torch(q, k, v, inputs.scale, causal=True)
    group = q.shape[1] // k.shape[1]
    rows = []
    for backend in ("cudnn", "flash"):
        for expand in (False, True):
            kk, vv = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if expand else (k, v)
            row: dict = {"op": backend, "kv": "expanded" if expand else "gqa"}
            try:
                out, lse = attention_with_lse(q, kk, vv, inputs.scale, True, (backend,))
                row |= {"lse_shape": list(lse.shape), "out_max_abs_diff": (out.float() - want_out).abs().max().item(),
                        "lse_max_abs_diff": (lse - want_lse).abs().max().item()}  # fmt: skip
            except RuntimeError as exc:
                row["error"] = str(exc)[:400]
            rows.append(row)
    return rows


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info |= {"device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}
    try:
        import triton
        import triton.language as tl

        info |= {"triton": triton.__version__, "tl_topk": hasattr(tl, "topk"), "tl_sort": hasattr(tl, "sort")}
    except ImportError:
        info["triton"] = None
    return info


def run(args: argparse.Namespace) -> dict:
    shape = TINY if args.tiny else FULL
    dtype = bench_dtype(args.device)
    result: dict = {"shape": shape.__dict__, "environment": environment(), "rows": {}}
    deadline = time.monotonic() + args.budget_s
    section = deadline_sections(result["rows"], deadline)
    inputs = make_inputs(shape, args.device, dtype)
    reference = candidates(shape, inputs, args.device)["varlen_whole"]()
    if args.device == "cuda":
        result["environment"]["flash4_unavailable"] = flash4_unavailable(inputs.q.device)
    for name, fn in candidates(shape, inputs, args.device).items():
        if args.only and not name.startswith(tuple(args.only)):
            continue
        section(name, lambda fn=fn: measure(shape, fn, reference, args.device, args.repeats))
    if args.device == "cuda" and result["environment"]["flash4_unavailable"] is None:
        section("flash4_new_lengths", lambda: flash4_new_lengths(shape, inputs))
    if args.device == "cuda":
        try:
            result["lse_ops"] = lse_ops(shape, inputs)
        except Exception:  # noqa: BLE001 - the rows above stand without it
            result["lse_ops"] = {"error": traceback.format_exc()}
    return result


def table(result: dict) -> str:
    lines = [f"{'candidate':36} {'ms (whole prompt)':>18} {'TFLOP/s':>8} {'max|diff|':>10} {'first s':>8}"]
    for name, row in result["rows"].items():
        if "ms" in row:
            lines.append(f"{name:36} {row['ms']:>18.2f} {row['tflops']:>8.1f} {row['max_abs_diff']:>10.2e} {row['first_call_s']:>8.2f}")
        else:
            lines.append(f"{name:36} {str(row)[:60]}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="a 96-token prompt, small heads", repeats=5, budget_s=90.0,
                        out="gpu_prefill_attention.json", what="calls per candidate")
    parser.add_argument("--only", nargs="*", default=None, help="candidates whose name starts with one of these (default all)")


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except Exception:  # noqa: BLE001 - the JSON says what broke
        result = {"error": traceback.format_exc()}
    write_json(args.out, result)
    print(table(result) if "rows" in result else result["error"])
    return 0 if "rows" in result else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
