"""A stand-in scheduler that decodes at a set pace, without a model: every step (`--step-ms`) each
running request gets one token, and the output logprob rows it asked for (top-k values and ids,
token logprob), published through the scheduler's own message code (`scheduler_harness.token_batches`), as
the real one publishes a decode step. So the front half (detokenizer, tokenizers) can be loaded
on a machine without a GPU at the token rate a GPU decodes (64 requests every 2 ms: 32,000
tokens/s), which no CPU model reaches (`frontend_capacity.py` runs it).

It answers claims and pings and beats as `StandInScheduler` does (which it extends); a step that
runs late is not made up (the next starts at once), as a busy GPU would do. It runs until its
standard input closes. Token ids cycle
through the ids below `--vocab-size`; logprob values are fixed rows (their cost to carry and
format does not depend on their values).

    python ops/bench/paced_scheduler.py NATS_URL --step-ms 2 --vocab-size 4096
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from contracts import subjects
from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import AbortRequest, GenerateRequest
from ops.bench.scheduler_harness import StandInOutput, token_batches
from ops.bench.standin_scheduler import StandInScheduler
from services.common.lifecycle import run_event_loop
from services.common.nats_reader import Delivery
from services.common.transport import Transport

MAX_TOP = 20  # the widest top-k row kept ready (the tokenizer's default --max-logprobs)


class Running:
    """One request being decoded: what it asked for and how far it got."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.emitted = 0

    @property
    def done(self) -> bool:
        return self.emitted >= self.request.sampling.max_new_tokens


class PacedScheduler(StandInScheduler):
    def __init__(self, transport: Transport, step_s: float, vocab_size: int, max_model_len: int = 32768) -> None:
        super().__init__(transport, max_model_len, "paced-scheduler")
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.running: dict[str, Running] = {}
        self.num_steps = 0
        self._task: asyncio.Task | None = None
        self._top_values = -np.sort(np.random.default_rng(0).exponential(2.0, MAX_TOP)).astype(np.float32)[None, :]  # [1, 20]
        self._top_ids = np.arange(3, 3 + MAX_TOP, dtype=np.int32)[None, :]  # [1, 20]

    async def start(self) -> None:
        await super().start()
        await self.transport.subscribe(subjects.SCHEDULER_ABORT, AbortRequest, self._on_abort)
        self._task = asyncio.create_task(self._decode_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await super().stop()

    async def _on_generate(self, request: GenerateRequest, _msg: Delivery) -> None:
        self.running[request.rid] = Running(request)

    async def _on_abort(self, abort: AbortRequest, _msg: Delivery) -> None:
        self.running.pop(abort.rid, None)

    async def _decode_loop(self) -> None:
        next_step = time.perf_counter()
        while True:
            next_step = max(next_step + self.step_s, time.perf_counter())
            await asyncio.sleep(next_step - time.perf_counter())
            if self.running:
                await self._step()

    async def _step(self) -> None:
        outputs = [self._output(running) for running in self.running.values()]
        self.running = {rid: r for rid, r in self.running.items() if not r.done}
        for detokenizer_id, batch in token_batches(outputs, self.instance_id, self.num_steps).items():
            await self.transport.publish(subjects.detokenizer_tokens(detokenizer_id), batch)
        self.num_steps += 1

    def _output(self, running: Running) -> StandInOutput:
        request = running.request
        token = (request.input_ids.shape[0] + running.emitted * 31) % self.vocab_size
        running.emitted += 1
        finish = Finish(FinishType.LENGTH) if running.done else None
        output = StandInOutput(request.rid, request.detokenizer_id, [token], request.input_ids.shape[0], finish)
        params = request.logprobs
        if params.return_logprob:
            output.output_logprobs = self._top_values[0, :1]  # f32 [1]
            k = params.top_logprobs_num
            output.output_top = (self._top_values[:, :k], self._top_ids[:, :k]) if k else None  # [1, k]
        return output


async def serve(url: str, step_s: float, vocab_size: int) -> None:
    transport = await Transport.connect(url, "paced-scheduler")
    scheduler = PacedScheduler(transport, step_s, vocab_size)
    await scheduler.start()
    await transport.flush()
    print("ready", flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)  # until the benchmark closes our stdin
    finally:
        await scheduler.stop()
        await transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nats_url")
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--vocab-size", type=int, default=4096, help="token ids below this (the served tokenizer's vocabulary)")
    args = parser.parse_args()
    run_event_loop(serve(args.nats_url, args.step_ms / 1e3, args.vocab_size))


if __name__ == "__main__":
    main()
