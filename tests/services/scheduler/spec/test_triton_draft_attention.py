"""The drafter's block attention in the deterministic mode (`triton_draft_attention.py`), in
Triton's interpreter: a block's rows are the same bits alone and in a batch whose widest context is
longer, and they are `masked_attention`'s function."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.scheduler.spec.dspark_model import attend_block_rows, masked_attention
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, run_interpreted_cases

GEN = torch.Generator().manual_seed(5)
N, Q, HQ, HKV, D, WIDE = 3, 4, 4, 2, 16, 80  # blocks, queries per block, heads, head dim, the batch's context width
Q_ALL = torch.randn(N, Q, HQ, D, generator=GEN)
CONTEXT = tuple(torch.randn(N, WIDE, HKV, D, generator=GEN) for _ in range(2))
BLOCK = tuple(torch.randn(N, Q, HKV, D, generator=GEN) for _ in range(2))
SEEN = [(0, 20), (5, 77), (16, 40)]  # each block's visible context keys [start, end): from 0, or a window's start


def seen_mask(width: int, rows=range(N)) -> torch.Tensor:
    """bool [n, 1, Q, width + Q]: the serving mask, each block's context keys [start, end) and its own Q keys."""
    columns = torch.arange(width)
    context = torch.stack([(columns >= SEEN[r][0]) & (columns < SEEN[r][1]) for r in rows])  # [n, width]
    return torch.cat((context, torch.ones(len(rows), Q, dtype=torch.bool)), dim=1)[:, None, None].expand(-1, 1, Q, -1)


def check_rows_are_their_own(attend) -> None:
    batched = attend(Q_ALL, CONTEXT, BLOCK, seen_mask(WIDE))
    for r, width in ((0, 32), (2, 48)):  # alone, the context only as wide as the row needs
        alone = attend(Q_ALL[r : r + 1], tuple(c[r : r + 1, :width] for c in CONTEXT), tuple(b[r : r + 1] for b in BLOCK),
                       seen_mask(width, [r]))  # fmt: skip
        assert torch.equal(alone[0], batched[r]), r
    keys, values = (torch.cat(pair, dim=1) for pair in zip(CONTEXT, BLOCK))
    torch.testing.assert_close(batched, masked_attention(Q_ALL, keys, values, seen_mask(WIDE)), atol=2e-6, rtol=2e-5)


def test_the_twin_takes_each_blocks_seen_keys_alone() -> None:
    check_rows_are_their_own(attend_block_rows)


def test_kernel_in_the_triton_interpreter() -> None:
    run_interpreted_cases(__file__, timeout_s=120)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernel_in_the_triton_interpreter")
def test_interpreted_kernel_rows_are_their_own_whatever_the_context_width() -> None:
    from services.scheduler.spec.triton_draft_attention import draft_attention_triton

    def attend(q, context, block, mask):
        return draft_attention_triton(q, context, block, mask[:, 0, 0, : context[0].shape[1]], D**-0.5)

    check_rows_are_their_own(attend)


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
def test_kernel_compiles_for_the_h100() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.spec import triton_draft_attention

    signature = {**dict.fromkeys(["q_ptr", "ck_ptr", "cv_ptr", "bk_ptr", "bv_ptr"], "*bf16"), "seen_ptr": "*i8", "out_ptr": "*bf16",
                 "num_context": "i32", "qk_scale": "fp32",
                 **dict.fromkeys(["stride_qn", "stride_qt", "stride_qh", "stride_cn", "stride_cj", "stride_ch", "stride_bn",
                                  "stride_bt", "stride_bh", "stride_sn", "stride_on", "stride_ot", "stride_oh"], "i32")}  # fmt: skip
    constants = {"GROUP": 4, "QUERIES": 16, "ROWS": 64, "KEYS": 16, "HEAD_DIM": 128, "BLOCK": triton_draft_attention.BLOCK_N}
    source = ASTSource(triton_draft_attention._draft_attention_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
