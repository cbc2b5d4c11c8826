"""The seam as the worker will drive it, in a hand-written loop on the tiny target: prefill + inject,
then per step propose, verify [anchor, d_1..d_gamma] in one target forward, accept, inject every
verify row (rejected ones too). Greedy output must equal plain greedy decoding token for token, with
a random drafter (almost nothing accepted) and with an oracle drafter (every block fully accepted)."""

from __future__ import annotations

import json

import pytest
import torch

from services.scheduler.model import ForwardBatch, load_model_runner
from services.scheduler.spec.accept import VerifyBlock, accept
from services.scheduler.spec.base import ContextRows, DraftRequest
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.spec.dspark_config import draft_config_for_target
from tests.services.scheduler.spec.conftest import MASK_TOKEN_ID, TARGET_CONFIG, random_drafter

KV_BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 12
NUM_NEW_TOKENS = 20
PROMPTS = ([5, 9, 13, 2, 40, 7, 7], [33, 1, 60])
GAMMA = 4


def forward(runner, rows, capture=()):
    """rows: per sequence (token ids, first position, block table) -> (last-layer hidden [T, H], captured)."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for tokens, start, table in rows:
        pos = torch.arange(start, start + len(tokens))
        ids.append(torch.tensor(tokens))
        positions.append(pos)
        slots.append(torch.tensor(table)[pos // KV_BLOCK_SIZE] * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE)
        starts.append(starts[-1] + len(tokens))
        lens.append(start + len(tokens))
    batch = ForwardBatch(
        input_ids=torch.cat(ids), positions=torch.cat(positions),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([table for _, _, table in rows], dtype=torch.int32), slot_mapping=torch.cat(slots),
        capture_layers=capture,
    )  # fmt: skip
    out = runner.forward(batch)
    return runner.compute_logits(out.hidden_states), out.captured, batch


def plain_greedy(runner, prompt, table):
    logits, _, _ = forward(runner, [(prompt, 0, table)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < NUM_NEW_TOKENS:
        logits, _, _ = forward(runner, [([tokens[-1]], len(prompt) + len(tokens) - 1, table)])
        tokens.append(int(logits[-1].argmax()))
    return tokens


def speculative_greedy(runner, proposer, prompts, tables):
    """-> (new tokens per sequence, accepted drafts per verify)."""
    logits, captured, batch = forward(runner, [(p, 0, t) for p, t in zip(prompts, tables)], proposer.capture_layers)
    proposer.inject(ContextRows(hidden=captured, positions=batch.positions, slots=batch.slot_mapping))
    ends = batch.query_start_loc[1:].long() - 1
    outputs = [[int(t)] for t in logits[ends].argmax(-1)]  # the anchors
    accepted_counts = []
    while min(len(o) for o in outputs) < NUM_NEW_TOKENS:
        anchors = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs)]
        request = DraftRequest(
            rids=("a", "b"), anchor_tokens=torch.tensor([o[-1] for o in outputs]),
            anchor_positions=torch.tensor(anchors), block_tables=torch.tensor(tables, dtype=torch.int32),
            max_anchor_position=max(anchors), temperatures=(0.0, 0.0), seeds=(0, 0),
        )  # fmt: skip
        drafts = proposer.propose(request).tokens  # [2, gamma]
        rows = [([o[-1], *d.tolist()], a, t) for o, d, a, t in zip(outputs, drafts, anchors, tables)]
        logits, captured, batch = forward(runner, rows, proposer.capture_layers)
        block = VerifyBlock(
            target_argmax=logits.argmax(-1).view(2, GAMMA + 1), drafts=drafts,
            num_draft=torch.full((2,), GAMMA), is_greedy=torch.ones(2, dtype=torch.bool),
        )  # fmt: skip
        num_accepted, next_token = accept(block)
        proposer.inject(ContextRows(hidden=captured, positions=batch.positions, slots=batch.slot_mapping))
        for b, output in enumerate(outputs):
            output.extend([*drafts[b, : num_accepted[b]].tolist(), int(next_token[b])])
        accepted_counts.extend(num_accepted.tolist())
    return [o[:NUM_NEW_TOKENS] for o in outputs], accepted_counts


@pytest.fixture
def runner(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TARGET_CONFIG))
    return load_model_runner(tmp_path, load_format="dummy", num_kv_blocks=4 * BLOCKS_PER_SEQ, kv_block_size=4, seed=7)


def make_bigram(runner) -> torch.Tensor:
    """Zero every layer's output projections: the target's next token depends on the last token only."""
    with torch.no_grad():
        for layer in runner.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        vocab = runner.config.vocab_size
        hidden = runner.model.model.norm(runner.model.model.embed_tokens(torch.arange(vocab)))
    return runner.compute_logits(hidden).argmax(-1)  # [V]: f(t)


def proposer_for(runner, markov_rank: int, seed: int) -> DSparkProposer:
    config = draft_config_for_target(
        runner.config, num_draft_layers=2, mask_token_id=MASK_TOKEN_ID, block_size=GAMMA, markov_rank=markov_rank
    )
    return DSparkProposer(random_drafter(config, runner.model, seed), runner.num_blocks, KV_BLOCK_SIZE)


def tables_for(first_block: int) -> list[list[int]]:
    return [list(range(first_block + b * BLOCKS_PER_SEQ, first_block + (b + 1) * BLOCKS_PER_SEQ)) for b in range(2)]


def test_greedy_with_a_random_drafter_equals_plain_greedy(runner):
    proposer = proposer_for(runner, markov_rank=8, seed=11)
    spec_tables, plain_tables = tables_for(0), tables_for(2 * BLOCKS_PER_SEQ)
    outputs, accepted = speculative_greedy(runner, proposer, PROMPTS, spec_tables)
    assert outputs == [plain_greedy(runner, p, t) for p, t in zip(PROMPTS, plain_tables)]
    assert max(accepted) < GAMMA  # random drafts: the test exercises rejections


def test_an_oracle_drafter_is_fully_accepted_and_gives_the_same_output(runner):
    follow = make_bigram(runner)
    vocab = runner.config.vocab_size
    proposer = proposer_for(runner, markov_rank=vocab, seed=12)
    with torch.no_grad():  # the Markov head encodes the target's bigram: bias(t) = 100 * e_f(t)
        proposer.drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        proposer.drafter.markov_head.markov_w2.weight.copy_(100.0 * torch.eye(vocab)[follow].T)
    spec_tables, plain_tables = tables_for(0), tables_for(2 * BLOCKS_PER_SEQ)
    outputs, accepted = speculative_greedy(runner, proposer, PROMPTS, spec_tables)
    assert outputs == [plain_greedy(runner, p, t) for p, t in zip(PROMPTS, plain_tables)]
    assert set(accepted) == {GAMMA}  # gamma + 1 tokens per verify
