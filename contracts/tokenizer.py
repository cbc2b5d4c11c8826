"""Messages the tokenizer (HTTP front end) receives: text batches from detokenizers."""

from __future__ import annotations

from typing import Annotated

import msgspec

from contracts.arrays import NDArray
from contracts.detokenizer import Finish, check_columns, check_logprobs
from contracts.logprobs import LogprobColumns
from contracts.limits import Count, InstanceId, Rid

MAX_SUMMARY_HASHES = 1 << 16  # a summary's most recent cached blocks: 256 KiB, under one NATS payload


class TextBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Per-step output for the requests one tokenizer replica owns, columnar over R requests.

    Same ragged layout as `TokenBatch`. Token ids and logprob entries after a matched stop
    string are already cut; `text_deltas[i]` never ends inside a UTF-8 character and never
    holds a prefix of a stop string that may still complete.
    """

    detokenizer_id: InstanceId
    scheduler_id: InstanceId
    rids: list[Rid]  # [R]
    text_deltas: list[str]  # [R]
    num_new_tokens: NDArray  # i32 [R]
    new_token_ids: NDArray  # i32 [sum(num_new_tokens)]
    prompt_tokens: NDArray  # i32 [R]
    finish: list[Finish | None]  # [R]
    spec_verify_ct: NDArray | None = None  # i32 [R]
    # as in `TokenBatch`; output rows after a stop match cut too
    output_logprobs: LogprobColumns | None = None
    prompt_logprobs: LogprobColumns | None = None
    prompt_top_flat: LogprobColumns | None = None
    cached_tokens: NDArray | None = None  # i32 [R], prompt tokens found in KV (prefix cache); absent: none
    weight_version: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # as in `TokenBatch`

    def __post_init__(self) -> None:
        if len(self.text_deltas) != len(self.rids):
            raise ValueError(f"text_deltas must have {len(self.rids)} entries")
        counts = check_columns(self.rids, self.num_new_tokens, self.new_token_ids, self.prompt_tokens, self.finish,
                               self.spec_verify_ct)  # fmt: skip
        check_logprobs(counts, self.output_logprobs, self.prompt_logprobs, self.prompt_top_flat)
        if self.cached_tokens is not None and not self.cached_tokens.is_vector("<i4", len(self.rids)):
            raise ValueError(f"cached_tokens must be an int32 vector of {len(self.rids)} entries")


class PrefixSummary(msgspec.Struct, frozen=True, gc=False):
    """What one scheduler caches, for cache-aware placement (broadcast every fraction of a second):
    the low 32 bits of its cached blocks' hashes (`services/common/block_hash.py`, chained from
    `salt` over `block_size`-token blocks; a collision only misplaces a request), newest last, and
    its load."""

    scheduler_id: InstanceId
    salt: int
    block_size: Count
    hashes: NDArray  # u4 [H], H <= MAX_SUMMARY_HASHES
    num_held: Count  # requests running, waiting or claimed
    max_running: Count

    def __post_init__(self) -> None:
        if not self.hashes.is_vector("<u4") or self.hashes.shape[0] > MAX_SUMMARY_HASHES or self.block_size < 1:
            raise ValueError(f"hashes must be a u4 vector of at most {MAX_SUMMARY_HASHES} entries, block_size >= 1")
