"""The DSpark drafter's block attention in the deterministic mode, on the GPU: each row's arithmetic
its own, whatever the batch (`dspark_model.attend_block_rows` is the twin and the dispatch).

One program per (block, kv head) holds the block's Q queries for every query head of its kv head
(rows r = query * GROUP + head in the group). It walks the block's gathered context keys
BLOCK_N at a time from the first (`DSparkProposer` starts a row's context at a position its own
anchor fixes, so a chunk's keys are the same positions alone or batched), with an online softmax
in fp32 over the keys the row sees (`seen`: the serving mask's context part, the same for every
query of a block), then the block's own Q keys. Keys a row does not see are neither read nor
weighed: a chunk of them leaves the row as it was, so the context's width, which the batch's
longest row sets, never changes a row's numbers.

Imported lazily and only where Triton is (CUDA; the CPU interpreter in tests, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
BLOCK_N = 16  # context keys per iteration: divides every cache block size, so chunks start at fixed positions


@triton.jit
def _update(q, k, v, visible, m, den, acc, qk_scale):
    # One online-softmax step over keys k, v [N, D] (zeros where not visible), in base 2.
    scores = tl.dot(q, tl.trans(k)) * qk_scale  # [R, N]
    scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: exp2(-inf) = 0
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(scores - m_ref[:, None])
    return m_new, den * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _draft_attention_kernel(
    q_ptr, ck_ptr, cv_ptr, bk_ptr, bv_ptr, seen_ptr, out_ptr, num_context, qk_scale,
    stride_qn, stride_qt, stride_qh, stride_cn, stride_cj, stride_ch, stride_bn, stride_bt, stride_bh, stride_sn,
    stride_on, stride_ot, stride_oh,
    GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    r = tl.arange(0, ROWS)
    query = r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = query < QUERIES
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qn + query[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [R, D]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for start in range(0, num_context, BLOCK):
        j = start + tl.arange(0, BLOCK)
        seen = tl.load(seen_ptr + row * stride_sn + j, mask=j < num_context, other=0) != 0  # [N]
        offs = row * stride_cn + j[:, None] * stride_cj + kv_head * stride_ch + d[None, :]
        k = tl.load(ck_ptr + offs, mask=seen[:, None], other=0.0)  # [N, D]
        v = tl.load(cv_ptr + offs, mask=seen[:, None], other=0.0)
        m, den, acc = _update(q, k, v, seen, m, den, acc, qk_scale)
    own = tl.arange(0, KEYS)
    in_block = own < QUERIES
    offs = row * stride_bn + own[:, None] * stride_bt + kv_head * stride_bh + d[None, :]
    k = tl.load(bk_ptr + offs, mask=in_block[:, None], other=0.0)  # [KEYS, D]
    v = tl.load(bv_ptr + offs, mask=in_block[:, None], other=0.0)
    m, den, acc = _update(q, k, v, in_block, m, den, acc, qk_scale)
    out = acc / den[:, None]
    o_offs = row * stride_on + query[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def draft_attention_triton(
    q: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], block: tuple[torch.Tensor, torch.Tensor],
    seen: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [N, Q, Hq, D]; context K, V [N, C, Hkv, D]; block K, V [N, Q, Hkv, D]; seen bool [N, C]
    (the context keys each block sees) -> softmax(q k^T * scale) v over the seen context and the
    whole block, [N, Q, Hq, D]."""
    n, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = block[0].shape[2]
    group = num_heads // num_kv_heads
    (ck, cv), (bk, bv) = (t if t.stride(-1) == 1 else t.contiguous() for t in context), (t.contiguous() for t in block)
    q, seen = q.contiguous(), seen.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    _draft_attention_kernel[(n, num_kv_heads)](
        q, ck, cv, bk, bv, seen, out, ck.shape[1], scale * LOG2_E,
        q.stride(0), q.stride(1), q.stride(2), ck.stride(0), ck.stride(1), ck.stride(2), bk.stride(0), bk.stride(1),
        bk.stride(2), seen.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, QUERIES=num_queries, ROWS=max(16, triton.next_power_of_2(num_queries * group)),
        KEYS=max(16, triton.next_power_of_2(num_queries)), HEAD_DIM=head_dim, BLOCK=BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out
