"""The logit processors inside the scheduler core (tiny model, CPU): greedy choices equal the
argmax of the processed raw distribution, computed here from the returned raw logprobs."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import torch

from contracts.detokenizer import FinishType
from contracts.scheduler import LogprobParams
from services.scheduler.model import ForwardBatch
from tests.services.scheduler.test_scheduler_core import prompt_of, request, run
from tests.services.scheduler.test_speculative_loop import GAMMA, OracleProposer, RandomProposer

VOCAB = 2048
FULL = LogprobParams(return_logprob=True, top_logprobs_num=VOCAB)


def full_rows(result) -> np.ndarray:
    """Raw logprobs of every output position over the whole vocabulary: f32 [n, V]."""
    values, ids = result.cat("output_top_values"), result.cat("output_top_ids")  # [n, V] each
    rows = np.empty_like(values)
    np.put_along_axis(rows, ids.astype(np.int64), values, axis=1)
    return rows


def test_frequency_and_presence_penalties_pick_the_argmax_of_the_penalized_distribution(make_core):
    prompt = prompt_of(11, 12)
    params = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "ignore_eos": True}
    penalized = run(make_core(), [request("p", prompt, max_new_tokens=16, logprobs=FULL, **params)])["p"]
    plain = run(make_core(), [request("q", prompt, max_new_tokens=16, ignore_eos=True)])["q"]
    rows = full_rows(penalized)
    for position, token in enumerate(penalized.tokens):
        counts = np.bincount(penalized.tokens[:position], minlength=VOCAB)
        expected = rows[position] - 1.5 * counts - 0.5 * (counts > 0)  # shifts by a constant: same argmax as logits
        assert token == int(np.argmax(expected)), position
    assert penalized.tokens != plain.tokens  # the penalty mattered on this prompt


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(make_core):
    prompt = prompt_of(3, 8)
    result = run(make_core(), [request("b", prompt, max_new_tokens=6, logprobs=FULL, logit_bias=((7, 100.0),))])["b"]
    plain = run(make_core(), [request("c", prompt, max_new_tokens=6, logprobs=FULL)])["c"]
    assert result.tokens == [7] * 6
    rows = full_rows(result)
    assert not np.allclose(rows[:, 7], 0.0, atol=1e-3)  # raw: the bias is not in the returned logprobs
    assert np.allclose(full_rows(plain)[0], rows[0], atol=1e-5)  # same first position, same raw row


def test_min_tokens_keeps_a_stop_token_back_until_reached(make_core):
    prompt = prompt_of(5, 8)
    first = run(make_core(), [request("a", prompt, max_new_tokens=8, ignore_eos=True)])["a"].tokens[0]
    stopped = run(make_core(), [request("s", prompt, max_new_tokens=8, stop_token_ids=(first,))])["s"]
    held = run(make_core(), [request("m", prompt, max_new_tokens=8, stop_token_ids=(first,), min_new_tokens=3)])["m"]
    assert stopped.tokens == [first] and stopped.finish.type == FinishType.STOP
    assert len(held.tokens) >= 3 and first not in held.tokens[:3]


@torch.inference_mode()
def reference_logits(runner, tokens: list[int]) -> torch.Tensor:
    """Row r: the raw logits after tokens[:r+1], from one plain forward pass. f32 [n, V]"""
    n = len(tokens)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.arange(n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(-(-n // runner.block_size), dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64),
    )  # fmt: skip
    return runner.compute_logits(runner.forward(batch).hidden_states).float()


def test_repetition_penalty_picks_the_argmax_of_the_penalized_logits(make_core, tiny_runner):
    prompt, r = prompt_of(2, 10), 1.8
    sampling = {"repetition_penalty": r, "ignore_eos": True}
    result = run(make_core(), [request("r", prompt, max_new_tokens=12, **sampling)])["r"]
    plain = run(make_core(), [request("s", prompt, max_new_tokens=12, ignore_eos=True)])["s"]
    logits = reference_logits(tiny_runner, prompt + result.tokens)[len(prompt) - 1 :]  # [n + 1, V]
    for position, token in enumerate(result.tokens):
        row = logits[position].clone()
        seen = sorted(set(prompt) | set(result.tokens[:position]))
        row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        assert token == int(row.argmax()), position
    assert result.tokens != plain.tokens


PROCESSED = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3, "ignore_eos": True}


def penalized_requests():
    return [request(f"s{i}", prompt_of(40 + i, 4 + 3 * i), max_new_tokens=10 + i, **PROCESSED) for i in range(4)] + [
        request("bias", prompt_of(60, 6), max_new_tokens=8, logit_bias=((9, 4.0), (11, -100.0)), min_new_tokens=5)
    ]


def test_under_speculation_processed_greedy_equals_plain_processed_greedy(make_core):
    """Row j of a verify block sees drafts 1..j as output: with oracle drafts (the plain processed
    continuation) every draft is accepted, with random drafts the output is still the same."""
    requests = penalized_requests()
    plain = run(make_core(), requests)
    longer = run(make_core(), [dataclasses.replace(r, sampling=msgspec.structs.replace(
        r.sampling, max_new_tokens=r.sampling.max_new_tokens + GAMMA + 1)) for r in requests])  # fmt: skip
    sequences = {r.rid: r.prompt_ids.tolist() + longer[r.rid].tokens for r in requests}
    oracle_core = make_core(proposer=OracleProposer(sequences, VOCAB))
    oracle = run(oracle_core, requests)
    random_drafts = run(make_core(proposer=RandomProposer(VOCAB)), requests)
    for r in requests:
        assert oracle[r.rid].tokens == plain[r.rid].tokens == random_drafts[r.rid].tokens, r.rid
    stats = oracle_core.stats()
    assert stats.num_drafted_tokens > 0 and stats.num_accepted_tokens == stats.num_drafted_tokens


def test_processed_logprobs_include_the_processors_and_raw_ones_do_not(make_core):
    sampling = {"temperature": 1.0, "seed": 3, "logit_bias": ((7, 100.0),), "logprobs": LogprobParams(return_logprob=True)}
    raw = run(make_core(), [request("raw", prompt_of(8, 6), max_new_tokens=4, **sampling)])["raw"]
    processed = run(make_core(logprobs_mode="processed"), [request("p", prompt_of(8, 6), max_new_tokens=4, **sampling)])["p"]
    assert raw.tokens == processed.tokens == [7] * 4
    assert np.all(processed.cat("output_token") > -1e-3)  # p(7) ~ 1 after a +100 bias
    assert np.all(raw.cat("output_token") < -1.0)  # the model's own p(7) is small


def test_the_workers_kept_penalty_counts_give_the_reference_rows_of_every_verify_step(make_core):
    """`ModelWorker._processed_logits` (each request's `PenaltyCounts`, grown step by step, plus its
    drafts per row) equals `process_logits` over `verify_row_contexts` (the lists, rebuilt), bit for
    bit, on every step of requests mixing penalties, min_tokens and logit_bias, with random drafts
    (verify blocks of several rows) and without; the kept counts go once a request finishes."""
    from services.scheduler.logits_processing import process_logits, verify_row_contexts

    mixed = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=0.2), dict(min_new_tokens=4),
             dict(logit_bias=((5, 2.0),), repetition_penalty=0.8), {}]  # fmt: skip
    requests = [request(f"p{i}", prompt_of(40 + i, 6 + 3 * i), max_new_tokens=10, ignore_eos=True, **mixed[i % len(mixed)])
                for i in range(7)]  # fmt: skip
    for proposer in (None, RandomProposer(VOCAB)):
        core = make_core(proposer=proposer)
        worker, checked = core.worker, []
        kept = worker._processed_logits

        def checked_rows(producers, logits, kept=kept, worker=worker, checked=checked, core=core):
            got = kept(producers, logits)
            width, vocab, eos = logits.shape[1], logits.shape[2], frozenset(worker.runner.config.eos_token_ids)
            seqs = {seq.rid: seq for seq in core.policy.held()}  # the policy's token history, the reference's input
            contexts = [c for s in producers for c in verify_row_contexts(
                s.params.sampling, s.params.prompt_ids.tolist(),
                seqs[s.rid].tokens[s.params.num_prompt : s.params.num_prompt + s.output_position], s.drafts, width, eos)]  # fmt: skip
            want = process_logits(logits.reshape(-1, vocab), contexts).view_as(logits)
            assert torch.equal(got, want)
            checked.append(width)
            return got

        worker._processed_logits = checked_rows
        run(core, requests)
        assert len(checked) >= 9 and (proposer is None or max(checked) > 1)
        assert len(worker._penalties) == 0  # released with their requests
