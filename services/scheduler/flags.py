"""Scheduler flags that `sparkwire up` passes through too. Light on purpose: no torch, so the
launcher can import it."""

from __future__ import annotations

import argparse

SPECULATIVE_ALGORITHMS = ("none", "dspark")
VERIFY_MODES = ("static", "compact")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The DSpark flags, shared by `sparkwire scheduler` and `sparkwire up`."""
    parser.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS, default="none",
                        help="dspark: DSpark block speculative decoding (exact logprobs, lossless sampling)")
    parser.add_argument("--draft-model", default=None, help="DSpark draft model directory (default: the bundled drafter)")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                        help="draft tokens per block (gamma); default: the drafter's block size")
    parser.add_argument("--verify-mode", choices=VERIFY_MODES, default="static",
                        help="static: verify every draft; compact: as many as the confidence head expects to survive")


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """CUDA-graph flags, shared by `sparkwire scheduler` and `sparkwire up`."""
    parser.add_argument("--ragged-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: replay ragged steps (prefill chunks beside decodes, compact verify) from CUDA graphs "
                             "captured on first use of each padded shape (default on; elsewhere it does nothing)")  # fmt: skip
    parser.add_argument("--logprob-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA: compute output logprobs (top-k, requested ids) of up to 128 rows from CUDA graphs "
                             "captured on first use of each padded shape (default on; elsewhere it does nothing)")  # fmt: skip


def graph_argv(args: argparse.Namespace) -> list[str]:
    ragged = "--ragged-cuda-graphs" if args.ragged_cuda_graphs else "--no-ragged-cuda-graphs"
    logprob = "--logprob-cuda-graphs" if args.logprob_cuda_graphs else "--no-logprob-cuda-graphs"
    return [ragged, logprob]


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The same flags back as argv, for `sparkwire up` to pass to its scheduler."""
    argv = ["--speculative-algorithm", args.speculative_algorithm, "--verify-mode", args.verify_mode]
    if args.draft_model:
        argv += ["--draft-model", args.draft_model]
    if args.speculative_num_draft_tokens is not None:
        argv += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    return argv
