"""The whole speculative loop on CPU with test proposers: an oracle (drafts exactly what the target
decodes greedily) and a random one. Output and every logprob must equal plain decoding."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from contracts.scheduler import LogprobParams
from services.scheduler.host_io import HostUpload
from services.scheduler.spec.base import ContextRows, DraftProposal, DraftRequest
from test_scheduler_core import TOL, prompt_of, request, run

GAMMA = 4
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=1, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))


class OracleProposer:
    """Drafts the known greedy continuation of each request (looked up by rid)."""

    num_draft_tokens = GAMMA
    capture_layers = ()

    def __init__(self, sequences: dict[str, list[int]], vocab: int) -> None:
        self.sequences, self.vocab = sequences, vocab
        self.num_injected = 0

    def inject(self, context: ContextRows) -> None:
        self.num_injected += context.positions.shape[0]

    def propose(self, request: DraftRequest) -> DraftProposal:
        positions = request.anchor_positions.tolist()  # test-side read: the oracle needs it on the host
        rows = []
        for rid, anchor in zip(request.rids, positions, strict=True):
            tail = self.sequences[rid][anchor + 1 : anchor + 1 + GAMMA]
            rows.append(tail + [0] * (GAMMA - len(tail)))
        return DraftProposal(torch.tensor(rows, dtype=torch.int64), probs=None)


class RandomProposer:
    num_draft_tokens = GAMMA
    capture_layers = ()

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(0)

    def inject(self, context: ContextRows) -> None:
        pass

    def propose(self, request: DraftRequest) -> DraftProposal:
        tokens = torch.randint(0, self.vocab, (len(request.rids), GAMMA), generator=self.generator)
        return DraftProposal(tokens, probs=None)


def _longer(r, extra: int):
    import dataclasses

    return dataclasses.replace(r, sampling=msgspec.structs.replace(r.sampling, max_new_tokens=r.sampling.max_new_tokens + extra))


def _requests(num: int, logprobs: LogprobParams | None = None):
    return [request(f"r{i}", prompt_of(100 + i, 3 + 5 * i), max_new_tokens=9 + i, ignore_eos=True, logprobs=logprobs) for i in range(num)]


def _plain(make_core, requests, **options):
    return run(make_core(**options), requests)


@pytest.mark.parametrize("chunk", [256, 5])
def test_oracle_drafts_are_all_accepted_and_output_equals_plain_greedy(make_core, chunk):
    requests = _requests(6, LOGPROBS)
    plain = _plain(make_core, requests, chunked_prefill_size=chunk)
    # the oracle knows the continuation past max_new_tokens too: the last block is verified whole
    longer = _plain(make_core, [_longer(r, GAMMA + 1) for r in requests])
    sequences = {r.rid: r.prompt_ids.tolist() + longer[r.rid].tokens for r in requests}
    core = make_core(chunked_prefill_size=chunk, proposer=OracleProposer(sequences, 2048))
    spec = run(core, requests)
    _assert_same(plain, spec)
    stats = core.stats()
    assert stats.num_drafted_tokens > 0 and stats.num_accepted_tokens == stats.num_drafted_tokens
    for r in requests:
        # the first token comes from prefill, every verify after it yields min(GAMMA + 1, what is left)
        expected_verifies = -(-(len(plain[r.rid].tokens) - 1) // (GAMMA + 1))
        assert spec[r.rid].spec_verify_ct == expected_verifies, r.rid


def test_verify_blocks_through_the_graph_twin_equal_plain_greedy(make_core, tiny_runner):
    requests = _requests(4, LOGPROBS)
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    tiny_runner.prepare_decode_graphs(ladder=(1, 2, 4), max_blocks_per_seq=8, capture=False, query_lens=(1, GAMMA + 1))
    try:
        routed = []
        original = tiny_runner.decode_graphs.run
        tiny_runner.decode_graphs.run = lambda batch, q=1: routed.append(q) or original(batch, q)
        spec = run(make_core(proposer=OracleProposer(sequences, 2048)), requests)
    finally:
        tiny_runner.drop_decode_graphs()
    _assert_same(plain, spec)
    assert GAMMA + 1 in routed  # full verify blocks went through the padded static buffers


def test_random_drafts_are_rarely_accepted_and_output_still_equals_plain_greedy(make_core):
    requests = _requests(5, LOGPROBS)
    plain = _plain(make_core, requests)
    core = make_core(proposer=RandomProposer(2048))
    spec = run(core, requests)
    _assert_same(plain, spec)
    stats = core.stats()
    assert stats.num_drafted_tokens > 100 and stats.num_accepted_tokens <= stats.num_drafted_tokens // 20


def test_stops_inside_an_accepted_block_end_exactly_where_plain_decoding_ends(make_core):
    base = request("a", prompt_of(7, 10), max_new_tokens=20, ignore_eos=True, logprobs=LOGPROBS)
    free = _plain(make_core, [base])["a"].tokens
    stop_at = free[6]  # lands mid-block: verify blocks cover outputs 1-5, 6-10, ...
    cases = {
        "stop": request("stop", base.prompt_ids, max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop_at,), logprobs=LOGPROBS),
        "length": request("length", base.prompt_ids, max_new_tokens=8, ignore_eos=True, logprobs=LOGPROBS),
    }
    plain = _plain(make_core, list(cases.values()))
    sequences = {rid: base.prompt_ids.tolist() + free for rid in cases}
    spec = run(make_core(proposer=OracleProposer(sequences, 2048)), list(cases.values()))
    _assert_same(plain, spec)
    assert spec["stop"].tokens == free[: free.index(stop_at) + 1]
    assert len(spec["length"].tokens) == 8


def test_preemption_with_pending_drafts_keeps_outputs_equal(make_core):
    requests = [request(f"r{i}", prompt_of(20 + i % 4, 2 + 3 * (i % 4)), max_new_tokens=14, ignore_eos=True) for i in range(32)]
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    core = make_core(num_blocks=5, chunked_prefill_size=64, proposer=OracleProposer(sequences, 2048))
    spec = run(core, requests)
    assert core.num_preemptions > 0
    assert {rid: r.tokens for rid, r in spec.items()} == {rid: r.tokens for rid, r in plain.items()}


def test_abort_mid_block_frees_its_kv(make_core):
    requests = _requests(3)
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    core = make_core(proposer=OracleProposer(sequences, 2048))
    free_at_start = core.stats().num_free_blocks
    results = run(core, requests, abort_at={2: ["r1"]})
    assert results["r1"].finish.message == "client gone" and 0 < len(results["r1"].tokens) < len(plain["r1"].tokens)
    assert results["r0"].tokens == plain["r0"].tokens and results["r2"].tokens == plain["r2"].tokens
    assert core.stats().num_free_blocks == free_at_start


def test_one_device_to_host_copy_per_decode_step(make_core, monkeypatch):
    requests = _requests(4, LOGPROBS)
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    for proposer in (None, OracleProposer(sequences, 2048)):
        core = make_core(proposer=proposer)
        for r in requests:
            core.add(r)
        core.step()  # prefill
        reads = _count_reads(monkeypatch)
        for _ in range(3):
            before = core.worker.num_host_reads
            core.step()
            assert core.worker.num_host_reads == before + 1
        monkeypatch.undo()
        # the readback's .cpu() is the only device read (oracle proposers read anchors on the host: excluded)
        assert reads["cpu"] == 3 and reads["tolist"] == (3 if proposer else 0) and reads["item"] == 0


def test_one_host_to_device_upload_per_step_with_prompt_and_output_logprobs(make_core, monkeypatch):
    """Batch arrays, prompt logprob rows and output logprob rows travel in one upload."""
    requests = _requests(4, LOGPROBS)
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    sends = []
    original = HostUpload.send
    monkeypatch.setattr(HostUpload, "send", lambda self, arrays: sends.append(sorted(arrays)) or original(self, arrays))
    for proposer in (None, OracleProposer(sequences, 2048)):
        core = make_core(proposer=proposer)
        for r in requests:
            core.add(r)
        for step in range(4):  # the prefill (prompt and output logprobs), then decode or verify steps
            sends.clear()
            core.step()
            # overlapped decoding launches the first decode behind the prefill, in the same call
            followed = step == 0 and core.overlap_decode and proposer is None
            assert len(sends) == 1 + followed, sends
            assert [("prompt_logprobs.rows" in send) for send in sends] == [step == 0] + [False] * followed
            assert all("output_logprobs.ids" in send for send in sends)
            assert all("output_logprobs.rows" not in send for send in sends)  # every producer asks: its rows are all verify rows


def _count_reads(monkeypatch) -> dict[str, int]:
    reads = {"cpu": 0, "tolist": 0, "item": 0}
    for name in reads:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def _assert_same(plain, spec) -> None:
    assert set(plain) == set(spec)
    for rid in plain:
        a, b = plain[rid], spec[rid]
        assert b.tokens == a.tokens, rid
        assert b.finish == a.finish, rid
        for name in ("input_token", "input_top_values", "input_ids", "output_token", "output_top_values", "output_ids"):
            if getattr(a, name):
                np.testing.assert_allclose(b.cat(name), a.cat(name), atol=TOL, equal_nan=True, err_msg=f"{rid} {name}")
        for name in ("input_top_ids", "output_top_ids"):
            if getattr(a, name):
                np.testing.assert_array_equal(b.cat(name), a.cat(name), err_msg=f"{rid} {name}")
