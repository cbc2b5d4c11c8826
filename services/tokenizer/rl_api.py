"""The RL endpoints (SGLang's shapes): new weights, pauses and memory release on every scheduler.

Each is one `Control` (contracts/weights.py) sent to every live scheduler at once; the answer
comes when all have answered and lists each (`schedulers`). A refusal by any (new weights of
another shape, a missing file) is a 400 with its reason; the refusing schedulers keep their old
state. No scheduler alive, or one that does not answer: 503.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import post
from litestar.response import Response

from contracts.weights import (
    Control,
    ContinueGeneration,
    ControlReply,
    PauseGeneration,
    ReleaseMemory,
    ResumeMemory,
    Path,
    UpdateFromDisk,
    WeightTarget,
    WeightVersion,
)
from services.tokenizer.api_types import doc
from services.tokenizer.error_schema import ERROR_RESPONSES
from services.tokenizer.frontend import Frontend
from services.tokenizer.native import error_body

CONTROL_TIMEOUT_S = 600.0  # an 8B checkpoint read from a slow disk, behind requests finishing first
TARGETS = {"model": WeightTarget.MODEL, "draft": WeightTarget.DRAFT}


class UpdateWeightsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: Annotated[Path, doc("A directory of *.safetensors (or one file) with the served model's names and shapes")]
    load_format: Literal["auto", "safetensors"] = "auto"
    weight_version: Annotated[WeightVersion | None, doc("Tags every answer from the new weights; default: a counter")] = None
    abort_all_requests: Annotated[bool, doc("End requests in flight (finish reason abort) instead of letting them finish on the old weights")] = False
    target: Annotated[Literal["model", "draft"], doc("The target model or the DSpark drafter")] = "model"


class PauseBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Annotated[Literal["abort", "in_place"], doc("abort: end requests in flight; in_place: hold them until continue")] = "abort"


class ReleaseBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tags: Annotated[list[Literal["kv_cache", "weights"]] | None, doc("What to free; default both")] = None


async def _send(frontend: Frontend, message: Control) -> Response[dict[str, Any]]:
    replies = await frontend.service.control(message, CONTROL_TIMEOUT_S)
    if not replies:
        return Response(error_body("no scheduler is alive"), status_code=503)
    schedulers = [_entry(scheduler_id, reply) for scheduler_id, reply in replies.items()]
    failed = [entry for entry in schedulers if not entry["success"]]
    versions = sorted({entry["weight_version"] for entry in schedulers if entry["success"]})
    body = {"success": not failed, "message": failed[0]["message"] if failed else "ok", "schedulers": schedulers,
            "weight_version": versions[0] if len(versions) == 1 else None}  # fmt: skip
    if not failed:
        return Response(body, status_code=200)
    silent = any(isinstance(reply, str) for reply in replies.values())  # a scheduler gone or stuck: not the caller's fault
    body |= error_body(failed[0]["message"], *(("service_unavailable", 503) if silent else ("invalid_request_error", None)))
    return Response(body, status_code=503 if silent else 400)


def _entry(scheduler_id: str, reply: ControlReply | str) -> dict[str, Any]:
    if isinstance(reply, str):
        return {"scheduler_id": scheduler_id, "success": False, "message": reply, "weight_version": None}
    fields = {"weight_version": reply.weight_version, "num_aborted": reply.num_aborted, "seconds": reply.seconds,
              "freed_bytes": reply.freed_bytes}  # fmt: skip
    return {"scheduler_id": scheduler_id, "success": reply.ok, "message": reply.error or "ok", **fields}


@post("/update_weights_from_disk", status_code=200, responses=ERROR_RESPONSES,
      summary="Every scheduler loads new weights of the same shapes and swaps them between two steps (SGLang's shape)")  # fmt: skip
async def update_weights_from_disk(data: UpdateWeightsBody, frontend: Frontend) -> Response[dict[str, Any]]:
    message = UpdateFromDisk(data.model_path, data.load_format, data.weight_version, data.abort_all_requests,
                             TARGETS[data.target])  # fmt: skip
    return await _send(frontend, message)


@post("/pause_generation", status_code=200, responses=ERROR_RESPONSES, summary="Stop stepping: requests in flight end or wait")
async def pause_generation(frontend: Frontend, data: PauseBody | None = None) -> Response[dict[str, Any]]:
    return await _send(frontend, PauseGeneration(abort=(data or PauseBody()).mode == "abort"))


@post("/continue_generation", status_code=200, responses=ERROR_RESPONSES, summary="Step again after pause_generation")
async def continue_generation(frontend: Frontend) -> Response[dict[str, Any]]:
    return await _send(frontend, ContinueGeneration())


@post("/release_memory_occupation", status_code=200, responses=ERROR_RESPONSES,
      summary="Free the KV cache (and the weights' GPU memory) while idle; requests wait until resume")  # fmt: skip
async def release_memory_occupation(frontend: Frontend, data: ReleaseBody | None = None) -> Response[dict[str, Any]]:
    tags = (data or ReleaseBody()).tags
    return await _send(frontend, ReleaseMemory(weights=tags is None or "weights" in tags))


@post("/resume_memory_occupation", status_code=200, responses=ERROR_RESPONSES, summary="Give back what release freed")
async def resume_memory_occupation(frontend: Frontend) -> Response[dict[str, Any]]:
    return await _send(frontend, ResumeMemory())


ROUTES = [update_weights_from_disk, pause_generation, continue_generation, release_memory_occupation, resume_memory_occupation]
