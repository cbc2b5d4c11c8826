"""Structured output in the scheduler: bitmasks, the matcher's walk over drafts, and the core.

The tiny model's weights are random, so whatever it emits under a grammar is the grammar's doing:
every finished output must match. DSpark with random drafter weights proposes mostly invalid
drafts, which exercises the walk's early end and the matcher's rollback.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar
from tokenizers import Tokenizer

from contracts.detokenizer import FinishType
from contracts.scheduler import Grammar, GrammarKind, LogprobParams
from services.models import RANDOM_TINY_MODEL
from services.scheduler.grammar import GrammarBlock, GrammarMatchers
from services.scheduler.logits_processing import apply_token_bitmask
from test_dspark_core import dspark  # noqa: F401  (fixture)
from test_scheduler_core import prompt_of, request, run

EOS = (2, 0)
VOCAB = 2048
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "tag": {"enum": ["a", "bb", "ccc"]}},
    "required": ["id", "ok", "tag"],
}  # fmt: skip
GRAMMARS = [
    Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    Grammar(GrammarKind.REGEX, r"[a-c]{2,5}-\d{1,3}"),
    Grammar(GrammarKind.EBNF, 'root ::= "yes" | "no" | "maybe"'),
    Grammar(GrammarKind.REGEX, r"\d{2}", prefix="<n>", suffix="</n>"),
]


@pytest.fixture(scope="module")
def text_of():
    tokenizer = Tokenizer.from_file(str(RANDOM_TINY_MODEL / "tokenizer.json"))
    return lambda ids: tokenizer.decode([t for t in ids if t not in EOS], skip_special_tokens=False)


def matches(grammar: Grammar, text: str) -> bool:
    body = text.removeprefix(grammar.prefix).removesuffix(grammar.suffix)
    if not (text.startswith(grammar.prefix) and text.endswith(grammar.suffix)):
        return False
    if grammar.kind == GrammarKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(body), json.loads(grammar.text))
        return True
    if grammar.kind == GrammarKind.REGEX:
        return re.fullmatch(grammar.text, body) is not None
    return body in ("yes", "no", "maybe")


def test_apply_token_bitmask_matches_xgrammars_own_kernel():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((5, 100)).astype(np.float32))
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(5, 4), dtype=np.int64).astype(np.int32))
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    torch.testing.assert_close(apply_token_bitmask(logits, bitmask), expected)
    assert torch.isinf(apply_token_bitmask(logits, bitmask)).any()


def test_verify_rows_follow_the_drafts_and_the_matcher_rolls_back():
    matchers = GrammarMatchers(str(RANDOM_TINY_MODEL), VOCAB, EOS)
    grammar = Grammar(GrammarKind.REGEX, r"ab(c|d)e")
    tokenizer = Tokenizer.from_file(str(RANDOM_TINY_MODEL / "tokenizer.json"))
    a, b, c, d, e, z = (tokenizer.token_to_id(ch) for ch in "abcdez")

    tokens = [7, 8, a]  # two prompt tokens, then a committed output
    first = matchers.bitmask([GrammarBlock("r", grammar, tokens, 2, 1, [b, c, z])], 4).masks
    fresh = xgrammar.GrammarMatcher(matchers.compiled(grammar))
    expected = xgrammar.allocate_token_bitmask(4, VOCAB)
    fresh.accept_token(a)
    for j, draft in enumerate([b, c]):  # rows 0..2: after a, ab, abc; z is refused: row 3 allows all
        fresh.fill_next_token_bitmask(expected, j)
        assert fresh.accept_token(draft)
    fresh.fill_next_token_bitmask(expected, 2)
    expected[3] = -1
    assert torch.equal(first, expected)
    # the drafts were rolled back: accepted b and a bonus d come as committed tokens next
    found = matchers.bitmask([None, GrammarBlock("r", grammar, [*tokens, b, d], 2, 3, [e]), None], 2)
    assert found.rows.tolist() == [2, 3]  # the constrained block's rows alone
    second = found.masks
    after_abd = xgrammar.GrammarMatcher(matchers.compiled(grammar))
    assert all(after_abd.accept_token(t) for t in (a, b, d))
    row = xgrammar.allocate_token_bitmask(1, VOCAB)
    after_abd.fill_next_token_bitmask(row, 0)
    assert torch.equal(second[0], row[0])
    assert not bool((second[0] >> (c % 32))[c // 32] & 1) and bool((second[0][e // 32] >> (e % 32)) & 1)


def test_a_grammar_that_does_not_compile_is_a_request_error(make_core):
    core = make_core(tokenizer_dir=str(RANDOM_TINY_MODEL))
    bad = request("x", prompt_of(1, 4), grammar=Grammar(GrammarKind.REGEX, "(unclosed"))
    assert "regex grammar does not compile" in core.request_error(bad)
    assert core.request_error(request("y", prompt_of(1, 4), grammar=GRAMMARS[0])) is None
    untokenized = make_core()  # no tokenizer: refused, not run unconstrained
    assert "tokenizer.json" in untokenized.request_error(request("z", prompt_of(1, 4), grammar=GRAMMARS[0]))


def _grammar_requests(temperature: float, logprobs=None) -> list:
    return [
        request(f"g{i}", prompt_of(40 + i, 5 + i), max_new_tokens=48, temperature=temperature, seed=i,
                grammar=GRAMMARS[i % len(GRAMMARS)], logprobs=logprobs)
        for i in range(8)
    ]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_grammar_plain_and_dspark(make_core, dspark, text_of, temperature):  # noqa: F811
    requests = _grammar_requests(temperature)
    plain = run(make_core(tokenizer_dir=str(RANDOM_TINY_MODEL)), requests)
    spec_core = make_core(tokenizer_dir=str(RANDOM_TINY_MODEL), proposer=dspark())
    spec = run(spec_core, requests)
    for r in requests:
        for results in (plain, spec):
            result = results[r.rid]
            assert result.finish.type == FinishType.STOP, (r.rid, text_of(result.tokens))
            assert matches(r.sampling.grammar, text_of(result.tokens)), (r.rid, text_of(result.tokens))
    assert spec_core.stats().num_drafted_tokens > 0
    if temperature == 0:  # greedy under the same grammar: DSpark changes nothing
        assert {rid: r.tokens for rid, r in spec.items()} == {rid: r.tokens for rid, r in plain.items()}


def test_processed_logprobs_reflect_the_mask_and_raw_ones_do_not(make_core):
    wanted = LogprobParams(return_logprob=True, top_logprobs_num=8)
    requests = _grammar_requests(0.0, wanted)[1:2]  # the regex [a-c]{2,5}-\d{1,3}: few allowed tokens per row
    raw = run(make_core(tokenizer_dir=str(RANDOM_TINY_MODEL)), requests)["g1"]
    processed = run(make_core(tokenizer_dir=str(RANDOM_TINY_MODEL), logprobs_mode="processed"), requests)["g1"]
    assert raw.tokens == processed.tokens
    raw_top, processed_top = np.concatenate(raw.output_top_values), np.concatenate(processed.output_top_values)
    assert (processed_top <= -9999).any()  # masked tokens among the top 8: floored
    assert (raw_top > -9999).all()  # the model's own distribution: nothing masked
    processed_own, raw_own = np.concatenate(processed.output_token), np.concatenate(raw.output_token)
    assert (processed_own >= raw_own - 1e-5).all() and (processed_own > raw_own + 1e-3).any()  # renormalized over fewer tokens


def test_in_a_mixed_batch_only_the_constrained_rows_are_masked(make_core, dspark, text_of):  # noqa: F811
    constrained = _grammar_requests(0.0)[:4]
    free = [request(f"f{i}", prompt_of(90 + i, 6), max_new_tokens=12, ignore_eos=True) for i in range(3)]
    alone = run(make_core(tokenizer_dir=str(RANDOM_TINY_MODEL), proposer=dspark()), free)
    mixed = run(make_core(tokenizer_dir=str(RANDOM_TINY_MODEL), proposer=dspark()), [*constrained[:2], *free, *constrained[2:]])
    assert {r.rid: mixed[r.rid].tokens for r in free} == {r.rid: alone[r.rid].tokens for r in free}
    for r in constrained:
        assert matches(r.sampling.grammar, text_of(mixed[r.rid].tokens)), (r.rid, text_of(mixed[r.rid].tokens))
