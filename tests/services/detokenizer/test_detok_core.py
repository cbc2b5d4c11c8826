import numpy as np
import pytest
from tokenizers import Tokenizer

from contracts.detokenizer import DetokenizeParams, DetokenizerRegistration, Finish, FinishType
from services.common.logprob_rows import RequestLogprobs, RowLogprobs, from_columns
from contracts.scheduler import AbortRequest
from services.common.arrays import from_wire, to_wire
from services.detokenizer.core import DetokenizerCore
from tests.services.detokenizer.conftest import output_logprobs, token_batch

LENGTH = Finish(FinishType.LENGTH)
STOP_EOS = Finish(FinishType.STOP, matched=2)

# Pools that exercise multi-byte UTF-8: accents, combining marks, CJK, emoji with modifiers and ZWJ.
CHAR_POOLS = [
    "abcdefghij klmnop qrstuvwxyz ,.!?\n",
    "éüñçøå",
    "e\u0301a\u0308o\u0303\u20dd",
    "你好世界中文字符測試",
    "日本語のテキスト",
    "👍🏽👨\u200d👩\u200d👧🎉🚀",
    "\u00a0\u2028𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def random_text(rng: np.random.Generator, length: int) -> str:
    pool = "".join(CHAR_POOLS)
    return "".join(pool[i] for i in rng.integers(0, len(pool), length))


def make_core(tokenizer: Tokenizer, **requests: DetokenizeParams) -> DetokenizerCore:
    core = DetokenizerCore(tokenizer, "detok-1")
    for rid, params in requests.items():
        core.register(DetokenizerRegistration(rid=rid, tokenizer_id="tok-1", params=params))
    return core


def stream_one_by_one(
    core: DetokenizerCore, rid: str, ids: list[int], finish: Finish | None = LENGTH, aborts: list | None = None
):
    """Feed ids one per batch, finishing with the last; return (deltas, finish, kept ids)."""
    deltas, kept, last_finish = [], [], None
    for position, token_id in enumerate(ids):
        final = finish if position == len(ids) - 1 else None
        result = core.process(token_batch([(rid, [token_id], final)], step=position))
        if aborts is not None:
            aborts.extend(result.aborts)
        for text_batch in result.outputs.values():
            deltas.extend(text_batch.text_deltas)
            kept.extend(from_wire(text_batch.new_token_ids).tolist())
            last_finish = text_batch.finish[0]
    return deltas, last_finish, kept


@pytest.mark.parametrize("seed", range(8))
def test_one_token_at_a_time_concatenates_to_full_decode(tokenizer, seed):
    rng = np.random.default_rng(seed)
    text = random_text(rng, 120)
    ids = tokenizer.encode(text).ids
    deltas, finish, kept = stream_one_by_one(make_core(tokenizer, r=DetokenizeParams()), "r", ids)
    expected = tokenizer.decode(ids)
    assert "".join(deltas) == expected
    assert "\ufffd" not in expected
    assert all("\ufffd" not in delta for delta in deltas)
    assert finish == LENGTH
    assert kept == ids


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_concatenate_to_full_decode(tokenizer, seed):
    """Model output need not be valid UTF-8: held bytes still come out, exactly as decode() has them."""
    ids = np.random.default_rng(seed).integers(3, tokenizer.get_vocab_size(), 200).tolist()
    deltas, _, _ = stream_one_by_one(make_core(tokenizer, r=DetokenizeParams()), "r", ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_incomplete_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("x👍").ids
    assert len(ids) > 2  # the emoji spans several byte-level tokens
    deltas, _, _ = stream_one_by_one(make_core(tokenizer, r=DetokenizeParams()), "r", ids)
    assert deltas[0] == "x"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "👍"


def test_incomplete_character_at_finish_is_flushed(tokenizer):
    ids = tokenizer.encode("x👍").ids[:-1]
    deltas, _, _ = stream_one_by_one(make_core(tokenizer, r=DetokenizeParams()), "r", ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def first_token_completing(tokenizer: Tokenizer, ids: list[int], needle: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if needle in tokenizer.decode(ids[:k]))


def test_stop_string_spanning_tokens_is_trimmed_and_cut(tokenizer):
    text = "The answer is 42 and the end marker STOPHERE comes before the rest of it."
    ids = tokenizer.encode(text).ids
    num_kept = first_token_completing(tokenizer, ids, "STOPHERE")
    assert num_kept < len(ids)
    assert len(tokenizer.encode("STOPHERE").ids) > 1  # the stop string really spans tokens
    core = make_core(tokenizer, r=DetokenizeParams(stop=("STOPHERE", "never")))
    logprobs = output_logprobs(len(ids), k=3, m=2)
    result = core.process(token_batch([("r", ids, None)], logprobs=[logprobs]))
    out = result.outputs["tok-1"]
    assert out.text_deltas == [text[: text.index("STOPHERE")]]
    assert from_wire(out.new_token_ids).tolist() == ids[:num_kept]
    assert from_wire(out.num_new_tokens).tolist() == [num_kept]
    assert out.finish == [Finish(FinishType.STOP, matched="STOPHERE")]
    assert result.aborts == [AbortRequest(rid="r", reason="stop")]
    (cut,) = from_columns(out.output_logprobs, 1)
    for name in ("token", "top_values", "top_ids", "ids"):
        full = getattr(logprobs.output, name)
        np.testing.assert_array_equal(getattr(cut, name), full[:num_kept])
    assert cut.top_values.shape == (num_kept, 3)


def test_stop_string_one_token_per_batch_then_late_tokens_dropped(tokenizer):
    text = "alpha beta STOPHERE gamma delta"
    ids = tokenizer.encode(text).ids
    num_kept = first_token_completing(tokenizer, ids, "STOPHERE")
    core = make_core(tokenizer, r=DetokenizeParams(stop=("STOPHERE",)))
    aborts = []
    deltas, finish, kept = stream_one_by_one(core, "r", ids, aborts=aborts)
    assert aborts == [AbortRequest(rid="r", reason="stop")]  # the match ended its batch: nothing cut
    assert "".join(deltas) == "alpha beta "
    assert finish == Finish(FinishType.STOP, matched="STOPHERE")
    assert kept == ids[:num_kept]
    assert core.num_running == 0
    late = core.process(token_batch([("r", ids[:2], Finish(FinishType.ABORT))]))
    assert late.outputs == {} and late.aborts == []


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("one two STOPHERE three").ids
    core = make_core(tokenizer, r=DetokenizeParams(stop=("STOPHERE",), no_stop_trim=True))
    out = core.process(token_batch([("r", ids, None)])).outputs["tok-1"]
    assert out.text_deltas == ["one two STOPHERE"]


def test_held_back_stop_prefix_is_released_when_it_does_not_complete(tokenizer):
    text = "we see END but not ENDING, then ENDIN at the very end ENDI"
    ids = tokenizer.encode(text).ids
    core = make_core(tokenizer, r=DetokenizeParams(stop=("ENDINGX",)))
    deltas, finish, kept = stream_one_by_one(core, "r", ids, finish=LENGTH)
    assert "".join(deltas) == text
    assert finish == LENGTH and kept == ids
    # Text is held while it could still be the stop string.
    emitted = ""
    for delta in deltas[:-1]:
        emitted += delta
        assert not any("ENDINGX".startswith(emitted[-n:]) for n in range(1, 7) if len(emitted) >= n)


def test_held_back_prefix_flushed_on_scheduler_finish(tokenizer):
    ids = tokenizer.encode("hello world XY").ids
    core = make_core(tokenizer, r=DetokenizeParams(stop=("XYZ",)))
    first = core.process(token_batch([("r", ids, None)])).outputs["tok-1"]
    assert first.text_deltas == ["hello world "]
    last = core.process(token_batch([("r", [], STOP_EOS)])).outputs["tok-1"]
    assert last.text_deltas == ["XY"]
    assert last.finish == [STOP_EOS]
    assert core.num_running == 0


def test_multiple_owners_get_one_batch_each(tokenizer):
    core = DetokenizerCore(tokenizer, "detok-1")
    owners = {"a": "tok-A", "b": "tok-B", "c": "tok-A", "d": "tok-B"}
    for rid, owner in owners.items():
        core.register(DetokenizerRegistration(rid=rid, tokenizer_id=owner, params=DetokenizeParams()))
    texts = {"a": "apple", "b": "banana split", "c": "", "d": "dates 🌴"}
    entries = [(rid, tokenizer.encode(texts[rid]).ids, LENGTH if rid == "b" else None) for rid in owners]
    result = core.process(token_batch(entries, spec_verify_ct=[1, 2, 3, 4]))
    assert set(result.outputs) == {"tok-A", "tok-B"}
    for owner, rids in {"tok-A": ["a", "c"], "tok-B": ["b", "d"]}.items():
        out = result.outputs[owner]
        assert out.rids == rids
        assert out.text_deltas == [texts[rid] for rid in rids]
        expected_ids = [token for rid in rids for token in tokenizer.encode(texts[rid]).ids]
        assert from_wire(out.new_token_ids).tolist() == expected_ids
        assert from_wire(out.num_new_tokens).tolist() == [len(tokenizer.encode(texts[rid]).ids) for rid in rids]
        index = [list(owners).index(rid) for rid in rids]
        assert from_wire(out.prompt_tokens).tolist() == [10 + i for i in index]
        assert from_wire(out.spec_verify_ct).tolist() == [1 + i for i in index]
        assert out.detokenizer_id == "detok-1" and out.scheduler_id == "sched-1"
    assert result.outputs["tok-B"].finish == [LENGTH, None]
    assert core.num_running == 3


def flat_logprobs(n: int, rows: int, k: int) -> RequestLogprobs:
    rng = np.random.default_rng(1)
    outputs = output_logprobs(n, k, 1).output if n else None
    flat = RowLogprobs.of(None, -rng.random((rows, k), dtype=np.float32), rng.integers(0, 2048, (rows, k), dtype=np.int32), start=1)
    return RequestLogprobs(outputs, RowLogprobs.of(-rng.random(rows + 1, dtype=np.float32), start=0), flat)


def test_logprobs_pass_through_untouched_without_cut(tokenizer):
    ids = tokenizer.encode("plain text").ids
    core = make_core(tokenizer, r=DetokenizeParams(stop=("nomatch",)))
    logprobs = flat_logprobs(len(ids), rows=50, k=4)
    batch = token_batch([("r", ids, None)], logprobs=[logprobs])
    out = core.process(batch).outputs["tok-1"]
    assert (out.output_logprobs, out.prompt_logprobs, out.prompt_top_flat) == (batch.output_logprobs, batch.prompt_logprobs, batch.prompt_top_flat)
    assert out.output_logprobs is batch.output_logprobs and out.prompt_top_flat is batch.prompt_top_flat
    assert out.new_token_ids is batch.new_token_ids  # one owner, nothing cut: same arrays


def test_flat_fields_same_objects_when_output_is_cut(tokenizer):
    ids = tokenizer.encode("keep this STOPHERE drop this").ids
    num_kept = first_token_completing(tokenizer, ids, "STOPHERE")
    core = make_core(tokenizer, r=DetokenizeParams(stop=("STOPHERE",)))
    logprobs = flat_logprobs(len(ids), rows=50, k=4)
    batch = token_batch([("r", ids, None)], logprobs=[logprobs])
    out = core.process(batch).outputs["tok-1"]
    assert out.prompt_logprobs is batch.prompt_logprobs and out.prompt_top_flat is batch.prompt_top_flat
    (flat,), (prompt,), (cut,) = (from_columns(c, 1) for c in (out.prompt_top_flat, out.prompt_logprobs, out.output_logprobs))
    assert flat.start == 1 and prompt.start == 0
    assert cut.token.shape == (num_kept,)
    np.testing.assert_array_equal(cut.top_values, logprobs.output.top_values[:num_kept])


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>there").ids
    assert 2 in ids
    core = make_core(tokenizer, skip=DetokenizeParams(), keep=DetokenizeParams(skip_special_tokens=False))
    result = core.process(token_batch([("skip", ids, LENGTH), ("keep", ids, LENGTH)])).outputs["tok-1"]
    assert result.text_deltas == ["hithere", "hi<|im_end|>there"]


def test_unknown_rid_is_dropped(tokenizer):
    core = make_core(tokenizer, known=DetokenizeParams())
    ids = tokenizer.encode("abc").ids
    out = core.process(token_batch([("ghost", [5, 6], None), ("known", ids, None)])).outputs["tok-1"]
    assert out.rids == ["known"]
    assert from_wire(out.new_token_ids).tolist() == ids
    assert from_wire(out.prompt_tokens).tolist() == [11]


def test_prefill_chunk_with_no_tokens_passes_logprobs(tokenizer):
    core = make_core(tokenizer, r=DetokenizeParams(stop=("x",)))
    logprobs = flat_logprobs(0, rows=8, k=2)
    batch = token_batch([("r", [], None)], logprobs=[logprobs])
    out = core.process(batch).outputs["tok-1"]
    assert out.text_deltas == [""] and out.finish == [None]
    assert out.prompt_logprobs is batch.prompt_logprobs and out.prompt_top_flat is batch.prompt_top_flat


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("one_by_one", [True, False])
def test_random_stop_strings_cut_at_the_completing_token(tokenizer, seed, one_by_one):
    rng = np.random.default_rng(100 + seed)
    ids = tokenizer.encode(random_text(rng, 80)).ids
    full = tokenizer.decode(ids)
    start = int(rng.integers(0, len(full) - 6))
    stop = full[start : start + int(rng.integers(1, 6))]
    num_kept = first_token_completing(tokenizer, ids, stop)
    core = make_core(tokenizer, r=DetokenizeParams(stop=(stop,)))
    if one_by_one:
        deltas, finish, kept = stream_one_by_one(core, "r", ids)
    else:
        out = core.process(token_batch([("r", ids, None)])).outputs["tok-1"]
        deltas, finish, kept = out.text_deltas, out.finish[0], from_wire(out.new_token_ids).tolist()
    assert "".join(deltas) == full[: full.index(stop)]
    assert finish == Finish(FinishType.STOP, matched=stop)
    assert kept == ids[:num_kept]


def split_char_tokenizer() -> Tokenizer:
    """A byte-level BPE whose one merge joins "c" with the first byte of "é"/"è"/"ê"."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=257, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["cé cè cê"] * 100, trainer)
    return tokenizer


@pytest.mark.parametrize("one_by_one", [True, False])
def test_stop_complete_before_an_incomplete_character_ends_at_that_token(one_by_one):
    tokenizer = split_char_tokenizer()
    ids = tokenizer.encode("abcé tail").ids
    assert tokenizer.decode(ids[:3]) == "abc\ufffd"  # token 3 ends "abc" and starts "é"
    core = make_core(tokenizer, r=DetokenizeParams(stop=("bc",)))
    if one_by_one:
        deltas, finish, kept = stream_one_by_one(core, "r", ids)
    else:
        out = core.process(token_batch([("r", ids, None)])).outputs["tok-1"]
        deltas, finish, kept = out.text_deltas, out.finish[0], from_wire(out.new_token_ids).tolist()
    assert "".join(deltas) == "a"
    assert finish == Finish(FinishType.STOP, matched="bc")
    assert kept == ids[:3]


def test_forget_scheduler_drops_only_its_requests(tokenizer):
    core = make_core(tokenizer, a=DetokenizeParams(), b=DetokenizeParams(), idle=DetokenizeParams())
    core.process(token_batch([("a", [40], None)], scheduler_id="s-dead"))
    core.process(token_batch([("b", [41], None)], scheduler_id="s-alive"))
    assert core.forget_scheduler("s-dead") == ["a"]
    assert core.num_running == 2
    assert core.process(token_batch([("a", [42], None)], scheduler_id="s-dead")).outputs == {}


def test_abort_drops_only_requests_without_tokens(tokenizer):
    from contracts.detokenizer import DetokenizeParams, DetokenizerRegistration
    from services.detokenizer.core import DetokenizerCore

    core = DetokenizerCore(tokenizer, "d")
    core.register(DetokenizerRegistration("never-claimed", "tok", DetokenizeParams()))
    assert core.forget_unstarted("never-claimed") is True
    assert core.num_running == 0
    assert core.forget_unstarted("unknown") is False


# min_tokens with stop strings (vLLM's rule): the text of the first min_tokens output tokens cannot
# end a stop string; a match that ends after it is a stop, even if it starts inside it.


def batches_of(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` split into consecutive batches of `sizes` (a DSpark step delivers several tokens)."""
    assert sum(sizes) >= len(ids)
    edges = np.cumsum([0, *sizes]).tolist()
    return [ids[a:b] for a, b in zip(edges, edges[1:]) if a < len(ids)]


def stream_batches(core: DetokenizerCore, rid: str, batches: list[list[int]], finish: Finish | None = LENGTH):
    """Feed each batch as one TokenBatch, finishing with the last; return (text, finish, kept ids)."""
    text, kept, last_finish = "", [], None
    for step, ids in enumerate(batches):
        final = finish if step == len(batches) - 1 else None
        for out in core.process(token_batch([(rid, ids, final)], step=step)).outputs.values():
            text += out.text_deltas[0]
            kept.extend(from_wire(out.new_token_ids).tolist())
            last_finish = out.finish[0]
    return text, last_finish, kept


def min_tokens_reference(tokenizer: Tokenizer, ids: list[int], stop: str, min_tokens: int) -> tuple[str, int] | None:
    """(text, ids kept) under vLLM's rule, from whole decodes; None when no stop counts."""
    visible = lambda k: tokenizer.decode(ids[:k]).rstrip("\ufffd")  # noqa: E731 (complete characters)
    num_protected = len(visible(min_tokens))
    for k in range(min_tokens + 1, len(ids) + 1):
        index = visible(k).find(stop, max(0, num_protected - len(stop) + 1))
        if index >= 0:
            return visible(k)[:index], k
    return None


A_B = "a b a b a b a b"  # tokens 'a', ' b', ' a', ' b', ...: " b" ends tokens 2, 4, 6 and 8


@pytest.mark.parametrize("sizes", [[1] * 8, [8], [2, 2, 2, 2], [1, 3, 4], [3, 5]])
def test_stop_string_inside_min_tokens_is_ignored_and_the_next_honoured(tokenizer, sizes):
    ids = tokenizer.encode(A_B).ids
    assert len(ids) == 8
    core = make_core(tokenizer, r=DetokenizeParams(stop=(" b",), min_tokens=3))
    aborts = []
    text, finish, kept = "", None, []
    for step, batch in enumerate(batches_of(ids, sizes)):
        result = core.process(token_batch([("r", batch, None)], step=step))
        aborts.extend(result.aborts)
        for out in result.outputs.values():
            text, finish = text + out.text_deltas[0], out.finish[0]
            kept.extend(from_wire(out.new_token_ids).tolist())
    assert text == "a b a"  # the " b" of token 2 is text, the one of token 4 the stop
    assert finish == Finish(FinishType.STOP, matched=" b")
    assert kept == ids[:4]
    assert aborts == [AbortRequest(rid="r", reason="stop")]


@pytest.mark.parametrize("sizes", [[1] * 17, [17], [4, 4, 4, 5], [2, 7, 8]])
def test_a_match_that_starts_inside_min_tokens_and_ends_after_is_a_stop(tokenizer, sizes):
    ids = tokenizer.encode("xx END yy END zz END ww").ids  # 'x', 'x', ' E', 'N', 'D', ...
    ends_inside = make_core(tokenizer, r=DetokenizeParams(stop=("END",), min_tokens=5))
    text, finish, kept = stream_batches(ends_inside, "r", batches_of(ids, sizes))
    assert (text, finish, kept) == ("xx END yy ", Finish(FinishType.STOP, matched="END"), ids[:10])
    ends_after = make_core(tokenizer, r=DetokenizeParams(stop=("END",), min_tokens=4))
    text, finish, kept = stream_batches(ends_after, "r", batches_of(ids, sizes))
    assert (text, finish, kept) == ("xx ", Finish(FinishType.STOP, matched="END"), ids[:5])


def test_a_request_that_ends_within_min_tokens_keeps_every_stop_string(tokenizer):
    ids = tokenizer.encode(A_B).ids
    core = make_core(tokenizer, r=DetokenizeParams(stop=(" b", "a b a b a b a b!"), min_tokens=8))
    assert stream_batches(core, "r", batches_of(ids, [3, 5])) == (A_B, LENGTH, ids)


def test_min_tokens_without_stop_strings_changes_nothing(tokenizer):
    ids = tokenizer.encode(A_B).ids
    core = make_core(tokenizer, r=DetokenizeParams(min_tokens=5))
    assert stream_batches(core, "r", batches_of(ids, [2, 6])) == (A_B, LENGTH, ids)


@pytest.mark.parametrize("seed", range(16))
def test_random_min_tokens_and_batches_match_the_reference(tokenizer, seed):
    rng = np.random.default_rng(300 + seed)
    ids = tokenizer.encode(random_text(rng, 60)).ids
    full = tokenizer.decode(ids)
    start = int(rng.integers(0, len(full) - 4))
    stop = full[start : start + int(rng.integers(1, 4))]
    min_tokens = int(rng.integers(0, len(ids)))
    sizes = rng.integers(1, 8, len(ids)).tolist()  # ragged steps, as DSpark's accepted lengths
    core = make_core(tokenizer, r=DetokenizeParams(stop=(stop,), min_tokens=min_tokens))
    text, finish, kept = stream_batches(core, "r", batches_of(ids, sizes))
    expected = min_tokens_reference(tokenizer, ids, stop, min_tokens)
    if expected is None:
        assert (text, finish, kept) == (full, LENGTH, ids)
    else:
        assert (text, finish, kept) == (expected[0], Finish(FinishType.STOP, matched=stop), ids[: expected[1]])


@pytest.mark.parametrize("sizes", [[1] * 9, [9], [2, 7], [3, 6]])
def test_a_stop_seen_behind_an_incomplete_character_within_min_tokens_is_ignored(sizes):
    tokenizer = split_char_tokenizer()
    ids = tokenizer.encode("abcé tail").ids
    assert len(ids) == 9 and tokenizer.decode(ids[:3]) == "abc\ufffd"  # "bc" is visible at token 3, before "é"
    core = make_core(tokenizer, r=DetokenizeParams(stop=("bc",), min_tokens=3))
    assert stream_batches(core, "r", batches_of(ids, sizes)) == ("abcé tail", LENGTH, ids)


def test_each_text_batch_carries_exactly_its_requests_rows_cut_where_cut(tokenizer):
    """Three requests of one token batch for two tokenizers, one stopped by a stop string: each text
    batch's columns hold its own requests' rows (output rows cut at the stop, prompt rows and the
    flat arrays as sent), the same bytes whatever goes to the other tokenizer."""
    ids = tokenizer.encode("hello world, this is a longer text to stop at STOP and more after").ids
    num_kept = first_token_completing(tokenizer, ids, "STOP")
    core = DetokenizerCore(tokenizer, "detok-1")
    for rid, owner, params in (("a", "tok-1", DetokenizeParams(stop=("STOP",))), ("b", "tok-2", DetokenizeParams()),
                               ("c", "tok-1", DetokenizeParams())):  # fmt: skip
        core.register(DetokenizerRegistration(rid=rid, tokenizer_id=owner, params=params))
    sent = [output_logprobs(len(ids), k=5, m=2, seed=1), flat_logprobs(2, rows=6, k=3), output_logprobs(3, k=1, m=0, seed=3)]
    sent[2] = RequestLogprobs(sent[2].output, RowLogprobs.of(-np.ones(4, np.float32), start=2))
    result = core.process(token_batch([("a", ids, None), ("b", ids[:2], None), ("c", ids[:3], LENGTH)], logprobs=sent))
    one, two = result.outputs["tok-1"], result.outputs["tok-2"]
    assert one.rids == ["a", "c"] and two.rids == ["b"] and [a.rid for a in result.aborts] == ["a"]
    for batch, rids in ((one, (0, 2)), (two, (1,))):
        for kind, columns in (("output", batch.output_logprobs), ("prompt", batch.prompt_logprobs), ("flat", batch.prompt_top_flat)):
            for index, got in zip(rids, from_columns(columns, len(rids)), strict=True):
                want = getattr(sent[index], kind)
                if want is not None and kind == "output" and index == 0:
                    want = want.head(num_kept)  # cut at the stop string
                assert (got is None) == (want is None), (kind, index)
                if want is not None:
                    assert got.start == want.start
                    for name in ("token", "top_values", "top_ids", "ids"):
                        if getattr(want, name) is not None:
                            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"{kind} {index} {name}")
