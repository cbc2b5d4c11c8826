"""The middle hop of `two_hops` in `logprob_transport`, as its own process (as the detokenizer is):
decode each message from `sparkwire.v1.bench.hop1`, touch its arrays, re-encode it and publish it
to `sparkwire.v1.bench.hop2`. Prints `ready` once subscribed; runs until stdin closes.

    python -m ops.bench.relay NATS_URL flat|nested [uvloop|asyncio]
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from contracts.logprobs import LogprobColumns
from services.common.lifecycle import run_event_loop
from services.common.transport import Transport

HOP1, HOP2 = "sparkwire.v1.bench.hop1", "sparkwire.v1.bench.hop2"


async def relay(url: str, layout: str) -> None:
    from ops.bench.logprob_transport import NestedPromptTop, _touch

    message_type = LogprobColumns if layout == "flat" else NestedPromptTop
    transport = await Transport.connect(url, "bench-relay")

    async def forward(decoded: Any, _msg: Any) -> None:
        _touch(decoded)
        await transport.publish(HOP2, decoded)

    await transport.subscribe(HOP1, message_type, forward)
    await transport.flush()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the bench closes our stdin
    await transport.close()


if __name__ == "__main__":
    run_event_loop(relay(sys.argv[1], sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "uvloop")
