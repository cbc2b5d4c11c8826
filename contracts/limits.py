"""Bounds on every field that crosses NATS, as constrained types the decoders enforce.

A message outside them fails to decode (`msgspec.ValidationError`); the receiving subscription
logs it with its subject and drops it, so nothing from the wire reaches a service's state
unchecked. The HTTP front end checks client input against the same numbers (`MAX_*`), so a
request it accepts always fits the wire.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_INSTANCE_ID_CHARS = 64
MAX_RID_CHARS = 512  # server-side request ids; a client's own `rid` label is at most MAX_CLIENT_RID_CHARS
MAX_CLIENT_RID_CHARS = 256
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_IDS_LOGPROB = 256
MAX_TOP_LOGPROBS = 4096  # the wire's bound; a tokenizer's --max-logprobs is the user-facing one
MAX_TOKENS = 2**31 - 1  # token counts and positions: int32 on the wire and in the scheduler
MAX_REASON_CHARS = 4096
MAX_ARRAY_DIMS = 4
MAX_TEMPERATURE = 1e6
MAX_GRAMMAR_CHARS = 256 * 1024  # a JSON schema, regex or EBNF grammar's text
MAX_FORKED_CHOICES = 127  # the other choices of one n > 1 request (the tokenizer's fan-out limit, less one)

# An instance id becomes one token of a subject (`sparkwire.v2.detokenizer.<id>.tokens`): no dots,
# wildcards or whitespace, which would make a publish fail or reach other subscribers.
InstanceId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", min_length=1, max_length=MAX_INSTANCE_ID_CHARS)]
Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_RID_CHARS)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
# int64: what msgspec can bound, inside torch.Generator.manual_seed's range and MessagePack's.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]  # also rejects NaN
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
