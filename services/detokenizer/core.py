"""The detokenizer core: token batches in, one text batch per owning tokenizer out. No NATS here.

Per request it keeps an `IncrementalDecoder` (complete UTF-8 only) and a `StopMatcher` (stop
strings across token boundaries). A stop-string match finishes the request here: its text is
trimmed, its token ids and output logprob rows after the completing token are cut, and an
`AbortRequest(reason="stop")` is returned for the adapter to broadcast so the scheduler frees
the slot. Under `min_tokens` (vLLM's meaning) the text of the first `min_tokens` output tokens
cannot end a stop string; tokens are counted one by one, so a step that delivers several (DSpark)
is judged exactly as single-token steps would be. Logprob columns pass through as the same
objects where a text batch carries the token batch's every request uncut; otherwise each request's
rows (views of the received bytes) are cut where they must be and joined again per text batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import structlog
from tokenizers import Tokenizer

from contracts.arrays import NDArray
from contracts.detokenizer import DetokenizerRegistration, Finish, FinishType, TokenBatch
from contracts.logprobs import LogprobColumns
from contracts.scheduler import AbortRequest
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire, to_wire
from services.common.logprob_rows import RowLogprobs, from_columns, to_columns
from services.detokenizer.incremental import IncrementalDecoder
from services.detokenizer.stops import StopMatcher

log = structlog.get_logger(__name__)

NUM_REMEMBERED_FINISHED = 65536  # late batches for these rids are dropped quietly


@dataclass
class _Request:
    tokenizer_id: str
    decoder: IncrementalDecoder
    stops: StopMatcher
    min_tokens: int = 0  # output tokens whose text cannot end a stop string
    num_tokens: int = 0  # output tokens decoded so far
    scheduler_id: str | None = None  # known from the first TokenBatch on

    def within_min_tokens(self) -> bool:
        """The token just decoded is one of the first `min_tokens`."""
        return self.num_tokens <= self.min_tokens


@dataclass(frozen=True)
class _Entry:
    """One request's share of one TokenBatch, after detokenization."""

    index: int  # position in the TokenBatch
    text: str
    token_ids: np.ndarray  # int32 [num_kept]
    cut: bool  # token ids (and output logprob rows) after a stop match were dropped
    finish: Finish | None
    output_rows: RowLogprobs | None  # its output logprob rows, cut as its ids


@dataclass
class DetokenizeResult:
    outputs: dict[str, TextBatch] = field(default_factory=dict)  # tokenizer_id -> its batch
    aborts: list[AbortRequest] = field(default_factory=list)  # broadcast on SCHEDULER_ABORT


class DetokenizerCore:
    def __init__(self, tokenizer: Tokenizer, instance_id: str) -> None:
        self._tokenizer = tokenizer
        self.instance_id = instance_id
        self._requests: dict[str, _Request] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    @property
    def num_running(self) -> int:
        return len(self._requests)

    def register(self, registration: DetokenizerRegistration) -> None:
        params = registration.params
        if registration.rid in self._requests:
            log.warning("detokenizer.reregistered", rid=registration.rid)
        self._finished.pop(registration.rid, None)
        self._requests[registration.rid] = _Request(
            tokenizer_id=registration.tokenizer_id,
            decoder=IncrementalDecoder(self._tokenizer, params.skip_special_tokens),
            stops=StopMatcher(params.stop, keep_stop=params.no_stop_trim),
            min_tokens=params.min_tokens,
        )

    def process(self, batch: TokenBatch) -> DetokenizeResult:
        token_ids = from_wire(batch.new_token_ids)  # int32 [T]
        offsets = np.concatenate(([0], np.cumsum(from_wire(batch.num_new_tokens))))  # [R + 1]
        outputs = from_columns(batch.output_logprobs, len(batch.rids))  # [R]: each request's rows, views
        result = DetokenizeResult()
        by_owner: dict[str, list[_Entry]] = {}
        for index, rid in enumerate(batch.rids):
            request = self._lookup(rid, batch.scheduler_id)
            if request is None:
                continue
            request.scheduler_id = batch.scheduler_id
            entry = self._advance(batch, index, token_ids[offsets[index] : offsets[index + 1]], request, outputs[index])
            by_owner.setdefault(request.tokenizer_id, []).append(entry)
            if entry.finish is not None:
                self._forget(rid)
                if batch.finish[index] is None:  # finished here, by a stop string: free the slot
                    result.aborts.append(AbortRequest(rid=rid, reason="stop"))
        for tokenizer_id, entries in by_owner.items():
            result.outputs[tokenizer_id] = self._text_batch(batch, entries)
        return result

    def forget_scheduler(self, scheduler_id: str) -> list[str]:
        """A scheduler died: its requests get no more tokens (their tokenizers fail them on the
        same heartbeat), so drop their state. Returns the dropped rids."""
        rids = self.rids_from(scheduler_id)
        for rid in rids:
            self._forget(rid)
        return rids

    def fail(self, rids: list[str], message: str) -> DetokenizeResult:
        """Finish the held requests among `rids` with ABORT and `message` (their tokens may be
        lost): one text batch per owning tokenizer tells the clients, an abort per rid frees the
        scheduler's slot. Nothing is ever presented as complete that may be short."""
        result = DetokenizeResult()
        owned: dict[str, list[str]] = {}
        for rid in rids:
            request = self._requests.get(rid)
            if request is not None:
                owned.setdefault(request.tokenizer_id, []).append(rid)
                self._forget(rid)
                result.aborts.append(AbortRequest(rid=rid, reason="abort"))
        finish = Finish(FinishType.ABORT, message=message)
        for tokenizer_id, failed in owned.items():
            result.outputs[tokenizer_id] = self._failure_batch(failed, finish)
        return result

    def rids_from(self, scheduler_id: str, batch: TokenBatch | None = None) -> list[str]:
        """The held requests `scheduler_id` serves, and those in `batch` not yet started (their
        first tokens may be what was lost)."""
        rids = [rid for rid, request in self._requests.items() if request.scheduler_id == scheduler_id]
        unstarted = [rid for rid in (batch.rids if batch else ()) if self._unstarted(rid)]
        return rids + unstarted

    def _unstarted(self, rid: str) -> bool:
        request = self._requests.get(rid)
        return request is not None and request.scheduler_id is None

    @property
    def held_rids(self) -> list[str]:
        return list(self._requests)

    def forget_unstarted(self, rid: str) -> bool:
        """An abort for a request no scheduler has sent tokens for (its claim failed, or the
        client left first): nothing will ever finish it here, so drop it now."""
        if not self._unstarted(rid):
            return False
        self._forget(rid)
        return True

    def _lookup(self, rid: str, scheduler_id: str) -> _Request | None:
        request = self._requests.get(rid)
        if request is None and rid in self._finished:
            log.debug("detokenizer.late_tokens_dropped", rid=rid, scheduler=scheduler_id)
        elif request is None:
            log.warning("detokenizer.unknown_rid_dropped", rid=rid, scheduler=scheduler_id)
        return request

    def _forget(self, rid: str) -> None:
        del self._requests[rid]
        self._finished[rid] = None
        if len(self._finished) > NUM_REMEMBERED_FINISHED:
            self._finished.popitem(last=False)

    def _advance(self, batch: TokenBatch, index: int, ids: np.ndarray, request: _Request,
                 output_rows: RowLogprobs | None) -> _Entry:  # fmt: skip
        text, num_kept, matched = _detokenize(request, ids.tolist())
        scheduler_finish = batch.finish[index]
        if matched is None and scheduler_finish is not None:
            tail = request.decoder.flush()
            if request.within_min_tokens():
                request.stops.protect(len(tail))
            tail, matched = request.stops.feed(tail)
            text += tail if matched is not None else tail + request.stops.flush()
        finish = Finish(FinishType.STOP, matched=matched) if matched is not None else scheduler_finish
        cut = num_kept < len(ids)
        if cut and output_rows is not None:
            output_rows = output_rows.head(num_kept)
        return _Entry(index, text, ids[:num_kept], cut, finish, output_rows)

    def _failure_batch(self, rids: list[str], finish: Finish) -> TextBatch:
        """No text or tokens, only the ABORT finish; its sender is this detokenizer on both ends."""
        none = to_wire(np.zeros(len(rids), dtype=np.int32))  # [R]
        return TextBatch(
            detokenizer_id=self.instance_id,
            scheduler_id=self.instance_id,
            rids=rids,
            text_deltas=[""] * len(rids),
            num_new_tokens=none,
            new_token_ids=to_wire(np.zeros(0, dtype=np.int32)),
            prompt_tokens=none,
            finish=[finish] * len(rids),
        )

    def _text_batch(self, batch: TokenBatch, entries: list[_Entry]) -> TextBatch:
        indices = [entry.index for entry in entries]
        every = len(entries) == len(batch.rids)  # the batch's every request, in order: its prompt columns as they came
        whole = every and not any(entry.cut for entry in entries)  # and uncut: its output columns too
        output = batch.output_logprobs
        if not whole and output is not None:
            output = to_columns([entry.output_rows for entry in entries])
        prompt, flat = batch.prompt_logprobs, batch.prompt_top_flat
        if not every:
            prompt, flat = _subset(prompt, indices, len(batch.rids)), _subset(flat, indices, len(batch.rids))
        return TextBatch(
            detokenizer_id=self.instance_id,
            scheduler_id=batch.scheduler_id,
            rids=[batch.rids[i] for i in indices],
            text_deltas=[entry.text for entry in entries],
            num_new_tokens=batch.num_new_tokens if whole else _counts(entries),
            new_token_ids=batch.new_token_ids if whole else _concat_ids(entries),
            prompt_tokens=batch.prompt_tokens if whole else _take(batch.prompt_tokens, indices),
            finish=[entry.finish for entry in entries],
            spec_verify_ct=batch.spec_verify_ct if whole else _take(batch.spec_verify_ct, indices),
            cached_tokens=batch.cached_tokens if whole else _take(batch.cached_tokens, indices),
            output_logprobs=output,
            prompt_logprobs=prompt,
            prompt_top_flat=flat,
            weight_version=batch.weight_version,
        )


def _detokenize(request: _Request, ids: list[int]) -> tuple[str, int, str | None]:
    """Return (text to emit, number of ids kept, matched stop string or None)."""
    if not request.stops.active:
        return request.decoder.push(ids), len(ids), None
    # One id at a time, so a match is pinned to the id that completed it.
    pieces = []
    for position, token_id in enumerate(ids):
        text, matched = request.stops.feed(_push_one(request, token_id))
        pieces.append(text)
        if matched is None and (hit := _probe_held(request)) is not None:
            pieces.append(hit[0])
            matched = hit[1]
        if matched is not None:
            return "".join(pieces), position + 1, matched
    return "".join(pieces), len(ids), None


def _push_one(request: _Request, token_id: int) -> str:
    """Decode one id. While it is one of the first `min_tokens`, every character visible so far
    (those held behind an incomplete one included) is protected from ending a stop string."""
    text = request.decoder.push((token_id,))
    request.num_tokens += 1
    if request.within_min_tokens():
        request.stops.protect(len(text) + len(request.decoder.peek()))
    return text


def _probe_held(request: _Request) -> tuple[str, str] | None:
    """A stop string may be complete in text held only behind an incomplete character."""
    held = request.decoder.peek()
    return request.stops.probe(held) if held else None


def _subset(columns: LogprobColumns | None, indices: list[int], count: int) -> LogprobColumns | None:
    """The rows of the batch's requests at `indices`, as columns of their own."""
    if columns is None:
        return None
    rows = from_columns(columns, count)
    return to_columns([rows[i] for i in indices])


def _counts(entries: list[_Entry]) -> NDArray:
    return to_wire(np.array([len(entry.token_ids) for entry in entries], dtype=np.int32))


def _concat_ids(entries: list[_Entry]) -> NDArray:
    return to_wire(np.concatenate([entry.token_ids for entry in entries]).astype(np.int32, copy=False))


def _take(array: NDArray | None, indices: list[int]) -> NDArray | None:
    return None if array is None else to_wire(from_wire(array)[indices])
