"""The draft-graph wrapper's CPU twin: padded batches and widened context equal the plain proposer."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from services.scheduler.spec.draft_graphs import DraftGraphs, _bucket
from services.scheduler.spec.dspark import DSparkProposer
from test_dspark_model import KV_BLOCK_SIZE, NUM_KV_BLOCKS, context_hidden, inject_rows, request


def test_padded_greedy_proposals_equal_the_plain_proposer(drafter):
    plain = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    graphs = DraftGraphs(DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE), capture=False, ladder=(1, 4, 8))
    tables = [[7, 1, 12, 3, 9], [4, 11, -1, -1, -1], [10, 0, 6, -1, -1]]
    lengths = [17, 3, 9]
    for i, n in enumerate(lengths):
        hidden = context_hidden(drafter, n, seed=30 + i)
        for proposer in (plain, graphs):
            inject_rows(proposer, hidden, tables[i], torch.arange(n))
    for rows in ([0], [0, 1, 2], [2, 1]):  # batches of 1 and 3 -> rungs 1 and 4; contexts widened to buckets
        anchors = [lengths[r] for r in rows]
        made = request([5 + r for r in rows], anchors, [tables[r] for r in rows], [0.0] * len(rows))
        want, got = plain.propose(made), graphs.propose(made)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=0)
        assert got.probs is None
    # (rung, context blocks): anchors up to 17 need 5 blocks of 4 -> bucket 8; up to 9 need 3 -> bucket 4
    assert sorted(graphs._graphs) == [(1, 8), (4, 4), (4, 8)]


def test_with_a_binding_window_graphs_equal_the_plain_proposer_and_share_one_bucket(drafter):
    # window 6, blocks of 4: any 6 positions lie in 3 blocks, so rows of any context length read 3 (the bucket)
    plain = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=6)
    graphs = DraftGraphs(DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=6), capture=False, ladder=(1, 4))
    tables = [[7, 1, 12, 3, 9, 2], [4, 11, 5, -1, -1, -1], [10, 0, 6, 8, 13, -1]]
    lengths = [23, 10, 17]
    for i, n in enumerate(lengths):
        hidden = context_hidden(drafter, n, seed=40 + i)
        for proposer in (plain, graphs):
            inject_rows(proposer, hidden, tables[i], torch.arange(n))
    for rows in ([0], [0, 1, 2], [1, 2]):
        made = request([5 + r for r in rows], [lengths[r] for r in rows], [tables[r] for r in rows], [0.0] * len(rows))
        want, got = plain.propose(made), graphs.propose(made)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=0)
    assert sorted(graphs._graphs) == [(1, 3), (4, 3)]


def test_sampled_batches_stay_eager_and_buckets_round_up():
    assert [_bucket(n) for n in (1, 2, 3, 5, 64, 65, 130)] == [1, 2, 4, 8, 64, 128, 192]


def test_each_draft_graph_captured_on_first_use_is_one_line(drafter, fake_cuda_capture):
    graphs = DraftGraphs(DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE), capture=True, ladder=(1, 4))
    table = [7, 1, 12, 3, 9]
    inject_rows(graphs, context_hidden(drafter, 9, seed=3), table, torch.arange(9))
    with capture_logs() as records:
        for rows in ([0], [0, 0, 0], [0]):  # rungs 1, 4, then 1 again (replayed: no line)
            graphs.propose(request([5] * len(rows), [9] * len(rows), [table] * len(rows), [0.0] * len(rows)))
    captured = [(r["rung"], r["graphs"]) for r in records if r["event"] == "dspark.draft_graph_captured"]
    assert captured == [(1, 1), (4, 2)]
