"""Structured output: each request's grammar as an xgrammar matcher, and a token bitmask per verify row.

A request's `Grammar` (contracts) is compiled once (cached by its value) against the model's
tokenizer; its sequence gets a `GrammarMatcher` that follows the committed output tokens. For a
verify block of k drafts, row j must be masked by the grammar's state after drafts 1..j, so the
matcher accepts the drafts one by one, filling row j's bitmask before draft j + 1, then rolls them
back (`GrammarMatcher.rollback`): the committed tokens the next step brings (accepted drafts and
the bonus token) are the only ones it keeps. A draft the grammar refuses ends the walk: its row's
mask already gives it -inf, so the accept rule rejects it, and the rows after it (never read) allow
everything. Once the grammar is complete only the stop tokens are allowed.

Bitmasks are int32 [rows, ceil(V / 32)], bit t % 32 of word t // 32 set where token t is allowed
(xgrammar's layout), filled on the host while the device runs the step's forward;
`logits_processing.apply_token_bitmask` applies them to the logits before the draw.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from contracts.scheduler import Grammar
from services.common.grammars import compile_failure, xgrammar_of

log = structlog.get_logger(__name__)
# xgrammar (and the transformers tokenizer it reads) is imported on the first grammar: seconds of
# start-up that a server never asked for structured output does not pay.

MAX_COMPILED = 256  # distinct grammars kept compiled (a tool list or schema is usually reused)
ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(frozen=True)
class GrammarBlock:
    """One producing sequence's rows, as `GrammarMatchers.bitmask` reads them."""

    rid: str
    grammar: Grammar
    tokens: Sequence[int]  # prompt + committed outputs (+ anything after: never read), not copied
    num_prompt: int
    num_outputs: int  # committed outputs before the block's first row
    drafts: Sequence[int]  # row j has seen drafts 1..j too


@dataclass(frozen=True)
class GrammarRows:
    masks: torch.Tensor  # int32 [R, num_words] on the host
    rows: torch.Tensor | None  # int64 [R] on the host: the logits rows they mask; None: every row, in order


class _Kept:
    """A sequence's matcher and how many of its committed outputs it has accepted."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.broken = False  # a committed token the grammar refused (never expected): unconstrained from then on


class GrammarMatchers:
    """Compiled grammars (by value) and each constrained sequence's matcher (by rid, until `release`)."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._compiler = None  # built on the first grammar: most servers never see one
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()  # the service thread compiles (`error`) while the step thread fills
        self._kept: dict[str, _Kept] = {}

    @property
    def num_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def error(self, grammar: Grammar | None) -> str | None:
        """Why `grammar` cannot constrain a request here (a message for the client); None when it can.
        Compiles it, so the step that first needs it finds it compiled."""
        if grammar is None:
            return None
        try:
            self.compiled(grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses for bad grammars
            return f"the {grammar.kind.name.lower()} grammar {compile_failure(exc)}"
        return None

    def compiled(self, grammar: Grammar):
        with self._lock:
            found = self._compiled.get(grammar)
            if found is not None:
                self._compiled.move_to_end(grammar)
                return found
            compiler = self._compiler_of()
        compiled = compiler.compile_grammar(xgrammar_of(grammar))  # unlocked: a long compile never holds up a step's cache hit
        with self._lock:
            self._compiled[grammar] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def release(self, rid: str) -> None:
        self._kept.pop(rid, None)

    def bitmask(self, blocks: Sequence[GrammarBlock | None], width: int, pin: bool = False) -> GrammarRows | None:
        """The bitmasks of the `width` rows of every block with a grammar (None: a sequence without
        one, its rows left alone); None when no block has a grammar. pin: in pinned memory, so that
        their copy to a GPU does not wait for the queued forward."""
        constrained = [b for b, block in enumerate(blocks) if block is not None]
        if not constrained:
            return None
        masks = torch.full((len(constrained) * width, self.num_words), ALL_ALLOWED, dtype=torch.int32, pin_memory=pin)
        for i, b in enumerate(constrained):
            self._fill_block(blocks[b], masks, i * width, width)
        if len(constrained) == len(blocks):
            return GrammarRows(masks, None)
        rows = torch.tensor([b * width + j for b in constrained for j in range(width)], dtype=torch.int64)
        return GrammarRows(masks, rows.pin_memory() if pin else rows)

    def _fill_block(self, block: GrammarBlock, masks: torch.Tensor, first: int, width: int) -> None:
        kept = self._caught_up(block)
        if kept.broken:
            return
        matcher, num_walked = kept.matcher, 0
        for j in range(width):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(masks, first + j)
            if j >= len(block.drafts) or not matcher.accept_token(block.drafts[j]):
                break
            num_walked += 1
        if num_walked:
            matcher.rollback(num_walked)

    def _caught_up(self, block: GrammarBlock) -> _Kept:
        kept = self._kept.get(block.rid)
        if kept is None:
            import xgrammar

            kept = self._kept[block.rid] = _Kept(xgrammar.GrammarMatcher(self.compiled(block.grammar)))
        first = block.num_prompt
        for token in block.tokens[first + kept.num_accepted : first + block.num_outputs]:
            if not kept.broken and not kept.matcher.accept_token(token):
                log.warning("grammar.token_refused", rid=block.rid, token=token)
                kept.broken = True
            kept.num_accepted += 1
        return kept

    def _compiler_of(self):
        if self._compiler is None:
            self._compiler = _compiler(self._tokenizer_dir, self.vocab_size, self._eos_ids)
        return self._compiler


def _compiler(tokenizer_dir: str | None, vocab_size: int, eos_ids: list[int]):
    path = Path(tokenizer_dir or "") / "tokenizer.json"
    if tokenizer_dir is None or not path.is_file():
        raise ValueError(f"structured output needs the model's tokenizer.json (none at {path})")
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
    return xgrammar.GrammarCompiler(info, max_threads=1)
