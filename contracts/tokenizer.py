"""Messages the tokenizer (HTTP front end) receives: text batches from detokenizers."""

from __future__ import annotations

from typing import Annotated

import msgspec

from contracts.arrays import NDArray
from contracts.detokenizer import Finish, check_columns, check_logprobs
from contracts.logprobs import LogprobColumns
from contracts.limits import InstanceId, Rid


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
    weight_version: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # as in `TokenBatch`

    def __post_init__(self) -> None:
        if len(self.text_deltas) != len(self.rids):
            raise ValueError(f"text_deltas must have {len(self.rids)} entries")
        counts = check_columns(self.rids, self.num_new_tokens, self.new_token_ids, self.prompt_tokens, self.finish,
                               self.spec_verify_ct)  # fmt: skip
        check_logprobs(counts, self.output_logprobs, self.prompt_logprobs, self.prompt_top_flat)
