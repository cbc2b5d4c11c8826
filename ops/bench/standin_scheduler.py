"""A stand-in scheduler that emits large flat prompt-logprob payloads without running a model.

It answers claims and pings like a scheduler, beats like one, and for each `GenerateRequest`
publishes one finished output whose prompt top logprobs are seeded random float32/int32
`[num_prompt - 1, k]` arrays, built and sent by the scheduler's own message code
(`scheduler_harness.token_batches`). Used to measure and test the detokenizer ->
tokenizer path with payloads no CPU model could produce quickly (131072 x 20 = 21 MB).
The seed of a request's arrays is its first prompt token id, so a client can recompute them.
"""

from __future__ import annotations

import numpy as np

from contracts import subjects
from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import GenerateRequest, SchedulerClaim, SchedulerClaimReply, SchedulerInfo, SchedulerPing
from services.common.arrays import from_wire
from services.common.heartbeat import HeartbeatPublisher
from services.common.nats_reader import Delivery
from services.common.transport import Transport
from ops.bench.scheduler_harness import StandInOutput, token_batches

NULL_PREFIX = 1


def seeded_top_logprobs(seed: int, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = -np.sort(rng.exponential(2.0, (rows, k)).astype(np.float32), axis=1)  # [rows, k]
    ids = rng.integers(0, 2048, (rows, k), dtype=np.int32)  # [rows, k]
    return values, ids


class StandInScheduler:
    def __init__(self, transport: Transport, max_model_len: int, instance_id: str = "standin-scheduler") -> None:
        self.transport = transport
        self.instance_id = instance_id
        self.max_model_len = max_model_len
        self.heartbeat = HeartbeatPublisher(transport, "scheduler", instance_id, 0.5)
        # Drawing 131072 x 20 sorted random values takes ~150 ms: do it once per (seed, shape) so
        # a benchmark times the transport, not the stand-in's random number generator.
        self._arrays: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    async def start(self) -> None:
        t = self.transport
        await t.subscribe(subjects.SCHEDULER_CLAIM, SchedulerClaim, self._on_claim, queue=subjects.SCHEDULER_QUEUE)
        await t.subscribe(subjects.SCHEDULER_PING, SchedulerPing, self._on_ping, queue=subjects.SCHEDULER_QUEUE)
        await t.subscribe(subjects.scheduler_generate(self.instance_id), GenerateRequest, self._on_generate)
        self.heartbeat.start()

    async def stop(self) -> None:
        await self.heartbeat.stop("stand-in stopped")

    async def _on_claim(self, _claim: SchedulerClaim, msg: Delivery) -> None:
        await self.transport.respond(msg, SchedulerClaimReply(self.instance_id))

    async def _on_ping(self, _ping: SchedulerPing, msg: Delivery) -> None:
        await self.transport.respond(msg, SchedulerInfo(self.instance_id, "standin", self.max_model_len, 2048))

    async def _on_generate(self, request: GenerateRequest, _msg: Delivery) -> None:
        output = StandInOutput(request.rid, request.detokenizer_id, [7], request.input_ids.shape[0], Finish(FinishType.LENGTH))
        if request.logprobs.return_logprob:
            self._add_logprobs(output, request)
        for detokenizer_id, batch in token_batches([output], self.instance_id, 0).items():
            await self.transport.publish(subjects.detokenizer_tokens(detokenizer_id), batch)

    def _add_logprobs(self, output: StandInOutput, request: GenerateRequest) -> None:
        prompt = from_wire(request.input_ids)  # int32 [P]
        token_logprobs = np.full(len(prompt), -1.5, np.float32)  # [P]
        token_logprobs[:NULL_PREFIX] = np.nan
        output.output_logprobs, output.prompt_token_logprobs = np.array([-0.5], np.float32), token_logprobs
        params = request.logprobs
        if params.flat_prompt_top_logprobs and params.top_logprobs_num:
            key = (int(prompt[0]), len(prompt) - NULL_PREFIX, params.top_logprobs_num)
            if key not in self._arrays:
                self._arrays[key] = seeded_top_logprobs(*key)
            output.prompt_top_flat = (*self._arrays[key], NULL_PREFIX)
