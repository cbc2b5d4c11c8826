"""`sparkwire bench <name>`: the benchmarks (ops/bench/README.md: which question each answers, and
where its figures are kept). Each writes a JSON file and prints a short table.

A suite's module is imported only when its subcommand parses its arguments, so `sparkwire bench
--help` needs neither torch nor any suite's own dependencies. `python -m ops.bench <name> ...` is
the same command without the console script.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    module: str  # defines add_arguments(parser) and main(args) -> int
    help: str


SUITES: dict[str, Suite] = {
    "logprob-transport": Suite("ops.bench.logprob_transport", "prompt top logprobs over NATS: flat arrays vs nested rows, per hop, "
                               "two hops, through HTTP"),
    "serve": Suite("ops.bench.serve", "online serving against a running server (or --launch): TTFT / ITL / TPOT / e2e, tok/s, "
                   "top-k logprobs"),
    "frontend-capacity": Suite("ops.bench.frontend_capacity", "the front half behind a stand-in decoding at a GPU's pace, no GPU: "
                               "tok/s with and without top-20"),
    "metrics-shared": Suite("ops.bench.metrics_shared_cost", "one /metrics page for several tokenizers: a tokenizer's "
                            "snapshot publish and a scrape, against rendering one registry (CPU)"),
    "reliability": Suite("ops.bench.reliability", "hostile HTTP and NATS input, kill -9 of each service and nats-server, "
                         "concurrent streams; lost/short/5xx must be 0"),
    "host-step": Suite("ops.bench.host_step_cost", "the core's host time per decode step, piece by piece (CPU)"),
    "host-context": Suite("ops.bench.host_context_cost", "the core's host time per decode step against the context length (CPU)"),
    "grammar-overhead": Suite("ops.bench.grammar_overhead", "structured output's cost a decode step: bitmask fill per row, "
                              "applying it, a step with and without a grammar (CPU)"),
    "logprob-ops": Suite("ops.bench.logprob_ops", "torch ops and kernels output logprobs add to a decode step (CPU)"),
    "dspark-accept": Suite("ops.bench.dspark_context_accept", "the bundled DSpark pair's accept length by prompt length and "
                           "draft context window"),
    "dspark-sps": Suite("ops.bench.dspark_sps", "DSpark's step-cost table: ms of a verify step against its tokens, "
                        "saved beside the drafter for `compact`"),
    "dspark-sts": Suite("ops.bench.dspark_sts", "the confidence head's temperature (calibration, ECE) on held-out drafts "
                        "of a trained pair, saved beside the drafter"),
    "trained-pair": Suite("ops.bench.trained_pair", "a trained pair (the `large` recipe) trained in the call: its accept "
                          "length on held-out code, tok/s with DSpark against plain at batch 1 / 16, the same greedy ids"),
    "dspark-serve": Suite("ops.bench.dspark_serve", "the whole stack at concurrency 1 / 16 / 64: plain against DSpark "
                          "static and compact, acceptance replayed (8B shape, dummy weights)"),
    "dspark-step-profile": Suite("ops.bench.dspark_step_profile", "where a decode step's time goes on the device, plain "
                                 "against DSpark static: busy and idle ms, kernels a step, the top kernels (torch.profiler)"),
    "startup-memory": Suite("ops.bench.startup_memory", "a scheduler's start-up stage by stage: device memory after each, "
                            "a ledger of what should hold it, the rest by allocation site (CUDA)"),
    "step-trace": Suite("ops.bench.step_trace_summary", "a scheduler's --step-trace summarized: time by step kind, host ms, "
                        "time between steps"),
    "gpu-serve": Suite("ops.bench.gpu_serve_check", "the whole stack on a GPU: concurrency 64 with and without top-20, batch 1, "
                       "Poisson, 32k prompt + top-2; the core as the bar"),
    "gpu-prefix-cache": Suite("ops.bench.gpu_prefix_cache", "the whole stack on a GPU, prefix cache on vs off: shared-prefix "
                              "groups, multi-turn TTFT by turn; concurrency 256 vs 64 at the running limit from memory"),
    "gpu-serve-ab": Suite("ops.bench.serve_ab", "gpu-serve for two or more trees on one machine, rounds alternating"),
    "gpu-core": Suite("ops.bench.gpu_core_check", "the core's decode step at batch 1 / 64: plain, top-20, DSpark at a simulated "
                      "accept length; --before another tree"),
    "gpu-peer": Suite("ops.bench.gpu_peer_check", "decode tok/s through the core against HF transformers generate() and the "
                      "HBM roofline"),
    "gpu-prefill": Suite("ops.bench.gpu_prefill_profile", "a 32k prompt with top-2 prompt logprobs through the core: seconds, "
                         "device time by kernel kind"),
    "gpu-models": Suite("ops.bench.gpu_models", "Qwen3-30B-A3B (MoE) decode against its bytes floor, the fused MoE kernel "
                        "against its twin, Qwen3-8B FP8 against bf16 and FP8 logprobs against dequantized"),
    "deterministic": Suite("ops.bench.deterministic_check", "--deterministic: bitwise logprobs across batch, chunking, "
                           "preemption, DSpark and forks (on; the bf16 drift off), and its cost on the 8B shape"),
    "rl-weights": Suite("ops.bench.rl_weights", "new weights without a restart: update time from disk and over NATS, TTFT "
                        "after, against a scheduler restart; NATS GB/s into one scheduler"),
    "lm-eval-cache": Suite("ops.bench.lm_eval_cache", "lm-evaluation-harness (local-completions) on a few-shot multiple-choice "
                           "task, prefix cache on vs off: identical scores, wall time, cache hits"),
    "two-gpu-serve": Suite("ops.bench.two_gpu_serve", "two schedulers on two GPUs behind one NATS: scaling, placement, one "
                           "stopping mid-run"),
}
# `sparkwire bench gpu-kernels <check>`: the Triton kernels against the torch paths they replace,
# correctness first, then speed; each has a CPU smoke mode (--device cpu --tiny).
KERNEL_CHECKS: dict[str, Suite] = {
    "attention": Suite("ops.bench.gpu_attention_check", "ragged (varlen) attention against the SDPA groups; ragged CUDA "
                       "graphs; the 32k prefill"),
    "split-kv": Suite("ops.bench.gpu_split_kv_check", "split-KV decode attention off against on"),
    "prefill-attention": Suite("ops.bench.gpu_prefill_attention_check", "long-prefill attention: varlen, SDPA backends, "
                               "FlexAttention, FlashAttention-4"),
    "fused": Suite("ops.bench.gpu_fused_check", "the fused small-op kernels (norms, RoPE + KV write, SiLU) off against on"),
    "gemv": Suite("ops.bench.gpu_gemv_check", "the one-token GEMV kernels against cuBLAS and what they replace"),
    "rope": Suite("ops.bench.gpu_rope_check", "the RoPE + KV-write kernel's heads per program"),
    "logprobs": Suite("ops.bench.gpu_logprob_kernel_check", "the fused raw-mode logprob kernels against the torch path"),
}


class SuiteParser(argparse.ArgumentParser):
    """A subcommand's parser that imports its suite and adds the suite's arguments only when it
    parses (not when the parent's help lists it)."""

    def __init__(self, *args, suite: Suite | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._suite = suite

    def parse_known_args(self, args=None, namespace=None):
        if self._suite is not None:
            module, self._suite = importlib.import_module(self._suite.module), None
            self.description = (module.__doc__ or "").split("\n\n")[0]
            module.add_arguments(self)
            self.set_defaults(bench=module.main)
        return super().parse_known_args(args, namespace)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK", parser_class=SuiteParser)
    for name, suite in SUITES.items():
        sub.add_parser(name, help=suite.help, suite=suite)
    kernels = sub.add_parser("gpu-kernels", help="the Triton kernels against the torch paths they replace: "
                             + ", ".join(KERNEL_CHECKS), description="Triton kernel checks: correctness, then speed.")  # fmt: skip
    checks = kernels.add_subparsers(dest="kernel_check", required=True, metavar="CHECK", parser_class=SuiteParser)
    for name, suite in KERNEL_CHECKS.items():
        checks.add_parser(name, help=suite.help, suite=suite)


def main(args: argparse.Namespace) -> int:
    return int(args.bench(args) or 0)


if __name__ == "__main__":
    from services.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
