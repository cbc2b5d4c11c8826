"""The DSpark drafter: serving (paged inject + propose) equals the dense training forward; Markov and
confidence heads do what the paper says; draft sampling is seeded per row and draws from q."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.scheduler.spec.base import ContextRows, DraftRequest
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.spec.dspark_model import SharedTarget, draft_targets, training_mask
from tests.services.scheduler.spec.chi_square import chi_square_p_value
from tests.services.scheduler.spec.conftest import BLOCK_SIZE, random_drafter

KV_BLOCK_SIZE = 4
NUM_KV_BLOCKS = 32
ATOL = 1e-4  # fp32; the two paths differ only by summation order


def context_hidden(drafter, seq_len: int, seed: int) -> torch.Tensor:
    width = drafter.config.num_context_layers * drafter.config.hidden_size
    return torch.randn(seq_len, width, generator=torch.Generator().manual_seed(seed))  # [S, K*H]


def request(anchor_tokens, anchor_positions, tables, temperatures, seeds=None) -> DraftRequest:
    return DraftRequest(
        rids=tuple(f"r{i}" for i in range(len(anchor_tokens))),
        anchor_tokens=torch.tensor(anchor_tokens),
        anchor_positions=torch.tensor(anchor_positions),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_anchor_position=max(anchor_positions),
        temperatures=tuple(temperatures),
        seeds=tuple(seeds or range(len(anchor_tokens))),
    )


def slots_of(table: list[int], positions: torch.Tensor) -> torch.Tensor:
    blocks = torch.tensor(table)[positions // KV_BLOCK_SIZE]
    return blocks * KV_BLOCK_SIZE + positions % KV_BLOCK_SIZE


def inject_rows(proposer, hidden: torch.Tensor, table: list[int], positions: torch.Tensor) -> None:
    proposer.inject(ContextRows(hidden=hidden[positions], positions=positions, slots=slots_of(table, positions)))


def dense_reference(drafter, hidden, ids, anchor, drafts):
    """Training forward for one anchor with the drafted tokens teacher-forced as prev: [gamma, V], [gamma]."""
    length = max(anchor + len(drafts), len(ids))  # room for every teacher-forced prev
    teacher = torch.cat((ids, torch.zeros(length - len(ids), dtype=torch.int64)))
    teacher[anchor + 1 : anchor + len(drafts)] = drafts[:-1]  # prev_k = d_k for k >= 1 (prev_0 = the anchor)
    padded_hidden = torch.cat((hidden, torch.zeros(length - len(ids), hidden.shape[1])))  # past the anchor: unseen
    out = drafter.forward_train(padded_hidden[None], teacher[None], torch.tensor([[anchor]]))
    return out.logits[0, 0], out.confidence[0, 0]


def test_serving_equals_training_forward_for_one_sequence(drafter):
    seq_len, table = 11, [5, 2, 9]
    hidden = context_hidden(drafter, seq_len, seed=0)
    ids = torch.randint(0, 60, (seq_len,), generator=torch.Generator().manual_seed(1))
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(seq_len))
    for anchor in (0, 1, 6, 10):
        proposal = proposer.propose(request([int(ids[anchor])], [anchor], [table], [1.0], seeds=[anchor]))
        logits, confidence = dense_reference(drafter, hidden, ids, anchor, proposal.tokens[0])
        torch.testing.assert_close(proposal.probs[0].log(), logits.log_softmax(-1), atol=ATOL, rtol=0)
        torch.testing.assert_close(proposal.confidence[0], confidence.sigmoid(), atol=ATOL, rtol=0)


def test_training_forward_of_many_anchors_equals_one_anchor_at_a_time(drafter):
    seq_len = 12
    hidden = context_hidden(drafter, seq_len, seed=2)[None]
    ids = torch.randint(0, 60, (1, seq_len), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[0, 4, 5, 11]])
    together = drafter.forward_train(hidden, ids, anchors)
    for j in range(anchors.shape[1]):
        alone = drafter.forward_train(hidden, ids, anchors[:, j : j + 1])
        torch.testing.assert_close(together.logits[:, j], alone.logits[:, 0], atol=ATOL, rtol=0)
        torch.testing.assert_close(together.confidence[:, j], alone.confidence[:, 0], atol=ATOL, rtol=0)


def test_paged_batch_of_ragged_sequences_equals_the_dense_reference(drafter):
    """Three sequences of different lengths, scattered blocks, context injected in shuffled chunks,
    stale rows past each anchor (rejected drafts) written too: they must not change the drafts."""
    lengths, anchors = [13, 3, 8], [13, 3, 6]  # rows 0..length-1 injected as committed, the rest stale
    tables = [[7, 1, 12, 3], [4, 11, -1, -1], [10, 0, 6, -1]]
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    hidden = [context_hidden(drafter, n + 2, seed=10 + i) for i, n in enumerate(lengths)]
    ids = [torch.randint(0, 60, (n + 2,), generator=torch.Generator().manual_seed(20 + i)) for i, n in enumerate(lengths)]
    stale = [h.clone().normal_() for h in hidden]
    for i, n in enumerate(lengths):  # stale rows first, then the committed ones over (or next to) them
        inject_rows(proposer, stale[i], tables[i], torch.arange(n + 2))
    chunks = [(i, positions) for i, n in enumerate(lengths) for positions in torch.arange(n).split(3)]
    for k in torch.randperm(len(chunks), generator=torch.Generator().manual_seed(4)).tolist():
        i, positions = chunks[k]
        inject_rows(proposer, hidden[i], tables[i], positions)
    anchor_tokens = [int(ids[i][a]) for i, a in enumerate(anchors)]
    proposal = proposer.propose(request(anchor_tokens, anchors, tables, [1.0, 0.7, 1.3], seeds=[5, 6, 7]))
    for i, (anchor, temperature) in enumerate(zip(anchors, [1.0, 0.7, 1.3])):
        committed = hidden[i].clone()
        committed[anchor:] = stale[i][anchor:]  # what the cache holds past the anchor: stale, must be masked
        logits, confidence = dense_reference(drafter, committed, ids[i], anchor, proposal.tokens[i])
        torch.testing.assert_close(proposal.probs[i].log(), (logits / temperature).log_softmax(-1), atol=ATOL, rtol=0)
        torch.testing.assert_close(proposal.confidence[i], confidence.sigmoid(), atol=ATOL, rtol=0)


def test_stale_context_past_the_anchor_is_masked_but_committed_context_matters(drafter):
    table = [3, 8, 1]
    hidden = context_hidden(drafter, 10, seed=30)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(10))
    ask = request([9], [6], [table], [0.0])
    before = proposer.block_hidden(proposer.draft_inputs(ask))
    inject_rows(proposer, hidden * -3.0, table, torch.arange(6, 10))  # rows at and past the anchor
    torch.testing.assert_close(proposer.block_hidden(proposer.draft_inputs(ask)), before, atol=0, rtol=0)
    inject_rows(proposer, hidden * -3.0, table, torch.arange(5, 6))  # the last committed row
    assert (proposer.block_hidden(proposer.draft_inputs(ask)) - before).abs().max() > 1e-3


def test_a_context_window_hides_the_context_before_it_and_only_that(drafter):
    # anchor 9, window 4: the block sees positions 5..8; rows 0..4 may change freely, row 5 may not
    table = [3, 8, 1]
    hidden = context_hidden(drafter, 12, seed=31)
    windowed = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=4)
    whole = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    ask = request([9], [9], [table], [0.0])
    for proposer in (windowed, whole):
        inject_rows(proposer, hidden, table, torch.arange(12))
    windowed_before, whole_before = (p.block_hidden(p.draft_inputs(ask)) for p in (windowed, whole))
    assert (windowed_before - whole_before).abs().max() > 1e-3  # the window binds at anchor 9
    for proposer in (windowed, whole):
        inject_rows(proposer, hidden * -3.0, table, torch.arange(0, 5))
    torch.testing.assert_close(windowed.block_hidden(windowed.draft_inputs(ask)), windowed_before, atol=0, rtol=0)
    assert (whole.block_hidden(whole.draft_inputs(ask)) - whole_before).abs().max() > 1e-3
    inject_rows(windowed, hidden * -3.0, table, torch.arange(5, 6))  # the oldest row in the window
    assert (windowed.block_hidden(windowed.draft_inputs(ask)) - windowed_before).abs().max() > 1e-3
    # an anchor no further than the window from the start sees what the whole context gives
    near = request([9], [4], [table], [0.0])
    fresh = [DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=w) for w in (4, 0)]
    for proposer in fresh:
        inject_rows(proposer, hidden, table, torch.arange(12))
    torch.testing.assert_close(*(p.block_hidden(p.draft_inputs(near)) for p in fresh), atol=0, rtol=0)


def test_a_binding_window_reads_only_its_blocks_and_drafts_as_the_whole_table_under_its_mask(drafter):
    # blocks of 4, window 5: 3 blocks a row (any 5 positions lie in at most 3), from the block of anchor - 5
    tables = [[3, 8, 1, 6, 9, 2], [4, 11, 5, 7, -1, -1]]
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=5)
    for i, n in enumerate((22, 13)):
        inject_rows(proposer, context_hidden(drafter, n, seed=50 + i), tables[i], torch.arange(n))
    ask = request([9, 4], [21, 13], tables, [0.0, 0.0])
    assert proposer.context_block_count(21) == 3 and proposer.context_block_count(8) == 2  # below the window: all
    windowed = proposer.draft_inputs(ask)
    # from columns 4 and 2 ((21 - 5) // 4, (13 - 5) // 4); past the table or its -1 padding: masked block ids
    assert windowed.context_blocks.tolist() == [[9, 2, 2], [5, 7, 0]]
    assert windowed.context_start.tolist() == [16, 8]
    whole = dataclasses.replace(windowed, context_blocks=torch.tensor(tables).clamp_min(0), context_start=torch.zeros(2, dtype=torch.int64))
    torch.testing.assert_close(proposer.block_hidden(windowed), proposer.block_hidden(whole), atol=1e-5, rtol=0)


def test_the_context_window_comes_from_the_draft_config_unless_given(drafter):
    original = drafter.config
    assert original.context_window is None and DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE).context_window is None
    drafter.config = dataclasses.replace(original, context_window=6)  # the session's drafter: put back below
    try:
        assert DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE).context_window == 6
        assert DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=3).context_window == 3
        assert DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=0).context_window is None  # 0: all
    finally:
        drafter.config = original
    with pytest.raises(ValueError, match="context_window must be >= 0"):
        DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, context_window=-1)


def test_greedy_drafts_are_the_argmax_chain_and_come_without_probs(drafter):
    table = [2, 3, 4]
    hidden = context_hidden(drafter, 9, seed=40)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(9))
    proposal = proposer.propose(request([17, 17], [8, 5], [table, table], [0.0, -1.0]))
    assert proposal.probs is None and proposal.tokens.shape == (2, BLOCK_SIZE)
    ids = torch.full((9,), 17)
    for row, anchor in enumerate((8, 5)):
        logits, _ = dense_reference(drafter, hidden, ids, anchor, proposal.tokens[row])
        assert torch.equal(logits.argmax(-1), proposal.tokens[row])


def test_markov_head_runs_left_to_right_from_the_anchor(draft_config, target):
    """With no LM head signal and W2 W1[t] = a spike at t + 1, the greedy block counts up from the
    anchor: slot k's bias must come from the token drafted at slot k - 1 (the anchor for slot 0)."""
    vocab = draft_config.vocab_size
    drafter = random_drafter(dataclasses.replace(draft_config, markov_rank=vocab), target, seed=3)
    drafter.target = SharedTarget(drafter.target.embed_tokens, torch.zeros_like(target.lm_head_weight))
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))  # W1[t] = e_t
        drafter.markov_head.markov_w2.weight.copy_(torch.eye(vocab).roll(1, dims=0))  # W2 e_t = e_{t+1}
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    proposal = proposer.propose(request([20, 62], [0, 0], [[0], [1]], [0.0, 0.0]))
    assert proposal.tokens.tolist() == [[21, 22, 23, 24], [63, 0, 1, 2]]


def test_draft_probs_are_the_markov_corrected_softmax_at_the_row_temperature(drafter):
    table = [6, 7]
    hidden = context_hidden(drafter, 7, seed=50)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(7))
    ask = request([33], [7], [table], [0.5])
    proposal = proposer.propose(ask)
    block = proposer.block_hidden(proposer.draft_inputs(ask))[0]  # [gamma, H]
    prev = torch.cat((torch.tensor([33]), proposal.tokens[0, :-1]))
    z = drafter.base_logits(block) + drafter.markov_head.block(prev, block)  # [gamma, V]
    torch.testing.assert_close(proposal.probs[0], (z / 0.5).softmax(-1), atol=1e-6, rtol=0)
    features = torch.cat((block, drafter.markov_head.markov_w1(prev)), dim=-1)
    expected = torch.sigmoid(features @ drafter.confidence_head.proj.weight[0] + drafter.confidence_head.proj.bias)
    torch.testing.assert_close(proposal.confidence[0], expected, atol=1e-6, rtol=0)


def test_sampled_drafts_depend_on_the_row_seed_not_on_the_batch(drafter):
    table = [1, 2, 3]
    hidden = context_hidden(drafter, 10, seed=60)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(10))
    alone = proposer.propose(request([5], [9], [table], [1.0], seeds=[123]))
    batched = proposer.propose(request([7, 5, 5], [4, 9, 9], [table] * 3, [0.0, 1.0, 1.0], seeds=[9, 123, 124]))
    assert torch.equal(batched.tokens[1], alone.tokens[0])
    torch.testing.assert_close(batched.probs[1], alone.probs[0], atol=1e-6, rtol=0)
    reseeded = [proposer.propose(request([5], [9], [table], [1.0], seeds=[s])).tokens[0] for s in range(8)]
    assert len({tuple(t.tolist()) for t in reseeded}) > 1  # the seed is what varies the draws


def test_slot_zero_draws_follow_q(drafter):
    """Chi-square over 4000 seeds: the exponential-race draw of slot 0 has distribution q_0."""
    table = [4, 5]
    hidden = context_hidden(drafter, 6, seed=70)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, num_draft_tokens=1)
    inject_rows(proposer, hidden, table, torch.arange(6))
    num = 4000
    proposal = proposer.propose(request([11] * num, [6] * num, [table] * num, [2.0] * num, seeds=list(range(num))))
    p_value = chi_square_p_value(proposal.tokens[:, 0], proposal.probs[0, 0])
    assert p_value > 1e-4, f"p = {p_value:.2e}"


def test_a_shorter_gamma_keeps_the_first_tokens_of_the_trained_block(drafter):
    table = [8, 9]
    hidden = context_hidden(drafter, 8, seed=80)
    full = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    short = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, num_draft_tokens=2)
    for proposer in (full, short):
        inject_rows(proposer, hidden, table, torch.arange(8))
    ask = request([3], [7], [table], [1.0], seeds=[1])
    long_block, short_block = full.propose(ask), short.propose(ask)
    assert short.num_draft_tokens == 2 and short_block.tokens.shape == (1, 2)
    assert torch.equal(short_block.tokens[0], long_block.tokens[0, :2])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE, num_draft_tokens=BLOCK_SIZE + 1)


def test_proposer_exposes_the_protocol_attributes(drafter, draft_config):
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    assert proposer.num_draft_tokens == BLOCK_SIZE == draft_config.block_size
    assert proposer.capture_layers == draft_config.target_layer_ids
    # Same blocks as the target's cache plus one trash block, the draft layers' kv heads.
    assert proposer.kv_cache.kv.shape == (2, 2, NUM_KV_BLOCKS + 1, KV_BLOCK_SIZE, 2, 8)


def test_training_mask_and_targets_align_slot_k_with_position_a_plus_k_plus_1():
    mask = training_mask(torch.tensor([[2, 0]]), seq_len=4, gamma=2)[0, 0]  # [4 queries, 4 + 4 keys]
    expected_context = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    expected_block = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert mask[:, :4].int().tolist() == expected_context
    assert mask[:, 4:].int().tolist() == expected_block
    labels, valid = draft_targets(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 2]]), gamma=2)
    assert labels[0].tolist()[0] == [12, 13] and valid[0].tolist() == [[True, True], [True, False]]


def test_an_empty_batch_proposes_an_empty_block(drafter):
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    empty = DraftRequest((), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                         torch.zeros(0, 2, dtype=torch.int32), 0, (), ())  # fmt: skip
    proposal = proposer.propose(empty)
    assert proposal.tokens.shape == (0, BLOCK_SIZE) and proposal.probs is None


def test_bfloat16_serving_keeps_its_dtypes_and_stays_close_to_fp32(drafter, draft_config, target):
    """The CUDA dtype path, on CPU: bf16 weights and cache, fp32 logits and probs."""
    from services.scheduler.spec.dspark_model import DSparkDrafter

    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.bfloat16())
    half = DSparkDrafter(draft_config, embed, target.lm_head_weight.bfloat16())
    half.load_state_dict(drafter.state_dict())
    half = half.bfloat16()
    half.rope_inv_freq = drafter.rope_inv_freq  # fp32, as the loader keeps it
    table, hidden = [2, 5, 7], context_hidden(drafter, 10, seed=90)
    results = []
    for model in (drafter, half):
        proposer = DSparkProposer(model, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
        inject_rows(proposer, hidden.to(model.fc.weight.dtype), table, torch.arange(10))
        results.append(proposer.propose(request([4, 4], [9, 6], [table, table], [1.0, 0.0], seeds=[1, 2])))
    full, bf16 = results
    assert proposer.kv_cache.kv.dtype == torch.bfloat16
    assert bf16.probs.dtype == torch.float32 and bf16.confidence.dtype == torch.float32
    distance = (bf16.probs[0, 0] - full.probs[0, 0]).abs().sum()  # slot 0: the same prefix in both
    assert distance < 0.01, distance


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_markov_variants_serve_as_they_train(draft_config, target, head_type):
    drafter = random_drafter(dataclasses.replace(draft_config, markov_head_type=head_type), target, seed=5)
    table, hidden = [9, 3, 6], context_hidden(drafter, 11, seed=100)
    ids = torch.randint(0, 60, (11,), generator=torch.Generator().manual_seed(101))
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(11))
    proposal = proposer.propose(request([int(ids[8])], [8], [table], [1.0], seeds=[3]))
    logits, confidence = dense_reference(drafter, hidden, ids, 8, proposal.tokens[0])
    torch.testing.assert_close(proposal.probs[0].log(), logits.log_softmax(-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(proposal.confidence[0], confidence.sigmoid(), atol=ATOL, rtol=0)


def test_markov_variant_formulas(draft_config, target):
    gated = random_drafter(dataclasses.replace(draft_config, markov_head_type="gated"), target, seed=6).markov_head
    rnn = random_drafter(dataclasses.replace(draft_config, markov_head_type="rnn"), target, seed=7).markov_head
    prev, hidden = torch.tensor([[4, 17]]), torch.randn(1, 2, draft_config.hidden_size)
    with torch.no_grad():
        w1 = gated.markov_w1.weight[prev]  # [1, 2, r]
        gate = torch.sigmoid(torch.cat((hidden, w1), -1) @ gated.gate_proj.weight.T + gated.gate_proj.bias)
        torch.testing.assert_close(gated.block(prev, hidden), (gate * w1) @ gated.markov_w2.weight.T)
        state, expected = torch.zeros(1, draft_config.markov_rank), []
        for slot in range(2):  # the state carries from slot 0 into slot 1
            z = torch.cat((state, rnn.markov_w1.weight[prev[:, slot]], hidden[:, slot]), -1)
            g, c, o = (z @ rnn.joint_proj.weight.T + rnn.joint_proj.bias).chunk(3, -1)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            expected.append(torch.tanh(o) @ rnn.markov_w2.weight.T)
        torch.testing.assert_close(rnn.block(prev, hidden), torch.stack(expected, dim=1))


def test_padded_rows_leave_the_real_rows_unchanged(drafter):
    """What a graph ladder does: pad B up to a captured size with trash-block rows; the real rows'
    drafts, q and confidence are the unpadded ones."""
    table, hidden = [3, 4, 5], context_hidden(drafter, 10, seed=110)
    proposer = DSparkProposer(drafter, NUM_KV_BLOCKS, KV_BLOCK_SIZE)
    inject_rows(proposer, hidden, table, torch.arange(10))
    for temperatures in ([0.0, 0.0], [1.0, 0.0]):
        inputs = proposer.draft_inputs(request([5, 8], [9, 4], [table, table], temperatures, seeds=[1, 2]))
        alone = proposer.draft(inputs)
        padded = proposer.draft(inputs.padded(8, proposer.kv_cache.trash_block))
        assert padded.tokens.shape == (8, BLOCK_SIZE) and torch.equal(padded.tokens[:2], alone.tokens)
        torch.testing.assert_close(padded.confidence[:2], alone.confidence, atol=1e-6, rtol=0)
        if alone.probs is not None:
            torch.testing.assert_close(padded.probs[:2], alone.probs, atol=1e-6, rtol=0)
