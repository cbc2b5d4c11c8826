"""A server that only streams: POST /generate answers with `max_new_tokens` SSE events, one every
`--interval-ms`, each with the cumulative `output_ids` (as Sparkwire's /generate sends them), and
GET /health. For measuring a client's own cost (`serve_client_cost.py`).

    python -m ops.bench.sse_server --port 8123 --interval-ms 6
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import uvicorn
from litestar import Litestar, get, post
from litestar.response import Stream

_encode = msgspec.json.Encoder().encode


def app(interval_s: float) -> Litestar:
    @post("/generate", status_code=200)
    async def generate(data: dict) -> Stream:
        num_tokens, prompt_tokens = data["sampling_params"]["max_new_tokens"], len(data.get("input_ids") or ())

        async def events():
            ids: list[int] = []
            for token in range(num_tokens):
                await asyncio.sleep(interval_s)
                ids.append(token)
                yield b"data: " + _encode({"output_ids": ids, "meta_info": {"prompt_tokens": prompt_tokens}}) + b"\n\n"
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
