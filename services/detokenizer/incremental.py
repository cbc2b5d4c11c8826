"""Incremental detokenization of one request that never emits a broken UTF-8 character.

The prefix/read-offset window method (as in HF `TextStreamer` and vLLM): decode a window of ids
that starts one emitted chunk back, so decoders that depend on context (leading-space stripping,
byte-level merges) see the same neighbourhood as a full decode would, and emit only what the
window adds beyond that previous chunk. A window whose text ends in U+FFFD is an incomplete
character (or bytes that only later turn out invalid): hold it until more ids arrive or the
request finishes.

Invariant: the concatenation of every `push` and the final `flush` equals
`tokenizer.decode(all_ids)` for byte-level tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window: ids[:read_offset] are the previously emitted chunk, the rest not emitted yet.
        self._ids: list[int] = []
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[:read_offset])
        self._held_text = ""  # complete characters decoded but held behind an incomplete one

    def push(self, ids: Sequence[int]) -> str:
        """Append ids; return the text that is now safe to emit (possibly "")."""
        self._ids.extend(ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            self._held_text = text.rstrip(REPLACEMENT)[len(self._prefix_text) :]
            return ""
        return self._emit(text)

    def peek(self) -> str:
        """Complete characters held back only because an incomplete one follows them. A stop
        string may already be complete in them: the request ends at this id, not the next."""
        return self._held_text

    def flush(self) -> str:
        """The request is finished: emit whatever is held, invalid bytes included (as U+FFFD)."""
        return self._emit(self._decode(self._ids))

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # The chunk just emitted becomes the next window's prefix; older ids are never needed again.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._held_text = ""
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
