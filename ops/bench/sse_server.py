"""A server that only streams: POST /generate answers with `max_new_tokens` SSE events, one every
`--interval-ms`, each with the cumulative `output_ids` (as Sparkwire's /generate sends them) and,
where the body asks for `top_logprobs_num` k, the new token's logprob and top-k entries in
`meta_info` as Sparkwire's /generate streams them (`[logprob, id, null]` triples, f32 values as
JSON doubles), and GET /health. For measuring a client's own cost (`serve_client_cost.py`).

    python -m ops.bench.sse_server --port 8123 --interval-ms 6
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import numpy as np
import uvicorn
from litestar import Litestar, get, post
from litestar.response import Stream

_encode = msgspec.json.Encoder().encode


def _logprob_fields(token: int, k: int) -> dict:
    """One new token's entries: its logprob, and k top entries (f32 values, as the scheduler sends them)."""
    values = [float(np.float32(-0.0371 - 0.6173 * j - 0.0011 * token)) for j in range(k + 1)]
    fields: dict = {"output_token_logprobs": [(values[0], token, None)]}
    if k:
        fields["output_top_logprobs"] = [[(value, 1000 + j, None) for j, value in enumerate(values[:k])]]
    return fields


def app(interval_s: float) -> Litestar:
    @post("/generate", status_code=200)
    async def generate(data: dict) -> Stream:
        num_tokens, prompt_tokens = data["sampling_params"]["max_new_tokens"], len(data.get("input_ids") or ())
        k = int(data.get("top_logprobs_num") or 0) if data.get("return_logprob") else None

        async def events():
            ids: list[int] = []
            for token in range(num_tokens):
                await asyncio.sleep(interval_s)
                ids.append(token)
                meta = {"prompt_tokens": prompt_tokens} | ({} if k is None else _logprob_fields(token, k))
                yield b"data: " + _encode({"output_ids": ids, "meta_info": meta}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return Stream(events(), media_type="text/event-stream")

    @get("/health")
    async def health() -> str:
        return "ok"

    return Litestar([generate, health])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval-ms", type=float, default=6.0)
    args = parser.parse_args()
    uvicorn.run(app(args.interval_ms / 1e3), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning")


if __name__ == "__main__":
    main()
