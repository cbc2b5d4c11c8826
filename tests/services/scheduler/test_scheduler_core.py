"""SchedulerCore on the bundled tiny model (CPU, fp32), no NATS."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import LogprobParams, SamplingParams
from services.scheduler.request import SchedulerRequest
from plain_forward import reference_logprobs

TOL = 1e-4


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: Finish | None = None
    num_outputs: int = 0  # outputs carrying this rid
    input_start: int | None = None
    input_token: list[np.ndarray] = field(default_factory=list)
    input_top_values: list[np.ndarray] = field(default_factory=list)
    input_top_ids: list[np.ndarray] = field(default_factory=list)
    input_ids: list[np.ndarray] = field(default_factory=list)
    output_token: list[np.ndarray] = field(default_factory=list)
    output_top_values: list[np.ndarray] = field(default_factory=list)
    output_top_ids: list[np.ndarray] = field(default_factory=list)
    output_ids: list[np.ndarray] = field(default_factory=list)
    flat: tuple | None = None
    num_input_entries: int = 0
    spec_verify_ct: int | None = None
    cached_tokens: int = 0  # prompt tokens found in KV (usage's cached_tokens)

    def absorb(self, output) -> None:
        assert self.finish is None, "nothing may follow a finish"
        self.num_outputs += 1
        self.tokens.extend(output.new_token_ids)
        self.finish = output.finish
        self.spec_verify_ct = output.spec_verify_ct
        self.cached_tokens = output.cached_tokens
        lp = output.logprobs
        if lp is None:
            return
        if lp.prompt is not None:
            expected = lp.prompt.start if self.input_start is None else self.input_start + self.num_input_entries
            assert lp.prompt.start == expected, "prompt entries must be contiguous"
            self.input_start = self.input_start if self.input_start is not None else lp.prompt.start
            self.num_input_entries += lp.prompt.num_rows
        for rows, token, top_values, top_ids, ids in (
            (lp.prompt, self.input_token, self.input_top_values, self.input_top_ids, self.input_ids),
            (lp.output, self.output_token, self.output_top_values, self.output_top_ids, self.output_ids),
        ):
            if rows is None:
                continue
            token.append(rows.token)
            if rows.k:  # a kind asked for (its width 0 where not)
                top_values.append(rows.top_values)
                top_ids.append(rows.top_ids)
            if rows.m:
                ids.append(rows.ids)
        if lp.flat is not None:
            assert self.flat is None, "flat arrays are sent once"
            self.flat = (lp.flat.top_values, lp.flat.top_ids, lp.flat.start)

    def cat(self, name: str) -> np.ndarray:
        return np.concatenate(getattr(self, name))


def run(core, requests, joins: dict[int, list] | None = None, abort_at: dict[int, list[str]] | None = None, max_steps=2000):
    """Step until idle; `joins[s]` are added and `abort_at[s]` aborted before step s."""
    results: dict[str, Result] = {}
    joins, abort_at = joins or {}, abort_at or {}
    for request in requests:
        core.add(request)
    for step in range(max_steps):
        for request in joins.get(step, []):
            core.add(request)
        for rid in abort_at.get(step, []):
            core.abort(rid, "client gone")
        if not core.has_work() and step > max([*joins, *abort_at], default=-1):
            return results
        for output in core.step():
            results.setdefault(output.rid, Result()).absorb(output)
    raise AssertionError("core did not finish")


def request(rid, prompt, max_new_tokens=8, temperature=0.0, seed=None, logprobs=None, **sampling):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **sampling)
    return SchedulerRequest(rid, np.asarray(prompt, np.int32), "detok", params, logprobs or LogprobParams())


def prompt_of(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 2048, size=length).tolist()


ALL_LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))


# ---- outputs ----


def test_greedy_is_deterministic_and_matches_reference_argmax(make_core, tiny_runner):
    prompt = prompt_of(1, 12)
    first = run(make_core(), [request("a", prompt, ignore_eos=True)])["a"]
    second = run(make_core(), [request("a", prompt, ignore_eos=True)])["a"]
    assert first.tokens == second.tokens and len(first.tokens) == 8
    reference = reference_logprobs(tiny_runner, prompt + first.tokens)
    assert reference[len(prompt) - 1 : -1].argmax(dim=-1).tolist() == first.tokens


def test_requests_joining_mid_flight_match_running_alone(make_core):
    prompts = {f"r{i}": prompt_of(10 + i, 5 + 7 * i) for i in range(4)}
    alone = {rid: run(make_core(), [request(rid, p, ignore_eos=True)])[rid].tokens for rid, p in prompts.items()}
    joins = {2: [request("r1", prompts["r1"], ignore_eos=True)], 3: [request("r2", prompts["r2"], ignore_eos=True)], 5: [request("r3", prompts["r3"], ignore_eos=True)]}
    together = run(make_core(chunked_prefill_size=16), [request("r0", prompts["r0"], ignore_eos=True)], joins)
    assert {rid: r.tokens for rid, r in together.items()} == alone


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_matches_one_shot(make_core, chunk):
    prompt = prompt_of(2, 40)
    params = LogprobParams(return_logprob=True, logprob_start_len=3, top_logprobs_num=4, token_ids_logprob=(5, 6))
    one_shot = run(make_core(), [request("a", prompt, logprobs=params, ignore_eos=True)])["a"]
    chunked = run(make_core(chunked_prefill_size=chunk), [request("a", prompt, logprobs=params, ignore_eos=True)])["a"]
    assert chunked.tokens == one_shot.tokens
    assert chunked.num_outputs > one_shot.num_outputs  # it really was chunked
    for name in ("input_token", "input_top_values", "input_ids", "output_token", "output_top_values"):
        np.testing.assert_allclose(chunked.cat(name), one_shot.cat(name), atol=TOL, equal_nan=True)
    np.testing.assert_array_equal(chunked.cat("input_top_ids"), one_shot.cat("input_top_ids"))
    assert chunked.input_start == 3 and len(chunked.cat("input_token")) == 40 - 3


def test_kv_exhaustion_preempts_and_every_request_completes_as_alone(make_core):
    prompts = [prompt_of(20 + i, 2 + 3 * i) for i in range(4)]
    alone = [run(make_core(), [request("x", p, max_new_tokens=14, ignore_eos=True)])["x"].tokens for p in prompts]
    # 80 slots for 32 requests that each grow to 16..25 tokens: decodes outgrow admissions
    core = make_core(num_blocks=5, chunked_prefill_size=64)
    requests = [request(f"r{i}", prompts[i % 4], max_new_tokens=14, ignore_eos=True) for i in range(32)]
    results = run(core, requests)
    assert core.num_preemptions > 0
    assert len(results) == 32
    for i in range(32):
        assert results[f"r{i}"].finish == Finish(FinishType.LENGTH)
        assert results[f"r{i}"].tokens == alone[i % 4], f"r{i}"


def test_request_larger_than_the_kv_cache_is_aborted_not_crashing(make_core):
    core = make_core(num_blocks=2)  # 32 slots
    results = run(core, [request("big", prompt_of(3, 20), max_new_tokens=30, ignore_eos=True), request("ok", prompt_of(4, 5), max_new_tokens=3, ignore_eos=True)])
    assert results["big"].finish.type == FinishType.ABORT and "KV cache" in results["big"].finish.message
    assert results["ok"].finish == Finish(FinishType.LENGTH) and len(results["ok"].tokens) == 3


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(make_core):
    prompt = prompt_of(5, 10)
    sampled = dict(temperature=1.0, seed=1234, max_new_tokens=10, ignore_eos=True)
    alone = run(make_core(), [request("s", prompt, **sampled)])["s"].tokens
    others = [request(f"o{i}", prompt_of(40 + i, 6 + i), temperature=0.8, max_new_tokens=6) for i in range(6)]
    busy = run(make_core(num_blocks=6, chunked_prefill_size=4), [*others[:3], request("s", prompt, **sampled)], {3: others[3:]})
    assert busy["s"].tokens == alone
    other_seed = run(make_core(), [request("s", prompt, **{**sampled, "seed": 99})])["s"].tokens
    assert other_seed != alone


def test_stop_token_ids_and_max_new_tokens(make_core):
    prompt = prompt_of(6, 10)
    free = run(make_core(), [request("a", prompt, max_new_tokens=6, ignore_eos=True)])["a"]
    assert free.finish == Finish(FinishType.LENGTH) and len(free.tokens) == 6
    stop_at = free.tokens[2]
    stopped = run(make_core(), [request("a", prompt, max_new_tokens=6, ignore_eos=True, stop_token_ids=(stop_at,))])["a"]
    assert stopped.finish == Finish(FinishType.STOP, matched=stop_at)
    assert stopped.tokens == free.tokens[: free.tokens.index(stop_at) + 1]


class _EosRunner:
    """The tiny runner with a chosen eos id: lets a test make the model 'say' eos."""

    def __init__(self, runner, eos: int) -> None:
        self._runner = runner
        self.config = dataclasses.replace(runner.config, eos_token_ids=(eos,))

    def __getattr__(self, name):
        return getattr(self._runner, name)


def test_eos_finishes_unless_ignore_eos(tiny_runner):
    from services.scheduler.build import core_for

    prompt = prompt_of(7, 10)
    core = core_for(tiny_runner, max_running_requests=4, chunked_prefill_size=64)
    free = run(core, [request("a", prompt, max_new_tokens=5, ignore_eos=True)])["a"].tokens
    eos_core = core_for(_EosRunner(tiny_runner, free[1]), max_running_requests=4, chunked_prefill_size=64)
    stopped = run(eos_core, [request("a", prompt, max_new_tokens=5)])["a"]
    assert stopped.tokens == free[: free.index(free[1]) + 1]
    assert stopped.finish == Finish(FinishType.STOP, matched=free[1])
    ignored = run(eos_core, [request("a", prompt, max_new_tokens=5, ignore_eos=True)])["a"]
    assert ignored.tokens == free and ignored.finish == Finish(FinishType.LENGTH)


def test_max_model_len_and_invalid_requests(make_core):
    results = run(
        make_core(max_model_len=16),
        [request("a", prompt_of(8, 12), max_new_tokens=50, ignore_eos=True), request("long", prompt_of(8, 17)),
         request("exact", prompt_of(8, 16)), request("empty", [])],
    )
    assert results["exact"].finish.type == FinishType.ABORT and "max_model_len" in results["exact"].finish.message
    assert len(results["a"].tokens) == 4 and results["a"].finish == Finish(FinishType.LENGTH)
    assert results["long"].finish.type == FinishType.ABORT and "max_model_len" in results["long"].finish.message
    assert results["empty"].finish.type == FinishType.ABORT and results["empty"].tokens == []


def test_abort_before_prefill_finishes_returns_nothing_and_spares_the_batch(make_core):
    keep = request("keep", prompt_of(9, 8), max_new_tokens=6, ignore_eos=True)
    alone = run(make_core(), [keep])["keep"].tokens
    doomed = request("doomed", prompt_of(10, 60), max_new_tokens=6, ignore_eos=True)
    results = run(make_core(chunked_prefill_size=10), [keep, doomed], abort_at={2: ["doomed"]})
    assert results["doomed"].tokens == [] and results["doomed"].finish == Finish(FinishType.ABORT, message="client gone")
    assert results["keep"].tokens == alone


# ---- logprobs ----


@pytest.mark.parametrize("start", [0, 5])
def test_every_logprob_equals_a_plain_forward_pass(make_core, tiny_runner, start):
    prompt = prompt_of(11, 23)
    params = msgspec.structs.replace(ALL_LOGPROBS, logprob_start_len=start)
    other = request("o", prompt_of(12, 9), logprobs=LogprobParams(return_logprob=True, top_logprobs_num=2), temperature=0.7, seed=3)
    result = run(make_core(chunked_prefill_size=7), [request("a", prompt, logprobs=params, ignore_eos=True), other])["a"]
    reference = reference_logprobs(tiny_runner, prompt + result.tokens)  # [n, V]
    n_prompt = len(prompt)
    # prompt: first returned position null, position p from row p - 1
    assert result.input_start == start and len(result.cat("input_token")) == n_prompt - start
    assert np.isnan(result.cat("input_token")[0]) and (result.cat("input_top_ids")[0] == -1).all()
    rows = reference[start : n_prompt - 1]  # predicts positions start+1 .. n_prompt-1
    targets = torch.tensor(prompt[start + 1 :])
    _check_rows(rows, targets, result.cat("input_token")[1:], result.cat("input_top_values")[1:], result.cat("input_top_ids")[1:], result.cat("input_ids")[1:], params)
    # output: token i from the row that sampled it
    assert len(result.cat("output_token")) == len(result.tokens)
    rows = reference[n_prompt - 1 : -1]
    _check_rows(rows, torch.tensor(result.tokens), result.cat("output_token"), result.cat("output_top_values"), result.cat("output_top_ids"), result.cat("output_ids"), params)
    assert result.cat("output_top_ids")[:, 0].tolist() == result.tokens  # greedy token == top-1


def _check_rows(rows, targets, token, top_values, top_ids, ids, params):
    np.testing.assert_allclose(token, rows.gather(1, targets[:, None])[:, 0].numpy(), atol=TOL)
    np.testing.assert_allclose(top_values, rows.gather(1, torch.from_numpy(top_ids).long()).numpy(), atol=TOL)
    expected_top = rows.topk(params.top_logprobs_num, dim=-1).values.numpy()
    np.testing.assert_allclose(top_values, expected_top, atol=TOL)
    assert (np.diff(top_values, axis=1) <= 0).all()
    np.testing.assert_allclose(ids, rows[:, list(params.token_ids_logprob)].numpy(), atol=TOL)


def test_requests_without_logprobs_get_none_and_mixed_k_per_request(make_core):
    plain = request("plain", prompt_of(13, 6), max_new_tokens=3)
    k2 = request("k2", prompt_of(14, 6), max_new_tokens=3, logprobs=LogprobParams(return_logprob=True, top_logprobs_num=2))
    k7 = request("k7", prompt_of(15, 6), max_new_tokens=3, logprobs=LogprobParams(return_logprob=True, top_logprobs_num=7, token_ids_logprob=(1,)))
    core = make_core()
    for r in (plain, k2, k7):
        core.add(r)
    outputs = {o.rid: o for o in core.step()}
    assert outputs["plain"].logprobs is None
    assert outputs["k2"].logprobs.output.top_values.shape == (1, 2) and outputs["k2"].logprobs.output.m == 0  # no ids asked
    assert outputs["k7"].logprobs.output.top_ids.shape == (1, 7) and outputs["k7"].logprobs.output.ids.shape == (1, 1)
    assert outputs["k2"].logprobs.prompt is None  # logprob_start_len -1: output only


OUTPUT_ROWS = ("output_token", "output_top_values", "output_top_ids", "output_ids")


def _output_queries_per_step(core, monkeypatch) -> list[list[int]]:
    """Each step's output logprob queries, as the number of requests each one holds (filled as the core steps)."""
    from services.scheduler.worker import worker as worker_module

    seen, build = [], worker_module.ask

    def spy(plan, layout, processed):
        wanted = build(plan, layout, processed)
        seen.append([len(job.steps) for job in wanted.output])
        return wanted

    monkeypatch.setattr(worker_module, "ask", spy)
    return seen


def test_requests_asking_the_same_output_logprobs_share_one_query_a_step(make_core, monkeypatch):
    """A step's producers that ask the same k and ids are one output query (one pass over the batch,
    not an object per request); each request's rows are still its own, equal to its rows alone.
    Another k in the batch: a query per producer again."""
    params = LogprobParams(return_logprob=True, top_logprobs_num=3, token_ids_logprob=(5, 9))
    same = [request(f"r{i}", prompt_of(40 + i, 5 + i), max_new_tokens=4, ignore_eos=True, logprobs=params) for i in range(3)]
    plain = request("plain", prompt_of(50, 6), max_new_tokens=4, ignore_eos=True)
    core = make_core()
    queries = _output_queries_per_step(core, monkeypatch)
    together = run(core, [*same, plain])
    assert [3] in queries and all(len(q) <= 1 for q in queries)  # the plain request is in no query
    assert "plain" in together and together["plain"].output_token == []
    for r in same:
        alone = run(make_core(), [r])[r.rid]
        for name in OUTPUT_ROWS:
            np.testing.assert_allclose(together[r.rid].cat(name), alone.cat(name), atol=TOL)
    core = make_core()
    queries = _output_queries_per_step(core, monkeypatch)
    uniform = run(core, same)  # every running request asks the same: the plan says so, no pass to find out
    assert [3] in queries
    for r in same:
        for name in OUTPUT_ROWS:
            np.testing.assert_allclose(uniform[r.rid].cat(name), together[r.rid].cat(name), atol=TOL)
    other = request("k2", prompt_of(51, 7), max_new_tokens=4, ignore_eos=True, logprobs=LogprobParams(return_logprob=True, top_logprobs_num=2))
    core = make_core()
    queries = _output_queries_per_step(core, monkeypatch)
    mixed = run(core, [*same, other])
    assert [1, 1, 1, 1] in queries
    assert mixed["k2"].cat("output_top_values").shape == (4, 2) and mixed["r0"].cat("output_top_values").shape == (4, 3)
    for r in same:
        np.testing.assert_allclose(mixed[r.rid].cat("output_top_values"), together[r.rid].cat("output_top_values"), atol=TOL)


def test_every_plan_says_truly_what_its_sequences_share(make_core, monkeypatch):
    """The worker trusts a plan's `output_logprob_keys` (one key: every sequence has it),
    `processes_logits` (False: none has a processor) and `samples_randomly` (False: every token is
    the argmax) instead of asking each sequence: they come from the policy's running set, counted as
    sequences join and leave, and equal a recount. Held to over admissions, finishes, preemptions (3
    KV blocks), forks, an abort and followed steps, with logprob kinds, a penalized request and a
    sampled one mixed in, then alone."""
    import dataclasses

    from contracts.scheduler import ForkedChoice
    from services.scheduler import policy as policy_module

    checked = {"shared": 0, "unprocessed": 0, "greedy": 0, "sampled": 0}
    for name in ("schedule",):
        make = getattr(policy_module.Policy, name)

        def checking(self, *args, make=make, **kwargs):
            plan = make(self, *args, **kwargs)
            if plan is not None:  # exact, not only sound: a count that drifts would turn the worker's shortcuts off
                assert set(plan.output_logprob_keys) == {seq.params.output_logprob_key for seq in self._running}
                assert plan.processes_logits == any(seq.params.processes_logits for seq in self._running)
                assert plan.samples_randomly == any(seq.params.samples_randomly for seq in self._running)
                checked["sampled" if plan.samples_randomly else "greedy"] += 1
            if plan is not None and len(plan.output_logprob_keys) == 1:
                assert all(s.params.output_logprob_key == plan.output_logprob_keys[0] for s in plan.steps)
                checked["shared"] += 1
            if plan is not None and plan.processes_logits is False:
                assert not any(s.params.processes_logits for s in plan.steps)
                checked["unprocessed"] += 1
            return plan

        monkeypatch.setattr(policy_module.Policy, name, checking)
    top3 = LogprobParams(return_logprob=True, top_logprobs_num=3)
    kinds = [top3, top3, None, LogprobParams(return_logprob=True, top_logprobs_num=1, token_ids_logprob=(4,))]
    requests = [request(f"r{i}", prompt_of(80 + i, 3 + 2 * i), max_new_tokens=6 + i % 5, ignore_eos=True, logprobs=kinds[i % 4])
                for i in range(12)]  # fmt: skip
    requests[5] = request("r5", prompt_of(85, 9), max_new_tokens=8, ignore_eos=True, repetition_penalty=1.2, logprobs=top3)
    requests[7] = dataclasses.replace(requests[7], choices=(ForkedChoice("r7.1", "detok", 3),))
    requests[9] = request("r9", prompt_of(89, 5), max_new_tokens=7, temperature=0.8, seed=9, logprobs=top3)  # sampled: joins at step 4
    core = make_core(num_blocks=3, chunked_prefill_size=24, overlap_decode=True)
    results = run(core, requests[:8], joins={4: requests[8:]}, abort_at={6: ["r2"]})
    assert core.num_preemptions > 0 and "r7.1" in results and checked["shared"] > 0
    uniform = [request(f"u{i}", prompt_of(90 + i, 4 + i), max_new_tokens=5, ignore_eos=True, logprobs=top3) for i in range(4)]
    run(make_core(overlap_decode=True), uniform)
    assert checked["unprocessed"] > 0 and checked["greedy"] > 0 and checked["sampled"] > 0


def test_processed_mode_shares_a_query_only_between_requests_of_the_same_filters(make_core, monkeypatch):
    params = LogprobParams(return_logprob=True, top_logprobs_num=4)
    warm = [request(f"w{i}", prompt_of(60 + i, 6), max_new_tokens=3, temperature=0.5, seed=i, top_k=8, logprobs=params) for i in range(2)]
    hot = request("hot", prompt_of(62, 6), max_new_tokens=3, temperature=0.9, seed=2, top_k=8, logprobs=params)
    core = make_core(logprobs_mode="processed")
    queries = _output_queries_per_step(core, monkeypatch)
    warm_only = run(core, warm)
    assert [2] in queries  # other seeds, the same filters
    core = make_core(logprobs_mode="processed")
    queries = _output_queries_per_step(core, monkeypatch)
    together = run(core, [*warm, hot])
    assert [1, 1, 1] in queries
    hot_alone = run(make_core(logprobs_mode="processed"), [hot])["hot"]
    for name in OUTPUT_ROWS[:3]:  # no requested ids
        np.testing.assert_allclose(together["hot"].cat(name), hot_alone.cat(name), atol=TOL)
        for r in warm:
            np.testing.assert_allclose(together[r.rid].cat(name), warm_only[r.rid].cat(name), atol=TOL)


def test_processed_mode_applies_temperature(make_core, tiny_runner):
    prompt = prompt_of(16, 8)
    params = LogprobParams(return_logprob=True, top_logprobs_num=1)
    result = run(make_core(logprobs_mode="processed"), [request("a", prompt, max_new_tokens=2, temperature=0.5, seed=1, logprobs=params)])["a"]
    logits = reference_logprobs(tiny_runner, prompt + result.tokens)[len(prompt) - 1 : -1]  # log-softmax is shift-invariant
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, torch.tensor(result.tokens)[:, None])[:, 0]
    np.testing.assert_allclose(result.cat("output_token"), expected.numpy(), atol=TOL)


# ---- flat prompt top logprobs ----


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_flat_assembly_over_chunks_equals_nested_one_shot(make_core, chunk):
    prompt = prompt_of(17, 40)
    nested_params = LogprobParams(return_logprob=True, logprob_start_len=2, top_logprobs_num=3)
    flat_params = msgspec.structs.replace(nested_params, flat_prompt_top_logprobs=True)
    nested = run(make_core(), [request("a", prompt, max_new_tokens=2, logprobs=nested_params)])["a"]
    flat = run(make_core(chunked_prefill_size=chunk), [request("a", prompt, max_new_tokens=2, logprobs=flat_params)])["a"]
    assert flat.input_top_values == [] and flat.input_top_ids == []  # nested prompt rows not sent
    values, ids, null_prefix = flat.flat
    assert null_prefix == 1 and values.shape == (40 - 2 - 1, 3) and values.dtype == np.float32 and ids.dtype == np.int32
    np.testing.assert_allclose(values, nested.cat("input_top_values")[1:], atol=TOL)
    np.testing.assert_array_equal(ids, nested.cat("input_top_ids")[1:])
    np.testing.assert_allclose(flat.cat("input_token"), nested.cat("input_token"), atol=TOL, equal_nan=True)
    assert len(flat.cat("output_top_values")) == 2  # output rows stay nested


def test_processed_mode_logprobs_follow_the_request_filters(make_core):
    from services.scheduler.logprobs import FILTERED_LOGPROB

    params = LogprobParams(return_logprob=True, top_logprobs_num=5)
    sampled = request("a", prompt_of(18, 8), max_new_tokens=6, temperature=0.8, seed=3, top_k=2, logprobs=params)
    result = run(make_core(logprobs_mode="processed"), [sampled])["a"]
    top = result.cat("output_top_values")  # [6, 5]
    assert (top[:, 2:] == FILTERED_LOGPROB).all() and (top[:, :2] > FILTERED_LOGPROB).all()
    np.testing.assert_allclose(np.exp(top[:, :2]).sum(axis=1), 1.0, atol=1e-5)
    assert (result.cat("output_token") > FILTERED_LOGPROB).all()  # every sampled token was kept
