"""The scheduler's flags that `sparkwire up` takes and passes through too, with their choices and
their numeric defaults (one definition each: `SchedulerConfig` and the loader use these; a flag's
on/off or named default is written beside `SchedulerConfig`'s, split-KV's aside: the model runner
takes that one too). Light on purpose: no torch, so the launcher can import it."""

from __future__ import annotations

import argparse

from services.common.model_source import add_source_arguments
from services.common.settings import EnvSettings
from services.models import BUNDLED_MODEL

SPECULATIVE_ALGORITHMS = ("none", "dspark")
VERIFY_MODES = ("static", "compact")
DEVICES = ("auto", "cpu", "cuda")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (*DTYPE_NAMES, "auto")  # auto: the checkpoint's torch_dtype
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)  # --quantization: an unquantized checkpoint quantized at load (model/fp8.py)
LOGPROBS_MODES = ("raw", "processed")
DEFAULT_MAX_RUNNING_REQUESTS = 64  # off CUDA, and the least on it
# CUDA: the running limit from the KV cache, a request per this many cached tokens, up to the cap
# (what a small model on a large GPU decodes at once; SGLang sizes it from memory too)
KV_TOKENS_PER_RUNNING_REQUEST = 1024
MAX_DEFAULT_RUNNING_REQUESTS = 512
DEFAULT_CHUNKED_PREFILL_SIZE = 2048  # tokens per step, prefill chunks and decode tokens together
# Tokens per step while no sequence decodes (nothing to stall): a long prompt alone runs faster in
# steps well past the chunk budget (`--dense-prefill`), and hardly faster again past 16384
DEFAULT_MAX_PREFILL_TOKENS = 16384
CUDA_KV_CACHE_FRACTION = 0.8  # of the memory still free once weights are loaded
# With a drafter: its graphs and step tensors need more of what the weights leave than the plain
# default does (its start-up ran out of memory at 0.8 on a card that serves plain decoding at 0.8)
DRAFTER_KV_CACHE_FRACTION = 0.6
# Split-KV decode attention on (`--split-kv-decode`): it fills the SMs a small batch leaves idle,
# with the same next tokens, and a batch that fills them gets one split, the same kernel
DEFAULT_SPLIT_KV_DECODE = True
# The kernels `--dense-prefill` attends with (`dense_attention.py`): FlashAttention-4 where its
# package is installed and runs on the GPU (`flash4_attention.py`), else torch SDPA (cuDNN first)
DENSE_KERNELS = ("flash4", "sdpa")
DENSE_ATTENTION_CHOICES = ("auto", *DENSE_KERNELS)


def add_model_arguments(parser: argparse.ArgumentParser, env: EnvSettings) -> None:
    """What the scheduler serves and how much of it at once, shared by `sparkwire scheduler` and
    `sparkwire up`."""
    add = parser.add_argument
    add("--model", default=env.model or str(BUNDLED_MODEL),
        help="target model: a directory (Hugging Face layout) or a Hugging Face model id (its cache, HF_HOME, HF_HUB_OFFLINE)")  # fmt: skip
    add_source_arguments(parser)
    add("--device", choices=DEVICES, default=env.device, help="auto: cuda when available, else cpu")
    add("--dtype", choices=DTYPE_CHOICES, default=None,
        help="weights and KV cache (default: float32 on cpu, bfloat16 on cuda; auto: the checkpoint's torch_dtype)")  # fmt: skip
    add("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights from config.json")
    add("--quantization", choices=QUANTIZATIONS, default=None,
        help="fp8: quantize an unquantized checkpoint's projections and MoE experts to FP8 at load, per output channel (FP8 checkpoints "
             "load as shipped without it)")  # fmt: skip
    add("--logprobs-mode", choices=LOGPROBS_MODES, default="raw",
        help="raw: logprobs of the model's own distribution; processed: after temperature")  # fmt: skip
    add("--chunked-prefill-size", type=int, default=DEFAULT_CHUNKED_PREFILL_SIZE,
        help="tokens per scheduler step (prefill chunks and decode tokens together)")  # fmt: skip
    add("--max-prefill-tokens", type=int, default=None,
        help=f"tokens per scheduler step while no request decodes (a prompt arriving alone); at least --chunked-prefill-size "
             f"(default: the larger of {DEFAULT_MAX_PREFILL_TOKENS} and --chunked-prefill-size)")  # fmt: skip
    add("--max-running-requests", type=int, default=None,
        help=f"most requests decoded at once (default: on CUDA without a drafter, one per {KV_TOKENS_PER_RUNNING_REQUEST} KV cache tokens, "
             f"{DEFAULT_MAX_RUNNING_REQUESTS} to {MAX_DEFAULT_RUNNING_REQUESTS}, in steps of 64; elsewhere {DEFAULT_MAX_RUNNING_REQUESTS})")  # fmt: skip
    add("--prefix-caching", "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="keep full KV blocks after their requests and share them with later requests that start with the same "
             "tokens (default on; --no-prefix-caching or --disable-radix-cache turns it off)")  # fmt: skip
    add("--disable-radix-cache", dest="prefix_caching", action="store_false", help=argparse.SUPPRESS)
    add("--overlap-decode", action=argparse.BooleanOptionalAction, default=True,
        help="launch each decode step (and arrivals' first prompt chunks beside it) before the last one's tokens are "
             "read back, so the device does not wait for the host between decode steps (default on)")  # fmt: skip
    add("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    add("--tensor-parallel-size", "--tp", type=int, default=1, dest="tensor_parallel_size",
        help="shard the model over this many ranks (GPUs cuda:0..N-1; processes on cpu), one scheduler")  # fmt: skip
    add("--kv-cache-memory-fraction", type=float, default=None,
        help=f"CUDA: the share of device memory left free by the weights (a drafter's included) that the KV caches take "
             f"(default {CUDA_KV_CACHE_FRACTION}; {DRAFTER_KV_CACHE_FRACTION} with a drafter)")  # fmt: skip
    add("--deterministic", "--enable-deterministic-inference", dest="deterministic",
        action=argparse.BooleanOptionalAction, default=env.deterministic,
        help="every id and logprob a request gets back depends on that request alone, not on the batch, the prompt's "
             "chunking or speculation: batch-invariant matmuls, norms, attention and logprobs (SPARKWIRE_DETERMINISTIC; "
             "SGLang's --enable-deterministic-inference, vLLM's VLLM_BATCH_INVARIANT; default off)")  # fmt: skip
    add("--step-trace", default=None, metavar="DIR",
        help="write one JSON line per scheduler step to DIR/<instance id>.jsonl: its wall time, shape and waits "
             "(read by ops/bench/step_trace_summary.py; default off)")  # fmt: skip


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The DSpark flags, shared by `sparkwire scheduler` and `sparkwire up`."""
    parser.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS, default="none",
                        help="dspark: DSpark block speculative decoding (exact logprobs, lossless sampling)")
    parser.add_argument("--draft-model", default=None, help="DSpark draft model directory (default: the bundled drafter)")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                        help="draft tokens per block (gamma); default: the drafter's block size")
    parser.add_argument("--draft-context-window", type=int, default=None,
                        help="context positions before its anchor a draft block attends to; default: the draft config's "
                             "sparkwire_context_window (its training length), else all; 0: all")  # fmt: skip
    parser.add_argument("--verify-mode", choices=VERIFY_MODES, default="static",
                        help="static: verify every draft; compact: per request, the drafts whose calibrated survival pays "
                             "for their share of the step (the drafter's dspark_sps.json / dspark_sts.json; needs a "
                             "confidence head)")  # fmt: skip


# The CUDA on/off switches: flag name -> (default, help). `add_cuda_arguments` declares each as
# --NAME / --no-NAME and `scheduler_argv` hands each on, from this one table.
CUDA_SWITCHES = {
    "ragged-cuda-graphs": (True, "CUDA: replay ragged steps (prefill chunks beside decodes, compact verify) from CUDA graphs "
                                 "captured on first use of each padded shape (default on; elsewhere it does nothing)"),
    "logprob-cuda-graphs": (True, "CUDA: compute output logprobs (top-k, requested ids) of up to 128 rows from CUDA graphs "
                                  "captured on first use of each padded shape (default on; elsewhere it does nothing)"),
    "greedy-logprob-graphs": (True, "CUDA, with --logprob-cuda-graphs: a greedy decode step whose every request asks for "
                                    "output logprobs takes its tokens (the argmax) and rows from one graph over the decode "
                                    "graph's logits, read back without a concatenation (default on: bit-identical, and "
                                    "less host time a step)"),
    "fused-kernels": (True, "CUDA with Triton: run each layer's norms, residual adds, RoPE, K/V write and SiLU * up "
                            "as fused Triton kernels (default on; elsewhere it does nothing)"),
    "fused-logprobs": (True, "CUDA with Triton: compute raw-mode logprobs (log-softmax, top-k up to 64, the target's and "
                             "requested ids') in fused Triton kernels reading the logits in place (default on; elsewhere it does nothing)"),
    "dense-prefill": (True, "CUDA: attend the long queries of steps past --chunked-prefill-size (a prompt alone, "
                            "up to --max-prefill-tokens) in one dense call each (--dense-attention) instead of the varlen kernel "
                            "(default on: such steps run without graphs anyway; elsewhere it does nothing)"),
    "split-kv-decode": (DEFAULT_SPLIT_KV_DECODE,
                        "CUDA with Triton: split each sequence's keys across several decode attention programs when "
                        "the batch leaves SMs idle (flash-decoding; default on: small batches at long contexts decode "
                        "much faster; a batch that fills the SMs gets one split, the same kernel; elsewhere it does "
                        "nothing)"),
}  # fmt: skip


def add_cuda_arguments(parser: argparse.ArgumentParser) -> None:
    """CUDA-graph and CUDA-kernel flags, shared by `sparkwire scheduler` and `sparkwire up`."""
    for name, (default, help_text) in CUDA_SWITCHES.items():
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help_text)
    parser.add_argument("--dense-attention", choices=DENSE_ATTENTION_CHOICES, default="auto",
                        help="the kernel of --dense-prefill: flash4 (FlashAttention-4, pip install -e '.[flash4]'; "
                             "Hopper or Blackwell), sdpa (torch SDPA, cuDNN first); auto: flash4 where it runs, else sdpa")  # fmt: skip


def scheduler_argv(args: argparse.Namespace) -> list[str]:
    """Every flag above back as argv (--model and --max-model-len aside: `sparkwire up` gives
    those to the tokenizer too), for `sparkwire up` to pass to its scheduler."""
    argv = ["--device", args.device, "--load-format", args.load_format, "--logprobs-mode", args.logprobs_mode]
    argv += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    argv += ["--max-running-requests", str(args.max_running_requests)] if args.max_running_requests is not None else []
    argv += ["--max-prefill-tokens", str(args.max_prefill_tokens)] if args.max_prefill_tokens is not None else []
    argv += ["--kv-cache-memory-fraction", str(args.kv_cache_memory_fraction)] if args.kv_cache_memory_fraction is not None else []
    argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    argv += ["--overlap-decode" if args.overlap_decode else "--no-overlap-decode"]
    argv += ["--deterministic" if args.deterministic else "--no-deterministic"]
    argv += ["--prefix-caching" if args.prefix_caching else "--no-prefix-caching"]
    argv += ["--step-trace", args.step_trace] if args.step_trace else []
    argv += ["--dtype", args.dtype] if args.dtype else []
    argv += ["--quantization", args.quantization] if args.quantization else []
    argv += [f"--{name}" if getattr(args, name.replace("-", "_")) else f"--no-{name}" for name in CUDA_SWITCHES]
    argv += ["--dense-attention", args.dense_attention]
    argv += ["--speculative-algorithm", args.speculative_algorithm, "--verify-mode", args.verify_mode]
    if args.draft_model:
        argv += ["--draft-model", args.draft_model]
    if args.speculative_num_draft_tokens is not None:
        argv += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    if args.draft_context_window is not None:
        argv += ["--draft-context-window", str(args.draft_context_window)]
    return argv
