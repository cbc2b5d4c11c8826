"""The model worker: runs a `StepPlan` on the device and hands back per-sequence results.

One `execute`:

    1. lay out      host arrays of the ragged batch (queries, slots, tables, verify rows)
    2. upload       one non-blocking copy from a pinned buffer (`HostUpload`), logprob row
                    indices and requested ids included
    3. forward      the target over every query token (+ the proposer's layers, captured)
    4. verify       logits of each producing sequence's last 1 + k rows; the accept rule
                    (`spec.accept`) keeps the longest valid draft prefix and one more token
    5. logprobs     prompt rows and the rows of every produced token, on the device
    6. propose      the drafter takes the step's rows as context and drafts the next blocks
    7. read back    one device->host copy carries tokens, counts, drafts and logprob rows

Plain decoding is k = 0: the accept rule then reduces to the sampler's draw from the last row.
The worker keeps sequence lengths on the host, so nothing is read back to plan attention.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from services.scheduler.host_io import HostReadback, HostUpload, PendingReadback
from services.scheduler.logits_processing import KeptPenalties, PenalizedBlock, ProcessorRows, apply_processors
from services.scheduler.logprob_graphs import GreedyRows, LogprobGraphs
from services.scheduler.logprobs import (
    LogprobQuery,
    TopKKeys,
    logprob_inputs,
    logprobs_on_device,
    split_logprobs,
)
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.runner import triton_available
from services.scheduler.policy import FOLLOWED_TOKEN, SeqResult, SeqStep, StepPlan
from services.scheduler.request import HostRows, RowLogprobs, RowSpan, Sequence, are_all_rows, has_penalties
from services.scheduler.sampler import draw_noise, mix_seed, sampling_probs
from services.scheduler.spec.accept import VerifyBlock, accept
from services.scheduler.spec.base import ContextRows, DraftRequest, Proposer

DRAFT_SALT = 0x2545F4914F6CDD1D  # draft sampling noise: its own stream of the request's seed


@dataclass(frozen=True)
class _Layout:
    """Host-side shape of one step (step i owns rows [row_start[i], row_start[i] + len(query))."""

    row_start: list[int]
    producers: list[int]  # indices into plan.steps of the sequences that produce tokens
    max_draft: int  # K: drafts per producer, padded
    verifies_every_row: bool  # one query token per sequence, every one a producer: verify rows are 0..T-1

    def verify_rows(self, plan: StepPlan) -> np.ndarray:
        """int64 [P, K + 1]: rows of each producer's anchor and drafts (padding repeats the last)."""
        steps = [plan.steps[i] for i in self.producers]
        first = np.asarray([self.row_start[i] + s.num_committed - 1 for i, s in zip(self.producers, steps)], np.int64)
        num_draft = np.asarray([s.num_draft for s in steps], np.int64)
        return first[:, None] + np.minimum(np.arange(self.max_draft + 1)[None, :], num_draft[:, None])


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


class ModelWorker:
    def __init__(self, runner, options: WorkerOptions = WorkerOptions(), proposer: Proposer | None = None) -> None:
        self.runner = runner
        self.proposer = proposer
        self.vocab_size = runner.config.vocab_size
        self._processed = options.logprobs_mode == "processed"
        self._top_k_keys = TopKKeys.build(self.vocab_size, runner.device)
        capture = runner.device.type == "cuda"
        fused_logprobs = options.fused_logprobs
        if fused_logprobs is None:
            fused_logprobs = runner.device.type == "cuda" and triton_available()
        self._fused_logprobs = fused_logprobs
        self.logprob_graphs = LogprobGraphs(self._top_k_keys, capture=capture, fused=fused_logprobs) if options.logprob_graphs else None
        self.greedy_logprob_graphs = options.greedy_logprob_graphs
        self._upload = HostUpload(runner.device)
        self._readback = HostReadback()
        self._draft_probs: dict[str, torch.Tensor] = {}  # rid -> q [gamma, V] of its pending block
        self._penalties = KeptPenalties()  # penalized requests' counts on the device, kept across steps
        self.last_forward_s = 0.0  # the last step's forward + verify + logprobs, device time on CUDA
        self.last_draft_s = 0.0  # the last step's inject + propose
        self.last_wait_s = 0.0  # how long the host waited for the last collected step's readback
        self._unread_clocks: list[_StepClock] = []  # steps whose GPU work had not finished when they returned

    @property
    def num_host_reads(self) -> int:
        return self._readback.num_copies

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self._draft_probs.pop(rid, None)
            self._penalties.release(rid)

    def execute(self, plan: StepPlan) -> list[SeqResult]:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's device work and its readback (1-7) without waiting for the device.
        previous: the launched step `plan` follows (`Policy.follow_decodes`): each of plan's decode
        queries is the token its sequence samples in `previous`, taken on the device (see
        `can_follow`); prompt chunks admitted beside them bring their own tokens."""
        layout = _lay_out(plan)  # 1
        wanted = self._logprob_queries(plan, layout)
        host_arrays = self._host_arrays(plan, layout) | wanted.inputs(self._processed)
        followed = None if previous is None else previous.followed(plan, layout)
        if followed is not None:
            host_arrays |= followed.host_arrays()
        arrays = self._upload.send(host_arrays)  # 2
        if followed is not None:
            arrays["input_ids"] = followed.input_ids(previous.next_token, arrays)
        clock = _StepClock(self.runner.device)
        out = self.runner.forward(self._batch(plan, arrays))  # 3
        greedy = self._greedy_rows(plan, layout, wanted, arrays, out)  # 4 and 5's output rows at once, or None
        verified = greedy[0] if greedy is not None else self._verify(plan, layout, out, arrays)  # 4
        handles = _Handles(self._readback)
        if greedy is None:
            handles.verify(verified)
        else:
            handles.greedy(greedy[1])  # the tokens and the output rows, as one part
        output_rows = greedy[1].rows if greedy is not None else None
        handles.logprobs(self._logprobs(wanted, arrays, out.hidden_states, verified, output_rows))  # 5
        clock.mark()
        proposal = self._propose(plan, layout, out.captured, arrays, verified)  # 6
        handles.proposal(proposal)
        if self.proposer is not None:
            clock.mark()
        pending = self._readback.start()  # 7
        self._keep_draft_probs(plan, layout, proposal)
        next_token = verified.next_token if verified is not None else None
        return LaunchedStep(plan, layout, handles, pending, clock, next_token)

    def collect(self, launched: LaunchedStep) -> list[SeqResult]:
        """Wait for a launched step's readback; its per-sequence results."""
        waited = time.perf_counter()
        host = launched.readback.wait()
        self.last_wait_s = time.perf_counter() - waited
        self.last_forward_s, self.last_draft_s = self._step_times(launched.clock)
        return launched.handles.results(launched.plan, launched.layout, host)

    def can_follow(self, plan: StepPlan) -> bool:
        """Whether the step after `plan` may be launched before `plan`'s tokens reach the host: a step
        that samples nothing (prompt chunks) always; otherwise no drafter (its blocks come back with
        the tokens), and nothing of a producer's sampling reads its token history on the host
        (penalties, logit bias, min_tokens: `logits_processing`). The worker owns these device-side
        reasons; `Policy.follow_decodes` and `follow_prefill` the scheduling ones."""
        producers = [s for s in plan.steps if s.samples]
        return not producers or (self.proposer is None and not _any_processes_logits(plan, producers))

    def _step_times(self, clock: _StepClock) -> tuple[float, float]:
        """(forward, draft) seconds of this step and of earlier ones that ended before their GPU work
        did: a step with nothing to read back (a prefill chunk that samples nothing) does not wait for
        the device, so its events are read by a later step, once done (the stream runs in order)."""
        self._unread_clocks.append(clock)
        forward = draft = 0.0
        while self._unread_clocks and self._unread_clocks[0].done():
            step_forward, *step_draft = self._unread_clocks.pop(0).intervals()  # no draft mark without a proposer
            forward, draft = forward + step_forward, draft + sum(step_draft)
        return forward, draft

    # 1-2. layout and upload

    def _host_arrays(self, plan: StepPlan, layout: _Layout) -> dict[str, np.ndarray]:
        steps = plan.steps
        tables = [s.block_table for s in steps]
        # past a sequence's own blocks: the trash block, a valid id no real sequence owns (graphs read it)
        block_tables = np.full((len(steps), max(map(len, tables))), self.runner.kv_cache.trash_block, np.int32)
        for index, table in enumerate(tables):
            block_tables[index, : len(table)] = table
        arrays = _one_token_arrays(steps) if layout.verifies_every_row else _ragged_arrays(steps)
        arrays["block_tables"] = block_tables
        if not layout.verifies_every_row:
            arrays["verify_rows"] = layout.verify_rows(plan)  # [P, K + 1]
        if self._plain_greedy(plan, layout):
            return arrays  # the accept rule needs no more
        producers = [steps[i] for i in layout.producers]
        drafts = np.zeros((len(producers), layout.max_draft), np.int64)  # [P, K]
        for p, step in enumerate(producers):
            drafts[p, : step.num_draft] = step.drafts
        arrays["drafts"] = drafts
        arrays["num_draft"] = np.asarray([s.num_draft for s in producers], np.int64)  # [P]
        arrays["anchor_base"] = np.asarray([s.start + s.num_committed - 1 for s in producers], np.int64)  # [P]
        arrays["is_greedy"] = np.asarray([not s.seq.samples_randomly for s in producers], np.int64)
        arrays["producers"] = np.asarray(layout.producers, np.int64)  # [P], rows of the batch's tables
        return arrays

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
            host_query_lens=tuple(len(s.query) for s in plan.steps),
            host_seq_lens=tuple(s.start + len(s.query) for s in plan.steps),
        )

    # 4. verify

    def _verify(self, plan: StepPlan, layout: _Layout, out, arrays: dict[str, torch.Tensor]) -> _Verified | None:
        if not layout.producers:
            return None
        producers = [plan.steps[i] for i in layout.producers]
        width = layout.max_draft + 1
        if layout.verifies_every_row:  # a decode step: its rows are the producers', in order
            logits = out.logits if out.logits is not None else self.runner.compute_logits(out.hidden_states)  # [P, V]
        else:
            rows = arrays["verify_rows"].reshape(-1)
            # a graph step computed every row's logits already
            logits = out.logits[rows] if out.logits is not None else self.runner.compute_logits(out.hidden_states[rows])
        logits = logits.view(len(producers), width, -1)  # [P, K + 1, V]
        # what argmax and sampling see (no pass over the producers where the plan says none processes them)
        chosen = logits if plan.processes_logits is False else self._processed_logits(producers, logits)
        reported = chosen if self._processed else logits  # raw logprobs: before the processors too
        if "drafts" not in arrays:  # plain greedy decoding: the argmax is the token, no draft to accept
            next_token = chosen[:, 0].argmax(dim=-1)
            return _Verified(reported, None, next_token, next_token[:, None])
        block = VerifyBlock(
            target_argmax=chosen.argmax(dim=-1),
            drafts=arrays["drafts"],
            num_draft=arrays["num_draft"],
            is_greedy=arrays["is_greedy"].bool(),
            **self._sampling_inputs(producers, chosen, arrays["drafts"]),
        )
        num_accepted, next_token = self._accept(block)  # [P], [P]
        slots = torch.arange(width, device=logits.device)  # [K + 1]
        padded = torch.cat([block.drafts, next_token[:, None]], dim=1)  # [P, K + 1]
        tokens = torch.where(slots[None, :] < num_accepted[:, None], padded, next_token[:, None])  # [P, K + 1]
        return _Verified(reported, num_accepted, next_token, tokens)

    def _greedy_rows(self, plan: StepPlan, layout: _Layout, wanted: _LogprobQueries, arrays, out) -> tuple[_Verified, GreedyRows] | None:
        """A plain greedy decode graph step whose every producer wants output logprobs (the commonest
        step with them): its tokens and rows from `LogprobGraphs.greedy`, one graph over the decode
        graph's logits, which also takes the argmax (padded rows: `_Verified`). None: `_verify` and
        `_logprobs` take the step."""
        if not self.greedy_logprob_graphs or self.logprob_graphs is None or out.static_logits is None:
            return None
        if not layout.verifies_every_row or "drafts" in arrays:
            return None
        inputs = _section(arrays, OUTPUT_LP)
        if wanted.num_output_steps != len(layout.producers) or "rows" in inputs or "targets" in inputs:
            return None
        if _any_processes_logits(plan, (plan.steps[i] for i in layout.producers)):
            return None  # processed logits: the argmax is of others
        found = self.logprob_graphs.greedy([job.query for job in wanted.output], inputs, out.static_logits, self._processed)
        if found is None:
            return None
        tokens = found.tokens  # [R], R >= P
        num_producers = len(layout.producers)
        return _Verified(out.logits.view(num_producers, 1, -1), None, tokens[:num_producers], tokens[:, None]), found

    def _accept(self, block: VerifyBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept rule (`spec.accept`); a benchmark's subclass may replace it."""
        return accept(block)

    def _plain_greedy(self, plan: StepPlan, layout: _Layout) -> bool:
        """No drafts, no proposer, every producer greedy: the step's token is the argmax, nothing more
        (no pass over the producers where the plan says no running sequence samples)."""
        if layout.max_draft > 0 or self.proposer is not None:
            return False
        return plan.samples_randomly is False or not any(plan.steps[i].seq.samples_randomly for i in layout.producers)

    def _processed_logits(self, producers: list[SeqStep], logits: torch.Tensor) -> torch.Tensor:
        """logit_bias, min_tokens and the penalties (logits_processing.py), per verify row: row j of a
        producer's block has seen its committed outputs and drafts 1..j (rows past its drafts: all of
        them), as `verify_row_contexts` says. [P, K + 1, V]"""
        if not any(s.seq.processes_logits for s in producers):
            return logits
        num_producers, width, vocab = logits.shape
        params = [s.seq.request.sampling for s in producers for _ in range(width)]
        num_outputs = [s.output_position + min(j, s.num_draft) for s in producers for j in range(width)]
        blocks = [PenalizedBlock(s.seq.rid, s.seq.request.sampling, s.seq.request.prompt_ids, s.seq.tokens, s.output_position,
                                 s.drafts) if has_penalties(s.seq.request.sampling) else None for s in producers]  # fmt: skip
        counts, seen = self._penalties.rows(blocks, width, vocab, logits.device)
        eos = [frozenset(self.runner.config.eos_token_ids)] * len(params)
        rows = ProcessorRows(params, num_outputs, eos, counts, seen)
        return apply_processors(logits.reshape(-1, vocab), rows).view(num_producers, width, vocab)

    def _sampling_inputs(
        self, producers: list[SeqStep], logits: torch.Tensor, drafts: torch.Tensor
    ) -> dict[str, torch.Tensor | None]:
        if not any(s.seq.samples_randomly for s in producers):
            return {}
        params = [s.seq.request.sampling for s in producers]
        num_rows, width, vocab = logits.shape
        row_params = [p for p in params for _ in range(width)]
        probs = sampling_probs(logits.reshape(-1, vocab), row_params).view(num_rows, width, vocab)
        seeds = [s.seq.sampling_seed if s.seq.samples_randomly else None for s in producers]
        noise, uniforms = draw_noise(seeds, [s.output_position for s in producers], width - 1, vocab, logits.device)
        draft_probs = self._stacked_draft_probs(producers, drafts, vocab)
        return {"target_probs": probs, "draft_probs": draft_probs, "uniforms": uniforms, "noise": noise}

    def _stacked_draft_probs(self, producers: list[SeqStep], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """q [P, K, V] of the blocks being verified; None when every block came without q (point masses)."""
        num_slots = drafts.shape[1]
        stored = [self._draft_probs.get(s.seq.rid) if s.num_draft > 0 else None for s in producers]
        if num_slots == 0 or all(q is None for q in stored):
            return None
        point_masses = torch.nn.functional.one_hot(drafts, vocab).float()  # [P, K, V]
        rows = [point_masses[p] if q is None else _fit_rows(q, num_slots) for p, q in enumerate(stored)]
        return torch.stack(rows)

    # 5. logprobs

    def _logprob_queries(self, plan: StepPlan, layout: _Layout) -> _LogprobQueries:
        """Known before the forward (so their indices ride in the step's one upload): every prompt
        row asked for, and the verify rows of each producer that wants logprobs: its anchor's and its
        drafts' (its tokens come from those; the rows padding it to K + 1 would be computed for nothing).
        Prompt rows are a query per sequence; output rows are one query for the whole step when its
        producers that want them all want the same (`Sequence.output_logprob_key`, and in processed
        mode the same filters: the commonest decode step), else one per producer."""
        # only steps with prompt rows left (none in a decode step)
        prompt = [_Owned.one(i, self._prompt_query(s, layout.row_start[i])) for i, s in enumerate(plan.steps) if s.prompt_lo <= s.prompt_hi]
        width = layout.max_draft + 1
        num_verify_rows = len(layout.producers) * width
        wanting = self._wanting_output_rows(plan, layout)
        if wanting is None:
            return _LogprobQueries(prompt, [], num_verify_rows)
        positions, owners, keys = wanting
        rows = [np.arange(p * width, p * width + plan.steps[i].num_draft + 1, dtype=np.int64) for p, i in zip(positions, owners)] if width > 1 else None
        if keys.count(keys[0]) == len(keys):  # one query for the step's output rows
            query_rows = _row_indices(positions) if rows is None else np.concatenate(rows)
            counts = None if rows is None else [len(r) for r in rows]
            output = [_Owned(owners, counts, self._query(plan.steps[owners[0]], query_rows, None))]
        else:
            output = [_Owned.one(i, self._query(plan.steps[i], np.asarray([p], np.int64) if rows is None else rows[j], None))
                      for j, (p, i) in enumerate(zip(positions, owners))]  # fmt: skip
        return _LogprobQueries(prompt, output, num_verify_rows)

    def _wanting_output_rows(self, plan: StepPlan, layout: _Layout) -> tuple[list[int] | range, list[int], list] | None:
        """The producers that want output logprob rows: their positions among the producers, their
        step indices, and their keys (a single key: they all share it); None where none does. From
        the plan's `output_logprob_keys` where every sequence shares one (in processed mode, only
        where that one is None), else asked of each producer."""
        shared = plan.output_logprob_keys
        if shared is not None and len(shared) == 1 and (shared[0] is None or not self._processed):
            return None if shared[0] is None or not layout.producers else (range(len(layout.producers)), layout.producers, list(shared))
        seqs = [plan.steps[i].seq for i in layout.producers]
        positions = [p for p, seq in enumerate(seqs) if seq.wants_logprobs]
        if not positions:
            return None
        keys = [_output_key(seqs[p]) for p in positions] if self._processed else [seqs[p].output_logprob_key for p in positions]
        return positions, [layout.producers[p] for p in positions], keys

    def _logprobs(self, wanted: _LogprobQueries, arrays, hidden: torch.Tensor, verified: _Verified | None,
                  output_lp: RowLogprobs[torch.Tensor] | None = None):  # fmt: skip
        """output_lp: the output rows already computed (`_greedy_rows`); None: computed here."""
        prompt = [job.query for job in wanted.prompt]
        prompt_lp = logprobs_on_device(prompt, _section(arrays, PROMPT_LP), hidden, self.runner.head_logits,
                                       self._top_k_keys, self._processed, fused=self._fused_logprobs)  # fmt: skip
        if wanted.output and verified is not None and output_lp is None:
            logits = verified.logits.view(-1, verified.logits.shape[-1])  # [P * (K + 1), V]
            sampled = verified.tokens.reshape(-1)  # [P * (K + 1)]: each logits row's token, sampled this step
            queries, inputs = [job.query for job in wanted.output], _section(arrays, OUTPUT_LP)
            if self.logprob_graphs is not None:
                output_lp = self.logprob_graphs.compute(queries, inputs, logits, self._processed, sampled)
            else:
                output_lp = logprobs_on_device(queries, inputs, logits, None, self._top_k_keys, self._processed, sampled,
                                               self._fused_logprobs)  # fmt: skip
        return _LogprobJobs(wanted.prompt, prompt_lp, wanted.output, output_lp)

    def _prompt_query(self, step: SeqStep, row_start: int) -> LogprobQuery:
        """The rows of prompt positions [prompt_lo, prompt_hi] (a step with some: lo <= hi)."""
        seq, lo, hi = step.seq, step.prompt_lo, step.prompt_hi
        first = lo + 1 if lo == seq.prompt_logprob_start else lo  # the first returned position is null
        positions = np.arange(first, hi + 1, dtype=np.int64)  # [p]
        rows = row_start + positions - 1 - step.start
        return self._query(step, rows, np.asarray(seq.tokens[first : hi + 1], np.int64))

    def _query(self, step: SeqStep, rows: np.ndarray, targets: np.ndarray | None) -> LogprobQuery:
        params = step.seq.request.logprobs
        sampling = step.seq.request.sampling
        return LogprobQuery(rows, targets, params.top_logprobs_num, params.token_ids_logprob, sampling)

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
            rids=tuple(s.seq.rid for s in producers),
            anchor_tokens=verified.next_token,
            anchor_positions=arrays["anchor_base"] + verified.num_accepted + 1,
            block_tables=arrays["block_tables"][arrays["producers"]],
            max_anchor_position=max(s.start + len(s.query) for s in producers),
            temperatures=tuple(s.seq.request.sampling.temperature for s in producers),
            seeds=tuple(mix_seed(s.seq.sampling_seed ^ DRAFT_SALT, s.output_position) for s in producers),
        )
        return self.proposer.propose(request)

    def _keep_draft_probs(self, plan: StepPlan, layout: _Layout, proposal) -> None:
        if proposal is None or proposal.probs is None:
            return
        for p, i in enumerate(layout.producers):
            if plan.steps[i].seq.samples_randomly:
                self._draft_probs[plan.steps[i].seq.rid] = proposal.probs[p]


@dataclass(frozen=True)
class _Verified:
    logits: torch.Tensor  # f32 [P, K + 1, V], what output logprobs read: raw, or after logits_processing when processed
    num_accepted: torch.Tensor | None  # int64 [P]; None: no drafts were verified (plain greedy decoding), none accepted
    next_token: torch.Tensor  # int64 [P]
    tokens: torch.Tensor  # int64 [P, K + 1]: accepted drafts, then next_token (then padding); from
    # `_greedy_rows` [R, 1] with R >= P (rows past P: a decode graph's padded rows, never read)


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose device work and readback are queued (`ModelWorker.launch`)."""

    plan: StepPlan
    layout: _Layout
    handles: _Handles
    readback: PendingReadback
    clock: _StepClock
    next_token: torch.Tensor | None  # int64 [P] on the device: each producer's token, in layout.producers order

    def followed(self, following: StepPlan, layout: _Layout) -> _Followed:
        """Where `following`'s followed decodes (query `FOLLOWED_TOKEN`: each one of this step's
        producers) take their tokens from this step's next_token, on the device."""
        steps = [i for i, s in enumerate(following.steps) if s.query[0] == FOLLOWED_TOKEN]
        producers = self.layout.producers
        if len(steps) == len(producers) and all(following.steps[i].seq is self.plan.steps[j].seq for i, j in zip(steps, producers)):
            producer_rows = None  # every producer's token, in order (the commonest step: no map to build)
        else:
            rows = {id(self.plan.steps[i].seq): p for p, i in enumerate(producers)}
            producer_rows = np.fromiter((rows[id(following.steps[i].seq)] for i in steps), np.int64, len(steps))
            producer_rows = None if are_all_rows(producer_rows, len(rows)) else producer_rows
        # a plain followed decode step: its queries are these tokens, nothing to place
        positions = None if len(steps) == len(following.steps) else np.asarray([layout.row_start[i] for i in steps], np.int64)
        return _Followed(producer_rows, positions)


@dataclass(frozen=True)
class _Followed:
    """A followed step's queries from the step before it (`LaunchedStep.followed`): rows of its
    next_token [P] (None: all of them, in order) and, in a step that also admits prompt chunks, the
    query rows they fill (None: every query is one of them, in order)."""

    producer_rows: np.ndarray | None  # int64 [F]
    positions: np.ndarray | None  # int64 [F]

    def host_arrays(self) -> dict[str, np.ndarray]:
        arrays = {"followed_rows": self.producer_rows, "followed_positions": self.positions}
        return {name: value for name, value in arrays.items() if value is not None}

    def input_ids(self, next_token: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """[T]: the step's query tokens, the followed ones taken from next_token on the device."""
        tokens = next_token if self.producer_rows is None else next_token[arrays["followed_rows"]]
        if self.positions is None:
            return tokens
        return arrays["input_ids"].index_copy(0, arrays["followed_positions"], tokens)  # prompt chunks' tokens kept


PROMPT_LP, OUTPUT_LP = "prompt_logprobs.", "output_logprobs."  # their inputs' names in the upload


class _Owned(msgspec.Struct, frozen=True):
    """A query and the steps whose rows it holds, in order: step `steps[j]` owns its next
    `counts[j]` rows (None: one row each, or a single step owning them all). (A `msgspec.Struct`:
    one per step, or one per producer a step where producers ask different widths.)"""

    steps: list[int]  # indices into plan.steps
    counts: list[int] | None
    query: LogprobQuery

    @classmethod
    def one(cls, step: int, query: LogprobQuery) -> _Owned:
        return cls([step], None, query)

    def split(self, rows: HostRows) -> dict[int, HostRows]:
        """The query's host rows (`split_logprobs`) -> each step's (by step index): spans of the same columns."""
        if len(self.steps) == 1 or rows.num_rows == 0:  # no rows: nothing computed (`split_logprobs`' empty rows)
            return dict.fromkeys(self.steps, rows)
        source, start = (rows.source, rows.start) if rows.__class__ is RowSpan else (rows, 0)
        if self.counts is None:
            return dict(zip(self.steps, [RowSpan(source, first, 1) for first in range(start, start + len(self.steps))], strict=True))
        firsts = itertools.accumulate(self.counts, initial=start)
        return dict(zip(self.steps, [RowSpan(source, first, count) for first, count in zip(firsts, self.counts)], strict=True))


@dataclass(frozen=True)
class _LogprobQueries:
    prompt: list[_Owned]  # a query per step with prompt rows
    output: list[_Owned]  # rows of the verified logits, targets sampled
    num_verify_rows: int  # P * (K + 1): the rows of the verified logits that output queries index

    @property
    def num_output_steps(self) -> int:
        return sum(len(job.steps) for job in self.output)

    def inputs(self, processed: bool) -> dict[str, np.ndarray]:
        prompt = logprob_inputs([job.query for job in self.prompt], processed)
        output = logprob_inputs([job.query for job in self.output], processed, self.num_verify_rows)
        return {PROMPT_LP + k: v for k, v in prompt.items()} | {OUTPUT_LP + k: v for k, v in output.items()}


def _section(arrays: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in arrays.items() if name.startswith(prefix)}


@dataclass(frozen=True)
class _LogprobJobs:
    prompt: list[_Owned]
    prompt_rows: RowLogprobs[torch.Tensor] | None
    output: list[_Owned]
    output_rows: RowLogprobs[torch.Tensor] | None


class _Handles:
    """Which readback slots hold what, and turning the host copy into `SeqResult`s."""

    def __init__(self, readback: HostReadback) -> None:
        self._readback = readback
        self.verified: tuple[int | None, int] | None = None  # (num_accepted's handle, tokens')
        self.jobs: _LogprobJobs | None = None
        self.prompt: list[int] | None = None
        self.output: list[int] | None = None
        self.drafts: int | None = None
        self.confidence: int | None = None

    def verify(self, verified: _Verified | None) -> None:
        if verified is not None:
            accepted = None if verified.num_accepted is None else self._readback.add(verified.num_accepted)
            self.verified = (accepted, self._readback.add(verified.tokens))

    def greedy(self, found: GreedyRows) -> None:
        """`_greedy_rows`' step: its tokens and output rows, views of one buffer, read back as that
        one part (instead of `verify` and `logprobs` adding each view)."""
        tokens, *self.output = self._readback.add_packed(found.packed, found.views)
        self.verified = (None, tokens)

    def logprobs(self, jobs: _LogprobJobs) -> None:
        self.jobs = jobs
        if jobs.prompt_rows is not None:
            self.prompt = [self._readback.add(t) for t in jobs.prompt_rows.columns()]
        if jobs.output_rows is not None and self.output is None:  # `greedy`'s were added already
            self.output = [self._readback.add(t) for t in jobs.output_rows.columns()]

    def proposal(self, proposal) -> None:
        if proposal is None:
            return
        self.drafts = self._readback.add(proposal.tokens)
        if proposal.confidence is not None:
            self.confidence = self._readback.add(proposal.confidence.float())

    def results(self, plan: StepPlan, layout: _Layout, host: list[np.ndarray]) -> list[SeqResult]:
        tokens: dict[int, list[int]] = {}
        if self.verified is not None:
            accepted, block = self.verified[0], host[self.verified[1]].tolist()
            num_accepted = [0] * len(block) if accepted is None else host[accepted].tolist()
            tokens = {i: block[p][: num_accepted[p] + 1] for p, i in enumerate(layout.producers)}
        prompt_rows = self._rows(self.jobs.prompt, self.prompt, host)
        output_rows = self._rows(self.jobs.output, self.output, host)
        drafts = self._per_producer(layout, host, self.drafts)
        confidence = self._per_producer(layout, host, self.confidence)
        return [
            SeqResult(tokens.get(i, []), output_rows.get(i), prompt_rows.get(i), drafts.get(i, []), confidence.get(i))
            for i in range(len(plan.steps))
        ]

    def _rows(self, jobs: list[_Owned], handles, host) -> dict[int, HostRows]:
        if not jobs:
            return {}
        rows = split_logprobs([job.query for job in jobs], None if handles is None else [host[h] for h in handles])
        if len(jobs) == 1:
            return jobs[0].split(rows[0])
        return {i: r for job, query_rows in zip(jobs, rows, strict=True) for i, r in job.split(query_rows).items()}

    def _per_producer(self, layout: _Layout, host: list[np.ndarray], handle: int | None) -> dict[int, list]:
        if handle is None:
            return {}
        rows = host[handle].tolist()
        return {i: rows[p] for p, i in enumerate(layout.producers)}


class _StepClock:
    """Marks inside a step: CUDA events (read once done, so never an extra sync), or the host clock
    on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks = [self._now()]

    def mark(self) -> None:
        self._marks.append(self._now())

    def done(self) -> bool:
        return not self._cuda or self._marks[-1].query()

    def intervals(self) -> list[float]:
        if self._cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def _any_processes_logits(plan: StepPlan, steps: Iterable[SeqStep]) -> bool:
    """Whether a processor changes the logits of one of `steps` (of `plan`): no pass over them
    where the plan says none of its sequences' are (`StepPlan.processes_logits`)."""
    return plan.processes_logits is not False and any(s.seq.processes_logits for s in steps)


def _row_indices(positions: list[int] | range) -> np.ndarray:
    """int64 [n]: the producers' rows of a step without drafts (one each)."""
    return np.arange(len(positions), dtype=np.int64) if positions.__class__ is range else np.asarray(positions, np.int64)


def _output_key(seq: Sequence) -> tuple:
    """In processed mode, what the work on a request's output rows reads of it: its widths
    (`Sequence.output_logprob_key`, all it reads in raw mode) and its filters."""
    sampling = seq.request.sampling
    return seq.output_logprob_key, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p


def _lay_out(plan: StepPlan) -> _Layout:
    row_start, row = [], 0
    for step in plan.steps:
        row_start.append(row)
        row += len(step.query)
    producers = [i for i, step in enumerate(plan.steps) if step.samples]
    max_draft = max((plan.steps[i].num_draft for i in producers), default=0)
    every_row = max_draft == 0 and len(producers) == len(plan.steps) == row
    return _Layout(row_start, producers, max_draft, every_row)


def _ragged_arrays(steps: list[SeqStep]) -> dict[str, np.ndarray]:
    """A step's query tokens, positions, slots, query starts and sequence lengths, for queries of any
    length: one numpy call per array, none per sequence (it would cost more than the work at 64
    decodes); a position is its row plus its sequence's offset (a 16k-token chunk: 1.0 -> 0.01 ms)."""
    lengths = np.asarray([len(s.query) for s in steps], np.int64)  # [B]
    query_start = np.zeros(len(steps) + 1, np.int32)  # [B + 1]
    query_start[1:] = np.cumsum(lengths)
    num_tokens = int(query_start[-1])
    offsets = np.asarray([s.start for s in steps], np.int64) - query_start[:-1]  # [B]
    return {
        "input_ids": np.fromiter(itertools.chain.from_iterable(s.query for s in steps), np.int64, num_tokens),  # [T]
        "positions": np.arange(num_tokens, dtype=np.int64) + np.repeat(offsets, lengths),  # [T]
        "slots": _flat_slots(steps),  # [T]
        "query_start_loc": query_start,
        "seq_lens": np.asarray([s.start + len(s.query) for s in steps], np.int32),  # [B]
    }


def _one_token_arrays(steps: list[SeqStep]) -> dict[str, np.ndarray]:
    """`_ragged_arrays` where every query is one token (a decode step, T = B): a position is its
    sequence's start, a query starts at its row, each read in one pass (66 -> 41 us for
    `_host_arrays` at batch 64 on the CPU, `host_step_cost.md`)."""
    num_steps = len(steps)
    positions = np.fromiter([s.start for s in steps], np.int64, num_steps)  # [B]
    return {
        "input_ids": np.fromiter([s.query[0] for s in steps], np.int64, num_steps),  # [B]
        "positions": positions,
        "slots": np.fromiter([s.slots[0] for s in steps], np.int64, num_steps),  # [B]
        "query_start_loc": np.arange(num_steps + 1, dtype=np.int32),
        "seq_lens": (positions + 1).astype(np.int32),  # [B]
    }


def _flat_slots(steps: list[SeqStep]) -> np.ndarray:
    if all(isinstance(s.slots, list) for s in steps):
        return np.asarray([slot for s in steps for slot in s.slots], np.int64)
    return np.concatenate([np.asarray(s.slots, np.int64) for s in steps])


def _fit_rows(q: torch.Tensor, num_slots: int) -> torch.Tensor:
    """q [gamma, V] -> [num_slots, V]: cut, or padded with copies of its last row (never read)."""
    if q.shape[0] >= num_slots:
        return q[:num_slots]
    return torch.cat([q, q[-1:].expand(num_slots - q.shape[0], -1)])

