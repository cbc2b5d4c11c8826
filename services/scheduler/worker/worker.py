"""The model worker: runs a `StepPlan` on the device and hands back per-sequence results.

One `launch` (then `collect`, which waits for the readback):

    1. lay out      host arrays of the ragged batch (queries, slots, tables, verify rows), the
                    logprob rows asked for and the token pool's rows (`layout.py`, `logprob_asks.py`)
    2. upload       one non-blocking copy from a pinned buffer (`HostUpload`)
    3. forward      the target over every query token (a sequence's last sampled token taken from
                    the device token pool: `token_pool.py`), the proposer's layers captured
    4. verify       logits of each producing sequence's last 1 + k rows; the accept rule
                    (`spec.accept`) keeps the longest valid draft prefix and one more token, which
                    goes into the token pool
    5. logprobs     prompt rows and the rows of every produced token, on the device
    6. propose      the drafter takes the step's rows as context and drafts the next blocks
    7. read back    one device->host copy carries tokens, counts, drafts and logprob rows (`readback.py`)

Plain decoding is k = 0: the accept rule then reduces to the sampler's draw from the last row.
The worker keeps sequence lengths on the host, so nothing is read back to plan attention, and it
reads nothing of the policy but the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.scheduler.host_io import HostReadback, HostUpload, PendingReadback
from services.scheduler.grammar import GrammarBlock, GrammarMatchers
from services.scheduler.logits_processing import (
    KeptPenalties, PenalizedBlock, ProcessorRows, apply_processors, apply_token_bitmask,
)  # fmt: skip
from services.scheduler.logprob_graphs import GreedyRows, LogprobGraphs
from services.scheduler.logprobs import TopKKeys, logprobs_on_device
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.runner import triton_available
from services.scheduler.plan import SeqResult, SeqStep, StepPlan
from services.common.logprob_rows import RowLogprobs
from services.scheduler.sampler import draw_noise, mix_seed, sampling_weights
from services.scheduler.spec.accept import VerifyBlock, accept
from services.scheduler.spec.base import ContextRows, DraftRequest, Proposer
from services.scheduler.worker.draft_probs import DraftProbs
from services.scheduler.worker.layout import ShardSplit, StepLayout, accept_arrays, forward_arrays
from services.scheduler.worker.logprob_asks import OUTPUT_LP, PROMPT_LP, LogprobAsks, LogprobJobs, ask, section
from services.scheduler.worker.readback import DeviceTimes, StepClock, StepParts
from services.scheduler.worker.token_pool import TokenPool
from services.scheduler.worker.verified import Verified, accepted_argmax, block_tokens, merged, rows_of

DRAFT_SALT = 0x2545F4914F6CDD1D  # draft sampling noise: its own stream of the request's seed


@dataclass(frozen=True)
class WorkerOptions:
    """logprob_graphs: output logprobs from `LogprobGraphs` (captured on CUDA; elsewhere its padded
    eager twin). greedy_logprob_graphs: with them, a plain greedy decode graph step whose every
    sequence wants output logprobs takes its tokens and rows from `LogprobGraphs.greedy`
    (`_greedy_rows`). fused_logprobs: raw-mode logprobs from the Triton kernels
    (`logprobs.runs_fused`), only where Triton runs (CUDA; the interpreter in tests); None: on CUDA
    with Triton, as served."""

    logprobs_mode: str = "raw"
    logprob_graphs: bool = False
    greedy_logprob_graphs: bool = False
    fused_logprobs: bool | None = None
    tokenizer_dir: str | None = None  # the model directory whose tokenizer.json grammars compile against


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose device work and readback are queued (`ModelWorker.launch`)."""

    plan: StepPlan
    layout: StepLayout
    parts: StepParts
    readback: PendingReadback
    clock: StepClock


class ModelWorker:
    def __init__(self, runner, options: WorkerOptions = WorkerOptions(), proposer: Proposer | None = None) -> None:
        self.runner = runner
        self.proposer = proposer
        self.vocab_size = runner.config.vocab_size
        self._processed = options.logprobs_mode == "processed"
        self._top_k_keys = TopKKeys.build(self.vocab_size, runner.device)
        fused = options.fused_logprobs
        self._fused_logprobs = runner.device.type == "cuda" and triton_available() if fused is None else fused
        capture = runner.device.type == "cuda"
        self._invariant_logprobs = runner.batch_invariant  # the kernels' splits from the vocabulary alone
        graphs = LogprobGraphs(self._top_k_keys, capture=capture, fused=self._fused_logprobs,
                               invariant=self._invariant_logprobs) if options.logprob_graphs else None  # fmt: skip
        self.logprob_graphs = graphs
        self.greedy_logprob_graphs = options.greedy_logprob_graphs
        self._upload = HostUpload(runner.device)
        self._to_columns = None if runner.sharded_rows is None else runner.sharded_rows.columns  # a vocabulary shard's logprobs
        self._readback = HostReadback()
        self._pool = TokenPool(runner.device)
        self._draft_probs = DraftProbs()
        self._penalties = KeptPenalties()  # penalized requests' counts on the device, kept across steps
        self.grammars = GrammarMatchers(options.tokenizer_dir, self.vocab_size, runner.config.eos_token_ids)
        self._device_times = DeviceTimes()
        self.last_forward_s = 0.0  # the last step's forward + verify + logprobs, device time on CUDA
        self.last_draft_s = 0.0  # the last step's inject + propose
        self.last_wait_s = 0.0  # how long the host waited for the last collected step's readback

    @property
    def num_host_reads(self) -> int:
        return self._readback.num_copies

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self._draft_probs.release(rid)
            self._penalties.release(rid)
            self.grammars.release(rid)
            self._pool.release(rid)

    def execute(self, plan: StepPlan) -> list[SeqResult]:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the step's device work and its readback (1-7) without waiting for the device."""
        layout = StepLayout.of(plan)  # 1
        wanted = ask(plan, layout, self._processed)
        host_arrays = forward_arrays(plan, layout, self.runner.kv_cache.trash_block) | wanted.inputs(self._processed)
        host_arrays |= self._pool.host_arrays(plan, layout)
        if not self._plain_greedy(plan, layout):
            host_arrays |= accept_arrays(plan, layout)
        arrays = self._upload.send(host_arrays)  # 2
        arrays["input_ids"] = self._pool.input_ids(arrays)
        clock = StepClock(self.runner.device)
        out = self.runner.forward(self._batch(plan, arrays))  # 3
        greedy = self._greedy_rows(plan, layout, wanted, arrays, out)  # 4 and 5's output rows at once, or None
        verified = greedy[0] if greedy is not None else self._verify(plan, layout, out, arrays)  # 4
        parts = StepParts(self._readback)
        if verified is not None:
            self._pool.put(arrays, verified.next_token)
            if greedy is None:
                parts.verify(verified.num_accepted, verified.tokens)
            else:
                parts.greedy(greedy[1])  # the tokens and the output rows, as one part
        output_rows = greedy[1].rows if greedy is not None else None
        parts.logprobs(self._logprobs(wanted, arrays, out.hidden_states, verified, output_rows))  # 5
        clock.mark()
        proposal = self._propose(plan, layout, out.captured, arrays, verified)  # 6
        parts.proposal(proposal)
        if self.proposer is not None:
            clock.mark()
        pending = self._readback.start()  # 7
        self._draft_probs.keep(plan, layout.producers, proposal)
        return LaunchedStep(plan, layout, parts, pending, clock)

    def collect(self, launched: LaunchedStep) -> list[SeqResult]:
        """Wait for a launched step's readback; its per-sequence results."""
        waited = time.perf_counter()
        host = launched.readback.wait()
        self.last_wait_s = time.perf_counter() - waited
        self.last_forward_s, self.last_draft_s = self._device_times.read(launched.clock)
        return launched.parts.results(launched.plan, launched.layout, host)

    def _batch(self, plan: StepPlan, arrays: dict[str, torch.Tensor]) -> ForwardBatch:
        capture = self.proposer.capture_layers if self.proposer is not None else ()
        return ForwardBatch(
            input_ids=arrays["input_ids"],
            positions=arrays["positions"],
            query_start_loc=arrays["query_start_loc"],
            seq_lens=arrays["seq_lens"],
            block_tables=arrays["block_tables"],
            slot_mapping=arrays["slots"],
            capture_layers=tuple(capture),
            host_query_lens=tuple(s.num_query for s in plan.steps),
            host_seq_lens=tuple(s.start + s.num_query for s in plan.steps),
        )

    # 4. verify

    def _verify(self, plan: StepPlan, layout: StepLayout, out, arrays: dict[str, torch.Tensor]) -> Verified | None:
        if not layout.producers:
            return None
        if self.runner.sharded_rows is not None and not self._processed:
            return self._verify_on_shards(plan, layout, out, arrays)
        producers = [plan.steps[i] for i in layout.producers]
        if layout.verifies_every_row:  # a decode step: its rows are the producers', in order
            logits = out.logits if out.logits is not None else self.runner.compute_logits(out.hidden_states)  # [P, V]
        else:
            rows = arrays["verify_rows"].reshape(-1)
            # a graph step computed every row's logits already
            logits = out.logits[rows] if out.logits is not None else self.runner.compute_logits(out.hidden_states[rows])
        return self._choose(plan, producers, logits.view(len(producers), layout.max_draft + 1, -1), arrays)

    def _choose(self, plan: StepPlan, producers: list[SeqStep], logits: torch.Tensor, arrays) -> Verified:
        """The producers' tokens from their whole verify rows' logits f32 [P, K + 1, V] (`arrays`: their
        drafts, num_draft and is_greedy; no drafts: plain greedy decoding)."""
        # what argmax and sampling see (no pass over the producers where the plan says none processes them)
        chosen = logits if plan.processes_logits is False else self._processed_logits(producers, logits)
        reported = chosen if self._processed else logits  # raw logprobs: before the processors too
        if "drafts" not in arrays:  # plain greedy decoding: the argmax is the token, no draft to accept
            next_token = chosen[:, 0].argmax(dim=-1)
            return Verified(reported, None, next_token, next_token[:, None])
        block = VerifyBlock(
            target_argmax=chosen.argmax(dim=-1),
            drafts=arrays["drafts"],
            num_draft=arrays["num_draft"],
            is_greedy=arrays["is_greedy"].bool(),
            **self._sampling_inputs(producers, chosen, arrays["drafts"]),
        )
        num_accepted, next_token = self._accept(block)  # [P], [P]
        return Verified(reported, num_accepted, next_token, block_tokens(block.drafts, num_accepted, next_token))

    def _accept(self, block: VerifyBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept rule (`spec.accept`). The benchmarks' replayed acceptance overrides this one
        method (ops/bench/scheduler_harness.py), so it stays the only place a verify's length is set."""
        return accept(block)

    def _verify_on_shards(self, plan: StepPlan, layout: StepLayout, out, arrays) -> Verified:
        """Tensor parallelism, raw logprobs: the producers' verify rows drawn from the ranks' vocabulary
        shards as TP = 1 draws them from whole rows (`TensorParallel.sample`; a block accepted on those
        argmaxes), but for those `ShardSplit` sends whole, whose rows alone are gathered (`_choose`).
        Every row's output logprobs come from the shards (raw: before any processor)."""
        width, split = layout.max_draft + 1, ShardSplit.of(plan, layout, frozenset(self.runner.config.eos_token_ids))
        hidden = out.hidden_states if layout.verifies_every_row else out.hidden_states[arrays["verify_rows"].reshape(-1)]  # [P W, H]
        parts = []
        if split.on_shards:
            picked = hidden if not split.whole else hidden[torch.from_numpy(split.rows(split.on_shards, width)).to(hidden.device)]
            drawn = self.runner.sharded_rows.sample(picked, split.draws).view(-1, width)  # [S, W]
            parts.append((split.on_shards, accepted_argmax(drawn, rows_of(arrays, split.on_shards, split.whole))))
        if split.whole:
            rows = torch.from_numpy(split.rows(split.whole, width)).to(hidden.device)
            logits = self.runner.compute_logits(hidden[rows]).view(len(split.whole), width, -1)  # [W, K + 1, V]
            producers = [plan.steps[layout.producers[p]] for p in split.whole]
            parts.append((split.whole, self._choose(plan, producers, logits, rows_of(arrays, split.whole, split.on_shards))))
        return merged(parts, len(layout.producers), hidden)

    def _greedy_rows(self, plan: StepPlan, layout: StepLayout, wanted: LogprobAsks, arrays, out) -> tuple[Verified, GreedyRows] | None:
        """A plain greedy decode graph step whose every producer wants output logprobs (the commonest
        step with them): its tokens and rows from `LogprobGraphs.greedy`, one graph over the decode
        graph's logits, which also takes the argmax (padded rows: `Verified`). None: `_verify` and
        `_logprobs` take the step."""
        if not self.greedy_logprob_graphs or self.logprob_graphs is None or out.static_logits is None:
            return None
        if not layout.verifies_every_row or "drafts" in arrays:
            return None
        inputs = section(arrays, OUTPUT_LP)
        if wanted.num_output_steps != len(layout.producers) or "rows" in inputs or "targets" in inputs:
            return None
        if _any_processes_logits(plan, (plan.steps[i] for i in layout.producers)):
            return None  # processed logits: the argmax is of others
        found = self.logprob_graphs.greedy([job.query for job in wanted.output], inputs, out.static_logits, self._processed)
        if found is None:
            return None
        tokens = found.tokens  # [R], R >= P
        num_producers = len(layout.producers)
        return Verified(out.logits.view(num_producers, 1, -1), None, tokens[:num_producers], tokens[:, None]), found

    def _plain_greedy(self, plan: StepPlan, layout: StepLayout) -> bool:
        """No drafts, no proposer, every producer greedy: the step's token is the argmax, nothing more
        (no pass over the producers where the plan says no running sequence samples)."""
        if layout.max_draft > 0 or self.proposer is not None:
            return False
        return plan.samples_randomly is False or not any(plan.steps[i].params.samples_randomly for i in layout.producers)

    def _processed_logits(self, producers: list[SeqStep], logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, min_tokens and the penalties (logits_processing.py), per verify row: row j of a
        producer's block has seen its committed outputs and drafts 1..j (rows past its drafts: all of
        them), as `verify_row_contexts` says. [P, K + 1, V]"""
        if not any(s.params.processes_logits for s in producers):
            return logits
        num_producers, width, vocab = logits.shape
        params = [s.params.sampling for s in producers for _ in range(width)]
        num_outputs = [s.output_position + min(j, s.num_draft) for s in producers for j in range(width)]
        blocks = [PenalizedBlock(s.rid, s.params.sampling, s.params.prompt_ids, s.history, s.output_position, s.drafts)
                  if s.params.has_penalties else None for s in producers]  # fmt: skip
        counts, seen = self._penalties.rows(blocks, width, vocab, logits.device)
        eos = [frozenset(self.runner.config.eos_token_ids)] * len(params)
        rows = ProcessorRows(params, num_outputs, eos, counts, seen)
        processed = apply_processors(logits.reshape(-1, vocab), rows)
        return self._grammar_masked(producers, processed, width).view(num_producers, width, vocab)

    def _grammar_masked(self, producers: list[SeqStep], logits: torch.Tensor, width: int) -> torch.Tensor:
        """Each row masked by its grammar's state after the drafts before it (`grammar.py`); the
        host fills the bitmasks here, after the step's forward is queued, so the device is busy meanwhile."""
        found = self.grammars.bitmask([_grammar_block(s) for s in producers], width, pin=logits.is_cuda)
        if found is None:
            return logits
        masks = found.masks.to(logits.device, non_blocking=True)  # int32 [R, W]
        if found.rows is None:  # every producer has a grammar
            return apply_token_bitmask(logits, masks)
        rows = found.rows.to(logits.device, non_blocking=True)  # [R]
        return logits.index_copy(0, rows, apply_token_bitmask(logits[rows], masks))

    def _sampling_inputs(
        self, producers: list[SeqStep], logits: torch.Tensor, drafts: torch.Tensor
    ) -> dict[str, torch.Tensor | None]:
        if not any(s.params.samples_randomly for s in producers):
            return {}
        params = [s.params.sampling for s in producers]
        num_rows, width, vocab = logits.shape
        row_params = [p for p in params for _ in range(width)]
        weights = sampling_weights(logits.reshape(-1, vocab), row_params).view(num_rows, width, vocab)
        seeds = [s.params.seed if s.params.samples_randomly else None for s in producers]
        noise, uniforms = draw_noise(seeds, [s.output_position for s in producers], width - 1, vocab, logits.device)
        draft_probs = self._draft_probs.stacked(producers, drafts, vocab)
        return {"target_weights": weights, "draft_probs": draft_probs, "uniforms": uniforms, "noise": noise}

    # 5. logprobs

    def _logprobs(self, wanted: LogprobAsks, arrays, hidden: torch.Tensor, verified: Verified | None,
                  output_lp: RowLogprobs[torch.Tensor] | None = None) -> LogprobJobs:  # fmt: skip
        """output_lp: the output rows already computed (`_greedy_rows`); None: computed here."""
        prompt = [job.query for job in wanted.prompt]
        prompt_lp = logprobs_on_device(prompt, section(arrays, PROMPT_LP), hidden, self.runner.head_logits,
                                       self._top_k_keys, self._processed, fused=self._fused_logprobs,
                                       to_columns=self._to_columns, invariant=self._invariant_logprobs)  # fmt: skip
        if wanted.output and verified is not None and output_lp is None:
            sampled = verified.tokens.reshape(-1)  # [P * (K + 1)]: each logits row's token, sampled this step
            queries, inputs = [job.query for job in wanted.output], section(arrays, OUTPUT_LP)
            if self.logprob_graphs is not None and verified.logits is not None:
                logits = verified.logits.view(-1, verified.logits.shape[-1])  # [P * (K + 1), V]
                output_lp = self.logprob_graphs.compute(queries, inputs, logits, self._processed, sampled)
            else:  # whole rows; or hidden rows, drawn from vocabulary shards, whose columns come from the shards too
                source = verified.hidden if verified.logits is None else verified.logits.view(-1, verified.logits.shape[-1])
                output_lp = logprobs_on_device(queries, inputs, source, None, self._top_k_keys, self._processed, sampled,
                                               self._fused_logprobs, self._to_columns if verified.logits is None else None,
                                               invariant=self._invariant_logprobs)  # fmt: skip
        return LogprobJobs(wanted.prompt, prompt_lp, wanted.output, output_lp)

    # 6. propose

    def _propose(self, plan, layout, captured, arrays, verified):
        if self.proposer is None:
            return None
        if captured is not None:  # every step's rows, a prompt's chunks that sample nothing too
            self.proposer.inject(ContextRows(captured, arrays["positions"], arrays["slots"]))
        if verified is None:
            return None
        producers = [plan.steps[i] for i in layout.producers]
        request = DraftRequest(
            rids=tuple(s.rid for s in producers),
            anchor_tokens=verified.next_token,
            anchor_positions=arrays["anchor_base"] + verified.num_accepted + 1,
            block_tables=arrays["block_tables"][arrays["producers"]],
            max_anchor_position=max(s.start + s.num_query for s in producers),
            temperatures=tuple(s.params.sampling.temperature for s in producers),
            seeds=tuple(mix_seed(s.params.seed ^ DRAFT_SALT, s.output_position) for s in producers),
        )
        return self.proposer.propose(request)


def _any_processes_logits(plan: StepPlan, steps) -> bool:
    """Whether a processor changes the logits of one of `steps` (of `plan`): no pass over them
    where the plan says none of its sequences' are (`StepPlan.processes_logits`)."""
    return plan.processes_logits is not False and any(s.params.processes_logits for s in steps)


def _grammar_block(step: SeqStep) -> GrammarBlock | None:
    grammar = step.params.sampling.grammar
    if grammar is None:
        return None
    return GrammarBlock(step.rid, grammar, step.history, step.params.num_prompt, step.output_position, step.drafts)

