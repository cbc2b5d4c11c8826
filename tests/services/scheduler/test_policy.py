"""The scheduling policy with a fake worker: no model, and (see the last test) no torch at all.

The fake "model" continues every sequence with next(t) = (5 t + 3) mod V. Its proposer drafts a
block whose first `accept` tokens are right and the rest wrong, so a verify keeps exactly those
and adds the model's next token, as the accept rule would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import LogprobParams, SamplingParams
from services.scheduler.policy import Policy, PolicyConfig, SeqResult, StepPlan
from services.common.logprob_rows import RowLogprobs
from services.scheduler.request import SchedulerRequest

VOCAB = 97
GAMMA = 4


def model_next(token: int) -> int:
    return (5 * token + 3) % VOCAB


def continuation(token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = model_next(token)
        out.append(token)
    return out


class FakeWorker:
    def __init__(self, accept: int = GAMMA, top_k: int = 2) -> None:
        self.accept, self.top_k = accept, top_k
        self.plans: list[StepPlan] = []
        self.pool: dict[str, int] = {}  # rid -> its last sampled token (the worker's token pool)

    def execute(self, plan: StepPlan) -> list[SeqResult]:
        self.plans.append(plan)
        return [self._result(step) for step in plan.steps]

    def _result(self, step) -> SeqResult:
        prompt = None
        if step.prompt_lo <= step.prompt_hi:
            first = step.prompt_lo + 1 if step.prompt_lo == step.params.prompt_logprob_start else step.prompt_lo
            prompt = _rows(list(range(first, step.prompt_hi + 1)), self.top_k)
        if not step.samples:
            return SeqResult(prompt_logprobs=prompt)
        query = [self.pool[step.rid], *step.tokens] if step.from_pool else step.tokens
        anchor = query[step.num_committed - 1]
        truth = continuation(anchor, step.num_draft + 1)
        accepted = 0
        while accepted < step.num_draft and step.drafts[accepted] == truth[accepted]:
            accepted += 1
        tokens = truth[: accepted + 1]
        self.pool[step.rid] = tokens[-1]
        drafts = _drafts(tokens[-1], self.accept)
        positions = list(range(step.output_position, step.output_position + len(tokens)))
        return SeqResult(tokens, _rows(positions, self.top_k), prompt, drafts)


def _drafts(anchor: int, accept: int) -> list[int]:
    right = continuation(anchor, GAMMA)
    return right[:accept] + [(t + 1) % VOCAB for t in right[accept:]]


def _rows(positions: list[int], k: int) -> RowLogprobs:
    """Rows whose values name their position, so a test can see which rows arrived."""
    n = len(positions)
    values = -np.asarray(positions, np.float32)
    return RowLogprobs(values, np.repeat(values[:, None], k, 1), np.zeros((n, k), np.int32), np.zeros((n, 0), np.float32))


def make_policy(num_blocks: int = 64, chunk: int = 64, drafts: int = GAMMA, max_running: int = 16,
                prefill_budget: int | None = None, max_model_len: int = 256) -> Policy:  # fmt: skip
    return Policy(PolicyConfig(
        num_blocks=num_blocks, block_size=4, max_running_requests=max_running, chunk_budget=chunk,
        max_model_len=max_model_len, vocab_size=VOCAB, eos_ids=frozenset({0}), num_draft_tokens=drafts, prefill_budget=prefill_budget,
    ))  # fmt: skip


def req(rid: str, prompt: list[int], max_new: int = 12, logprobs: LogprobParams | None = None, **sampling):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **sampling)
    return SchedulerRequest(rid, np.asarray(prompt, np.int32), "detok", params, logprobs or LogprobParams())


def drive(policy: Policy, worker: FakeWorker, requests, aborts: dict[int, list[str]] | None = None, max_steps=500):
    """Step until idle; returns rid -> (tokens, finish, output logprob values, prompt logprob values)."""
    out: dict[str, dict] = {}
    for r in requests:
        policy.add(r)
    for step in range(max_steps):
        for rid in (aborts or {}).get(step, []):
            policy.abort(rid, "client gone")
        if not policy.has_work():
            return out
        plan = policy.schedule()
        outputs = policy.update(plan, worker.execute(plan)) if plan.steps else policy.take_outputs()
        for o in outputs:
            entry = out.setdefault(o.rid, {"tokens": [], "finish": None, "output_lp": [], "prompt_lp": []})
            entry["tokens"] += o.new_token_ids
            entry["finish"] = o.finish
            if o.logprobs is not None and o.logprobs.output is not None:
                entry["output_lp"] += o.logprobs.output.token.tolist()
            if o.logprobs is not None and o.logprobs.prompt is not None:
                entry["prompt_lp"] += o.logprobs.prompt.token.tolist()
    raise AssertionError("policy did not finish")


def test_ragged_acceptance_gives_the_model_continuation():
    worker = FakeWorker(accept=2)
    result = drive(make_policy(), worker, [req("a", [11, 12, 13], max_new=12)])["a"]
    assert result["tokens"] == continuation(13, 12) and result["finish"] == Finish(FinishType.LENGTH)
    verify_sizes = [p.steps[0].num_query for p in worker.plans[1:]]
    # each verify: the anchor + a full block (the last one too: uniform queries replay graphs)
    assert verify_sizes == [1 + GAMMA] * 4
    assert len(worker.plans) == 1 + -(-11 // 3)  # prefill, then 3 tokens per verify (2 accepted + 1)


def test_stop_token_mid_block_drops_the_tokens_after_it_and_their_logprob_rows():
    truth = continuation(13, 12)
    stop = truth[5]  # inside the second verify block of a fully accepted run (outputs 1-5, 6-10)
    logprobs = LogprobParams(return_logprob=True, top_logprobs_num=2)
    result = drive(make_policy(), FakeWorker(accept=GAMMA), [req("a", [11, 12, 13], stop_token_ids=(stop,), logprobs=logprobs)])["a"]
    assert result["tokens"] == truth[: truth.index(stop) + 1]
    assert result["finish"] == Finish(FinishType.STOP, matched=stop)
    assert result["output_lp"] == [-float(i) for i in range(len(result["tokens"]))]  # one row per kept token


def test_max_new_tokens_cuts_the_accepted_block_and_max_model_len_limits_the_drafts():
    worker = FakeWorker(accept=GAMMA)
    logprobs = LogprobParams(return_logprob=True, top_logprobs_num=2)
    result = drive(make_policy(), worker, [req("a", [5], max_new=7, logprobs=logprobs)])["a"]
    assert result["tokens"] == continuation(5, 7) and result["finish"] == Finish(FinishType.LENGTH)
    assert len(result["output_lp"]) == 7  # rows of the tokens past max_new_tokens are dropped too
    assert [p.steps[0].num_draft for p in worker.plans] == [0, GAMMA, GAMMA]  # 1 + 5 + 1 (of 5) outputs
    near_the_end = make_policy(max_model_len=10)
    worker = FakeWorker(accept=GAMMA)
    drive(near_the_end, worker, [req("b", [5, 6, 7], max_new=100)])
    assert [p.steps[0].num_draft for p in worker.plans] == [0, GAMMA, 1]  # KV room: positions 3..9


def test_chunked_prefill_splits_by_budget_and_drafts_ride_the_last_chunk():
    worker = FakeWorker()
    logprobs = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    prompt = list(range(1, 21))
    result = drive(make_policy(chunk=7), worker, [req("a", prompt, max_new=3, logprobs=logprobs)])["a"]
    assert [p.steps[0].num_query for p in worker.plans[:3]] == [7, 7, 6]
    assert [p.steps[0].samples for p in worker.plans[:3]] == [False, False, True]
    assert result["prompt_lp"][0] != result["prompt_lp"][0]  # NaN: the null first position
    assert result["prompt_lp"][1:] == [-float(p) for p in range(1, 20)]  # every position once, in order
    assert result["tokens"] == continuation(20, 3)


def test_the_prefill_budget_holds_only_while_nothing_decodes():
    """A prompt alone prefills in prefill_budget steps; once a sequence decodes, a newcomer's chunks
    and the decodes share chunk_budget again. Tokens are those of the chunk-budget-only policy."""
    worker = FakeWorker()
    policy = make_policy(chunk=7, drafts=0, prefill_budget=16)
    policy.add(req("a", list(range(1, 31)), max_new=8))
    for _ in range(3):  # 16 + 14: the second step holds the prompt's last token too
        policy.update(plan := policy.schedule(), worker.execute(plan))
    policy.add(req("b", list(range(40, 60)), max_new=3))
    result = drive(policy, worker, [])
    sizes = [[step.num_query for step in plan.steps] for plan in worker.plans]
    assert sizes[:3] == [[16], [14], [5]]  # a alone: 16 then 14 prompt tokens, then a verify (its token + 4 drafts)
    assert sizes[3] == [5, 2]  # a decodes: b's first chunk takes what is left of 7
    assert sizes[4] == [16] and sizes[4:] == [[16], [2], [5]]  # a has finished: b alone takes 16 again
    plain = drive(make_policy(chunk=7, drafts=0), FakeWorker(), [req("a", list(range(1, 31)), max_new=8)])
    assert plain["a"]["tokens"] == continuation(30, 8)
    assert result["b"]["tokens"] == continuation(59, 3)


def test_preemption_frees_blocks_and_every_request_still_completes():
    policy = make_policy(num_blocks=8, chunk=32)
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(6)}
    results = drive(policy, FakeWorker(accept=1), [req(rid, p, max_new=10) for rid, p in prompts.items()])
    assert policy.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert results[rid]["tokens"] == continuation(prompt[-1], 10), rid
    assert policy.blocks.num_free_blocks == 8


def test_aborts_mid_prefill_and_mid_decode_free_their_blocks():
    policy = make_policy(chunk=4)
    requests = [req("long", list(range(1, 30)), max_new=5), req("short", [3, 4], max_new=20), req("keep", [7], max_new=6)]
    results = drive(policy, FakeWorker(), requests, aborts={1: ["long"], 3: ["short"]})
    assert results["long"]["tokens"] == [] and results["long"]["finish"].message == "client gone"
    assert results["short"]["finish"].type == FinishType.ABORT and 0 < len(results["short"]["tokens"]) < 20
    assert results["keep"]["tokens"] == continuation(7, 6)
    assert policy.blocks.num_free_blocks == 64 and not policy.has_work()


def test_policy_runs_without_torch():
    """Every test above, again, in a process where importing torch fails."""
    names = [name for name in globals() if name.startswith("test_") and name != "test_policy_runs_without_torch"]
    here = Path(__file__).resolve()
    root = here.parents[3]
    script = (
        "import sys; sys.modules['torch'] = None\n"
        f"sys.path[:0] = [{str(root)!r}, {str(here.parent)!r}]\n"
        "import test_policy as t\n"
        f"for name in {names!r}: getattr(t, name)()\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok', len(" + repr(names) + "))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"ok {len(names)}"


def test_the_running_set_takes_sequences_only_through_add_and_remove_which_count_them():
    policy = make_policy()
    params = SamplingParams(max_new_tokens=4, temperature=0.7, ignore_eos=True)
    policy.add(SchedulerRequest("counted", np.asarray([1, 2, 3], np.int32), "detok", params, LogprobParams()))
    policy.schedule()
    running = policy._running
    (seq,) = running
    assert running.plan([]).samples_randomly
    for uncounted in (lambda: running.__setitem__(seq, None), lambda: running.__delitem__(seq), lambda: running.pop(seq),
                      running.popitem, lambda: running.setdefault(seq), lambda: running.update({seq: None})):  # fmt: skip
        with pytest.raises(TypeError, match="add\\(\\) and remove\\(\\)"):
            uncounted()
    assert list(running) == [seq] and running.plan([]).samples_randomly
    running.remove(seq)
    assert not running and not running.plan([]).samples_randomly
