"""The logit processors against a reference written as plain loops over the definitions
(OpenAI's logit_bias and frequency/presence penalties, CTRL's repetition penalty, min_tokens)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from contracts.scheduler import SamplingParams
from services.scheduler.logits_processing import RowContext, is_identity, process_logits, token_counts

VOCAB = 12
EOS = frozenset({2})


def reference(logits: list[float], context: RowContext) -> list[float]:
    """One row, straight from the definitions, in vLLM's order."""
    params, out = context.params, list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(context.output_ids) < params.min_new_tokens:
        for token in (set() if params.ignore_eos else set(context.eos_ids)) | set(params.stop_token_ids):
            out[token] = -math.inf
    seen = set(context.prompt_ids) | set(context.output_ids)
    for token in range(len(out)):
        if token in seen and params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = list(context.output_ids).count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def random_context(rng: random.Random) -> RowContext:
    params = SamplingParams(
        frequency_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        presence_penalty=rng.choice([0.0, 0.7, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        min_new_tokens=rng.choice([0, 3, 10]),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randint(0, 3))),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.randint(0, 2))),
        ignore_eos=rng.random() < 0.3,
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
    return RowContext(params, prompt, output, EOS)


def test_every_processor_matches_its_definition_on_random_rows():
    rng = random.Random(7)
    contexts = [random_context(rng) for _ in range(64)]
    logits = torch.randn(len(contexts), VOCAB, generator=torch.Generator().manual_seed(3))  # [B, V]
    got = process_logits(logits, contexts)
    expected = torch.tensor([reference(row.tolist(), c) for row, c in zip(logits, contexts, strict=True)])
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, logits)  # the draw was not all identities


def test_penalties_change_the_distribution_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    context = RowContext(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[0], output_ids=[3, 3, 1])
    got = process_logits(logits, [context])[0]
    assert got.tolist() == [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 2 * 0.5 - 0.25]
    repetition = RowContext(SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert process_logits(logits, [repetition])[0].tolist() == [1.0, -2.0, 0.5, 3.0]  # seen: 0 (prompt), 1


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(min_new_tokens=2, stop_token_ids=(5,))
    early, late = RowContext(params, [1], [7], EOS), RowContext(params, [1], [7, 8], EOS)
    got = process_logits(logits, [early, late])
    assert got[0, 2] == -math.inf and got[0, 5] == -math.inf and torch.isfinite(got[0, [0, 1, 3, 4, 6]]).all()
    assert torch.isfinite(got[1]).all()


def test_logit_bias_of_minus_100_bans_and_plus_100_forces_under_greedy():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    banned = RowContext(SamplingParams(logit_bias=((0, -100.0),)), [1], [])
    forced = RowContext(SamplingParams(logit_bias=((2, 100.0),)), [1], [])
    assert process_logits(logits, [banned]).argmax().item() == 1
    assert process_logits(logits, [forced]).argmax().item() == 2


def test_identity_rows_leave_the_tensor_untouched():
    logits = torch.randn(3, VOCAB)
    contexts = [RowContext(SamplingParams(), [1], [2, 2]) for _ in range(3)]
    assert all(is_identity(c.params) for c in contexts)
    assert process_logits(logits, contexts) is logits
    mixed = contexts[:2] + [RowContext(SamplingParams(presence_penalty=1.0), [1], [2])]
    got = process_logits(logits, mixed)
    assert torch.equal(got[:2], logits[:2]) and got[2, 2] == logits[2, 2] - 1.0


@pytest.mark.parametrize("rows", [[[1, 1, 3], []], [[0], [11, 11, 11]]])
def test_token_counts(rows):
    counts = token_counts(rows, VOCAB, torch.device("cpu"))
    assert counts.tolist() == [[float(ids.count(t)) for t in range(VOCAB)] for ids in rows]
