"""The benchmarks' one door into the scheduler's construction and internals.

The scheduler modules whose names and signatures move with the scheduler's refactor (`core`,
`policy`, `worker`, `request`, `service`, `config`, `flags`, `wire`, `host_io`, and the DSpark
loaders a core is built with) are imported here and nowhere else under ops/bench
(tests/ops/bench/test_layout.py holds that). When those APIs change, this module changes and the
benchmarks keep calling the same functions:

- `new_request`: a request as the core takes it;
- `core_for(runner, ...)`: a core over an already loaded runner, with the options a benchmark sets
  (and `simulated_accept_len`: DSpark verify steps that keep a chosen number of drafts);
- `served_core(...)`: a core built exactly as `sparkwire scheduler` builds it;
- `dspark_proposer(...)`: a drafter for a runner, on draft graphs where the runner decodes on CUDA
  (`random_dspark_proposer`, `tiny_draft_config`: drafters for the smoke runs);
- `runner_of`, `proposer_of`, `num_steps`, `core_counts`, `last_step`, `prompt_logprob_rows`: what
  benchmarks read off a core and its outputs;
- `StandInOutput` / `token_batches`: a stand-in scheduler's outputs through the real wire code;
- `host_step_pieces` / `publish`: the functions `host_step_cost` times, and the service's encoding.

torch is imported only by the functions that build or run a core, so the stand-ins (front-end
benchmarks, no torch) can use this module too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from contracts.detokenizer import Finish, TokenBatch
from contracts.scheduler import LogprobParams, SamplingParams
from services.common.logprob_rows import RequestLogprobs, RowLogprobs
from services.scheduler import wire
from services.scheduler.flags import DEFAULT_CHUNKED_PREFILL_SIZE, DEFAULT_MAX_PREFILL_TOKENS
from services.scheduler.request import RequestOutput, SchedulerRequest

CHUNKED_PREFILL_SIZE = DEFAULT_CHUNKED_PREFILL_SIZE  # the policy's chunk budget as served
MAX_PREFILL_TOKENS = DEFAULT_MAX_PREFILL_TOKENS  # tokens per step while nothing decodes, as served
KV_BLOCK_SIZE = 16  # the paged cache's tokens per block (SchedulerConfig's default; checked by a test)


# ---- requests and cores ----


def new_request(rid: str, prompt: np.ndarray, sampling: SamplingParams, logprobs: LogprobParams | None = None,
                detokenizer: str = "d") -> SchedulerRequest:  # fmt: skip
    """prompt: int32 [P]."""
    return SchedulerRequest(rid, prompt, detokenizer, sampling, logprobs or LogprobParams())


def core_for(runner, *, max_running_requests: int, chunked_prefill_size: int, proposer=None,
             simulated_accept_len: int | None = None, accept_replay=None, **options: Any):  # fmt: skip
    """A `SchedulerCore` over `runner`. options: max_model_len, logprobs_mode, logprob_graphs,
    greedy_logprob_graphs, fused_logprobs, overlap_decode, max_prefill_tokens, verify_mode,
    verify_step_cost, tokenizer_dir (for grammars; the core's own defaults where left out).
    simulated_accept_len: every verify keeps that many tokens whatever the target says;
    accept_replay (`accept_replay.AcceptReplay`): each request's verify at each step keeps a length
    drawn from it, and in `compact` the drafter's confidences are the replay's hazards (both need a
    proposer) — timings at a chosen acceptance, never the model's output."""
    from services.scheduler import build
    from services.scheduler.core import SchedulerCore

    settings = build.CoreSettings.of(max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size, **options)
    if simulated_accept_len is not None:
        from ops.bench.accept_replay import AcceptReplay

        accept_replay = AcceptReplay.fixed(proposer.num_draft_tokens, simulated_accept_len)
    if accept_replay is None:
        return build.assemble_core(runner, settings, proposer)
    if settings.verify_mode == "compact":
        proposer = _HazardConfidences(proposer, accept_replay.hazards())
    worker = _simulated_accept_worker()(accept_replay.sampler(runner.device), runner, settings.worker, proposer)
    return SchedulerCore(worker, build.make_policy(runner, settings, proposer), overlap_decode=settings.overlap_decode)


def served_core(model: Path, *, device: str, **config: Any):
    """A core as `sparkwire scheduler` builds it (graphs, fused kernels, logprob kernels, a drafter
    with `speculative_algorithm="dspark"`). config: `SchedulerConfig` fields (draft_model,
    draft_context_window, max_running_requests, num_kv_blocks, kv_block_size, load_format, ...)."""
    from services.scheduler.build import build_core
    from services.scheduler.config import SchedulerConfig

    return build_core(SchedulerConfig(model=str(model), device=device, **config))


def scheduler_config(argv: list[str]):
    """The `SchedulerConfig` of `sparkwire scheduler ARGV`, parsed as the command parses it."""
    import argparse

    from services.scheduler import __main__ as scheduler_cli

    parser = argparse.ArgumentParser(prog="sparkwire scheduler")
    scheduler_cli.add_arguments(parser)
    return scheduler_cli.config_from_args(parser.parse_args(argv))


def build_stages(config) -> list[tuple[str, Any]]:
    """`build.build_core`'s stages one at a time: (name, call) pairs, each call taking the results of
    the stages before it (name -> result) and returning its own."""
    from services.scheduler import build

    return [
        ("load_runner", lambda done: build.load_runner(config)),
        ("load_proposer", lambda done: build.load_proposer(config, done["load_runner"])),
        ("resolve", lambda done: build.resolve(config, done["load_runner"])),
        ("prepare_runtime", lambda done: build.prepare_runtime(config, done["resolve"], done["load_runner"], done["load_proposer"])),
        ("assemble_core", lambda done: build.assemble_core(done["load_runner"], done["resolve"], done["load_proposer"])),
    ]


def serve_replayed(argv: list[str], replay_for) -> int:
    """BENCHMARK ONLY: `sparkwire scheduler ARGV`, built as `build_core` builds it, but with DSpark
    acceptance replayed (`replay_for(gamma)` -> an `AcceptReplay`); plain without a drafter. Serves
    over NATS until SIGTERM, like the real one."""
    import argparse
    import asyncio

    from services.common.lifecycle import leave, run_service, stop_on_signals
    from services.common.logging import configure_logging
    from services.scheduler import __main__ as scheduler_cli
    from services.scheduler import build
    from services.scheduler.core import SchedulerCore
    from services.scheduler.service import SchedulerService, connect

    parser = argparse.ArgumentParser(prog="replayed scheduler")
    scheduler_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    config = scheduler_cli.config_from_args(args)
    done: dict[str, Any] = {}
    for name, call in build_stages(config)[:-1]:  # all but assembling the core, which replays acceptance here
        done[name] = call(done)
    runner, proposer, settings = done["load_runner"], done["load_proposer"], done["resolve"]
    if proposer is None:
        core = build.assemble_core(runner, settings)
    else:
        replay = replay_for(proposer.num_draft_tokens)
        if settings.verify_mode == "compact":
            proposer = _HazardConfidences(proposer, replay.hazards())
        worker = _simulated_accept_worker()(replay.sampler(runner.device), runner, settings.worker, proposer)
        core = SchedulerCore(worker, build.make_policy(runner, settings, proposer), overlap_decode=settings.overlap_decode)

    async def serve() -> int:
        stop = asyncio.Event()
        stop_on_signals(stop)
        return await SchedulerService(config, core).run(await connect(config), stop)

    return leave(run_service(serve()))


def dspark_proposer(runner, draft: Path, load_format: str = "dummy", confidences: bool = True):
    """A DSpark drafter for `runner`, replaying draft graphs where the runner decodes on CUDA (as
    `build_core` serves it); the runner's decode graphs then capture the verify width too.
    confidences: its blocks carry them (`compact`; `static` serves without)."""
    from services.scheduler.spec.dspark_loader import load_dspark_proposer

    from services.scheduler.model.batch_invariant import set_batch_invariant

    proposer = load_dspark_proposer(draft, runner, load_format=load_format, confidences=confidences)
    set_batch_invariant(proposer.drafter, runner.batch_invariant)  # as `build.load_proposer`
    if runner.decode_kernel:
        from services.scheduler.spec.draft_graphs import DraftGraphs

        proposer = DraftGraphs(proposer)
        if not runner.batch_invariant:  # a batch-invariant runner's steps are all ragged
            runner.prepare_decode_graphs(query_lens=(1, proposer.num_draft_tokens + 1), capture_layers=tuple(proposer.capture_layers))
    return proposer


def dspark_drafter(runner, draft: Path, load_format: str = "auto"):
    """The drafter network at `draft` (`DSparkDrafter`) over `runner`'s embedding and LM head."""
    from services.scheduler.spec.dspark_loader import load_dspark_proposer

    return load_dspark_proposer(draft, runner, load_format=load_format).drafter.eval()


def random_dspark_proposer(runner, block_size: int = 7, seed: int = 3):
    """A one-layer DSpark drafter with random weights over `runner`'s embedding and LM head (no files):
    verify steps of gamma = block_size with drafts that mean nothing, for counting and timing."""
    from services.scheduler.spec.dspark import DSparkProposer
    from services.scheduler.spec.dspark_config import draft_config_for_target
    from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights

    config = draft_config_for_target(runner.config, num_draft_layers=1, mask_token_id=5, block_size=block_size, markov_rank=8)
    drafter = empty_drafter(config, runner.model.model.embed_tokens, runner.lm_head_weight)
    fill_random_weights(drafter, seed=seed)
    return DSparkProposer(drafter.eval(), runner.num_blocks, runner.block_size)


def tiny_draft_config(target: Path, into: Path) -> Path:
    """A one-layer DSpark draft config (block size 3) for `target`, written to `into`: the smoke
    runs' drafter, with dummy weights."""
    import json

    from services.scheduler.model.config import ModelConfig
    from services.scheduler.spec.dspark_config import draft_config_for_target

    config = draft_config_for_target(ModelConfig.from_pretrained(target), num_draft_layers=1, mask_token_id=5, block_size=3, markov_rank=4)
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(config.to_dict()))
    return into


def on_tiny_pair(args, measure) -> int:
    """`measure(args)` with `args.target` / `args.draft` the tiny random target and a one-layer
    dummy drafter for it (the smoke runs of the DSpark benchmarks)."""
    import tempfile

    from ops.bench.common import TINY_MODEL

    with tempfile.TemporaryDirectory(prefix="sparkwire-tiny-draft-") as tmp:
        args.target, args.draft = TINY_MODEL, tiny_draft_config(TINY_MODEL, Path(tmp))
        return measure(args)


@functools.cache
def _simulated_accept_worker() -> type:
    """`ModelWorker`'s benchmark subclass, defined on first use (its module needs torch)."""
    import torch

    from services.scheduler.worker import ModelWorker

    if not callable(getattr(ModelWorker, "_accept", None)):  # an override of nothing would time the model's own acceptance
        raise TypeError("ModelWorker has no _accept(block) to override: the replayed acceptance would be ignored")

    class SimulatedAcceptWorker(ModelWorker):
        """BENCHMARK ONLY: every verify keeps min(n - 1, k) of its k drafts, n drawn per row from the
        replay whatever the target says, so a draft/verify loop is timed at a chosen acceptance (the
        output is not the model's)."""

        def __init__(self, draw, runner, options, proposer) -> None:
            super().__init__(runner, options, proposer)
            self.draw = draw

        def _accept(self, block):
            num_accepted = torch.minimum(self.draw(block.num_draft.shape[0]) - 1, block.num_draft)  # [P]
            return num_accepted, block.target_argmax.gather(1, num_accepted[:, None])[:, 0]

    return SimulatedAcceptWorker


class _HazardConfidences:
    """BENCHMARK ONLY: a proposer whose blocks carry the replay's hazards as confidences (a head
    calibrated on the replayed acceptance, with nothing to tell requests apart)."""

    def __init__(self, proposer, hazards: list[float]) -> None:
        self.proposer, self.hazards = proposer, hazards
        self.num_draft_tokens, self.capture_layers, self.has_confidence = proposer.num_draft_tokens, proposer.capture_layers, True

    def inject(self, context) -> None:
        self.proposer.inject(context)

    def propose(self, request):
        import dataclasses

        import torch

        proposal = self.proposer.propose(request)
        gamma = proposal.tokens.shape[1]
        hazards = torch.tensor(self.hazards[:gamma], device=proposal.tokens.device).expand(proposal.tokens.shape[0], gamma)
        return dataclasses.replace(proposal, confidence=hazards)


# ---- reading a core ----


def runner_of(core):
    return core.worker.runner


def proposer_of(core):
    """The core's drafter; a `DraftGraphs` wrapper's inner proposer is `.proposer`."""
    return core.worker.proposer


def last_step(core):
    """The last step's record (`num_prefill_tokens`, ...), None before the first."""
    return core.last_step


def num_steps(core) -> int:
    """Steps the core has run (the step index its outputs are published with)."""
    return core.num_steps


def accept_length_counts(core) -> list[int]:
    """Verify passes by tokens gained (index = tokens, the bonus included), as `spec_accept_lengths`."""
    return list(core.stats().accept_lengths)


def core_counts(core) -> dict[str, int]:
    return {"waiting": core.policy.num_waiting, "running": core.policy.num_running, "preemptions": core.num_preemptions,
            "steps": core.num_steps}  # fmt: skip


def prompt_logprob_rows(output) -> int:
    """Prompt positions whose logprobs one step's output of a request carries."""
    entries = output.logprobs
    return entries.prompt.num_rows if entries and entries.prompt is not None else 0


# ---- stand-in schedulers: outputs through the scheduler's own message code ----


@dataclass
class StandInOutput:
    """What a stand-in scheduler emits for one request in one step."""

    rid: str
    detokenizer_id: str
    token_ids: list[int]
    prompt_tokens: int
    finish: Finish | None = None
    output_logprobs: np.ndarray | None = None  # f32 [n]; None: the request asked for none
    output_top: tuple[np.ndarray, np.ndarray] | None = None  # (f32 [n, k], i32 [n, k])
    prompt_token_logprobs: np.ndarray | None = None  # f32 [P], NaN where nothing predicts
    prompt_top_flat: tuple[np.ndarray, np.ndarray, int] | None = None  # (f32 [rows, k], i32 [rows, k], null prefix)


def token_batches(outputs: list[StandInOutput], scheduler_id: str, step: int) -> dict[str, TokenBatch]:
    """Detokenizer id -> the step's `TokenBatch`, built by `wire.to_token_batches` as the scheduler builds it."""
    return wire.to_token_batches([_request_output(o) for o in outputs], scheduler_id, step)


def _request_output(out: StandInOutput) -> RequestOutput:
    return RequestOutput(out.rid, out.detokenizer_id, out.token_ids, out.prompt_tokens, out.finish, _entries(out))


def _entries(out: StandInOutput) -> RequestLogprobs | None:
    if out.output_logprobs is None:
        return None
    top_values, top_ids = out.output_top or (None, None)
    entries = RequestLogprobs(output=RowLogprobs.of(out.output_logprobs, top_values, top_ids))
    if out.prompt_token_logprobs is not None:
        entries.prompt = RowLogprobs.of(out.prompt_token_logprobs, start=0)
    if out.prompt_top_flat is not None:
        values, ids, null_prefix = out.prompt_top_flat
        entries.flat = RowLogprobs.of(None, values, ids, start=null_prefix)
    return entries


# ---- host step cost: the pieces of a decode step's host work ----


@functools.cache
def host_step_pieces() -> dict[str, list[tuple[object, str]]]:
    """piece -> (owner, attribute) of the functions `host_step_cost` times for it; an attribute an
    older tree lacks is left out by the timer."""
    from services.scheduler import core, policy, step_counts
    from services.scheduler.host_io import HostReadback, HostUpload, PendingReadback
    from services.scheduler.worker import logprob_asks, readback, token_pool
    from services.scheduler.worker import worker as worker_module

    parts = readback.StepParts
    return {
        "schedule": [(policy.Policy, "schedule"), (policy.Policy, "expect")],  # planned ahead: the latter too
        "inputs": [(worker_module, "ask"), (worker_module, "forward_arrays"), (worker_module, "accept_arrays"),
                   (logprob_asks.LogprobAsks, "inputs"), (token_pool.TokenPool, "host_arrays"), (HostUpload, "send")],  # fmt: skip
        "readback": [(parts, "verify"), (parts, "greedy"), (parts, "logprobs"), (HostReadback, "start"), (PendingReadback, "wait")],
        "unpack": [(parts, "results")],
        "update": [(policy.Policy, "update")],
        "core": [(step_counts.StepCounts, "count"), (core.SchedulerCore, "_finished"), (step_counts.QueueTimes, "scheduled")],
    }


def publish(outputs, step: int, encoder: msgspec.msgpack.Encoder) -> int:
    """What the service does with a step's outputs before the network: bytes encoded."""
    size = 0
    for batch in wire.to_token_batches(outputs, "s", step).values():
        buffer = bytearray()
        encoder.encode_into(batch, buffer)
        size += len(buffer)
    return size
