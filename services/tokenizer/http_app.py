"""The HTTP front end: a Litestar app over one `TokenizerService` (PRODUCT §3).

Why Litestar: it speaks msgspec natively, so request bodies are decoded straight into the
msgspec Structs of `api_types` and responses are encoded by msgspec, with no pydantic
conversion layer between the wire and our types. It is a plain ASGI app, so uvicorn serves it
in-process on the same asyncio loop as the NATS adapter, and it still gives us routing, typed
validation errors (turned into OpenAI-style 400s here) and an OpenAPI schema for free.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog

from litestar import Litestar, MediaType, Request, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.response import Response, Stream
from litestar.types import ASGIApp

from services.tokenizer import info_api, openai_api, rl_api
from services.tokenizer.edge import HttpEdge, request_id_of
from services.tokenizer.api_types import ChatBody, CompletionBody, DetokenizeBody, GenerateBody, TokenizeBody
from services.tokenizer.error_schema import ERROR_RESPONSES
from services.tokenizer.frontend import SSE_HEADERS, ClientGone, Frontend, merged_deltas, stream_then_abort
from services.tokenizer.json_body import encode_json
from services.tokenizer.native import (
    SSE_DONE,
    GenerationResult,
    error_body,
    native_event,
    native_events,
    native_response,
    sse,
)
from services.tokenizer.requests import RequestFailed
from services.tokenizer.service import ServiceUnavailable
from services.tokenizer.invalid import InvalidRequest, require
from services.tokenizer.validation import MAX_BODY_BYTES, validate_generate

log = structlog.get_logger(__name__)

MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
# The content types a browser sends cross-site without a CORS preflight: refused, so a web page
# cannot drive a server on localhost by posting "JSON" as a form or as text.
NON_JSON_MEDIA_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
WRONG_TYPE = re.compile(r"(Expected .*) - at `\$\.?([^`]*)`$")
STRICT_BODY_TYPES = {"/generate": GenerateBody, "/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody,
                     "/tokenize": TokenizeBody, "/v1/tokenize": TokenizeBody, "/detokenize": DetokenizeBody,
                     "/v1/detokenize": DetokenizeBody}  # fmt: skip


@post("/generate", status_code=200, responses=ERROR_RESPONSES, summary="Native generation API (SGLang-compatible)")
async def generate(data: GenerateBody, frontend: Frontend, request: Request) -> Response[Any] | Stream:
    plan = await frontend.prepare(
        request, validate_generate, data, frontend.model, frontend.config.max_logprobs, request_id_of(request)
    )
    pendings = await frontend.submit_all(plan.specs, plan.n)
    if data.stream:
        if plan.n == 1:
            events = native_events(pendings[0], frontend.model, GenerationResult(plan.specs[0]))
        else:
            events = _indexed_events(pendings, frontend.model, [GenerationResult(spec) for spec in plan.specs])
        return Stream(stream_then_abort(frontend, pendings, events), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await frontend.collect_all(pendings, request)
    bodies = [native_response(result, frontend.model) for result in results]
    return Response(encode_json(bodies if plan.is_list else bodies[0]), media_type=MediaType.JSON)


async def _indexed_events(pendings: list, model, results: list[GenerationResult]) -> AsyncIterator[bytes]:
    """`n` > 1 streamed as SGLang streams several outputs: one event per output's news, in arrival
    order, each the output's own event (cumulative text and ids) plus its `index` in the answer."""
    try:
        async for index, delta in merged_deltas(pendings):
            results[index].add(delta)
            yield sse(native_event(results[index], delta, model) | {"index": index})
    except RequestFailed as exc:
        yield sse(error_body(str(exc)))
    yield SSE_DONE


@get("/health", responses=ERROR_RESPONSES, summary="200 when a scheduler answers a ping and a detokenizer is alive, else 503; ?verbose: each service's state")
async def health(frontend: Frontend, request: Request) -> Response[dict[str, Any]]:
    info = await frontend.service.ping()
    alive = frontend.service.liveness()
    problem = "no scheduler answered" if info is None else None if alive["detokenizer"] else "no detokenizer is running"
    body = error_body(problem) if problem else {"status": "ok"}
    if info is not None:
        body |= {"scheduler_id": info.scheduler_id, "model": info.model_name, "num_running": info.num_running}
    if "verbose" in request.query_params:
        body["services"] = _service_states(frontend, alive, info is not None)
    return Response(body, status_code=503 if problem else 200)


def _service_states(frontend: Frontend, alive: dict[str, list[str]], scheduler_answered: bool) -> dict[str, Any]:
    """Per service kind: its live instances (heartbeats) and whether it can serve now."""
    states: dict[str, Any] = {kind: {"ok": bool(ids), "instances": ids} for kind, ids in alive.items()}
    states["scheduler"]["ok"] = scheduler_answered
    tokenizer = frontend.service.config.instance_id
    states["tokenizer"] = {"ok": frontend.service.is_connected, "instances": [tokenizer]}
    return states


@post("/flush_cache", status_code=200, responses=ERROR_RESPONSES, summary="Every scheduler forgets its prefix cache (SGLang-compatible)")
async def flush_cache(frontend: Frontend) -> dict[str, Any]:
    await frontend.service.placement.flush_caches()
    return {"status": "ok", "message": "Cache flushed."}


@post(["/tokenize", "/v1/tokenize"], status_code=200, responses=ERROR_RESPONSES,
      summary="A prompt, or chat messages rendered with the model's chat template, to token ids (vLLM-compatible)")  # fmt: skip
async def tokenize(data: TokenizeBody, frontend: Frontend, request: Request) -> dict[str, Any]:
    openai_api.check_model(data.model, frontend)
    tokens = await frontend.prepare(request, openai_api.tokenize_ids, data, frontend.model)
    body: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": frontend.model.max_model_len}
    if data.return_token_strs:
        body["token_strs"] = [frontend.model.tokenizer.id_to_token(token) for token in tokens]
    return body


@post(["/detokenize", "/v1/detokenize"], status_code=200, responses=ERROR_RESPONSES,
      summary="Token ids to text (vLLM-compatible)")  # fmt: skip
async def detokenize(data: DetokenizeBody, frontend: Frontend) -> dict[str, Any]:
    openai_api.check_model(data.model, frontend)
    bad = frontend.model.out_of_vocab(data.tokens)
    require(bad is None, f"token id {bad} is outside the vocabulary [0, {frontend.model.vocab_size})", "tokens")
    return {"prompt": frontend.model.decode(data.tokens, skip_special_tokens=False)}


@get("/v1/models", responses=ERROR_RESPONSES, summary="The served model")
async def models(frontend: Frontend) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(frontend)]}


@get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES, summary="The served model by its name; another name is a 404")
async def model(model_id: str, frontend: Frontend) -> dict[str, Any]:
    openai_api.check_model(model_id.removeprefix("/"), frontend)  # a path parameter keeps its leading "/"
    return _model_card(frontend)


def _model_card(frontend: Frontend) -> dict[str, Any]:
    return {
        "id": frontend.config.model_name,
        "object": "model",
        "created": frontend.created,
        "owned_by": "sparkwire",
        "root": str(frontend.config.model_dir),
        "max_model_len": frontend.model.max_model_len,
    }


@get("/metrics", media_type=MediaType.TEXT, include_in_schema=False)
async def metrics(frontend: Frontend) -> Response[bytes]:
    return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> dict[str, Any]:
    return request.app.openapi_schema.to_schema()


def _error(status: int, message: str, kind: str, param: str | None = None) -> Response[dict[str, Any]]:
    return Response(error_body(message, kind, None if status == 400 else status, param), status_code=status)


def _on_invalid(_request: Request, exc: InvalidRequest) -> Response[dict[str, Any]]:
    return _error(400, f"{exc.param}: {exc.message}" if exc.param else exc.message, "invalid_request_error", exc.param)


def _on_validation(_request: Request, exc: ValidationException) -> Response[dict[str, Any]]:
    """msgspec's decode errors carry the field path (`sampling_params.temperature`)."""
    extra = exc.extra[0] if isinstance(exc.extra, list) and exc.extra and isinstance(exc.extra[0], dict) else {}
    message = str(extra.get("message", exc.detail))
    key = extra.get("key")
    parent = None if key in (None, "data") else str(key)
    if key == "data" and message == "'data'":  # Litestar's words for "there was no body"
        return _error(400, "the request body is empty; send a JSON object", "invalid_request_error")
    missing = MISSING_FIELD.search(message)
    param = ".".join(filter(None, [parent, missing.group(1)])) if missing else parent
    return _error(400, f"{param}: {message}" if param else str(message), "invalid_request_error", param)


def _on_http(_request: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error(exc.status_code, exc.detail, kind)


async def _json_bodies_only(request: Request) -> Response[dict[str, Any]] | None:
    if request.method != "POST":
        return None
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type in NON_JSON_MEDIA_TYPES:
        return _error(415, f"a {media_type} body is not accepted; send JSON with content-type: application/json",
                      "invalid_request_error")  # fmt: skip
    body_type = STRICT_BODY_TYPES.get(request.url.path)
    return await _strict_types(request, body_type) if body_type is not None else None


async def _strict_types(request: Request, body_type: type) -> Response[dict[str, Any]] | None:
    """Litestar converts bodies leniently ("10" for an int, 1.0 for `n`); a client that sends the
    wrong JSON type gets a 400 naming the field instead of a silently converted value. Other
    problems (missing fields, malformed JSON) are left to Litestar's own decoding and messages."""
    try:
        msgspec.json.decode(await request.body(), type=body_type)
    except msgspec.ValidationError as exc:
        wrong = WRONG_TYPE.match(str(exc))
        if wrong is not None:
            return _error(400, f"{wrong[2]}: {wrong[1]}", "invalid_request_error", wrong[2])
    except (msgspec.DecodeError, RecursionError):
        pass
    return None


def _on_too_deep(_request: Request, _exc: RecursionError) -> Response[dict[str, Any]]:
    """The JSON decoder gives up on bodies nested thousands deep (no API field nests so)."""
    return _error(400, "the request body is nested too deeply", "invalid_request_error")


def _on_unavailable(_request: Request, exc: Exception) -> Response[dict[str, Any]]:
    return _error(503, str(exc), "service_unavailable")


def _on_model_not_found(_request: Request, exc: openai_api.ModelNotFound) -> Response[dict[str, Any]]:
    body = error_body(str(exc), "invalid_request_error", None, "model")
    body["error"]["code"] = "model_not_found"  # OpenAI's code for it
    return Response(body, status_code=404)


def _on_client_gone(_request: Request, _exc: ClientGone) -> Response[dict[str, Any]]:
    return _error(499, "client disconnected", "client_closed_request")


def _on_unexpected(_request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """A bug, not bad input: logged with its traceback (and the request id, bound by the edge),
    answered in the same error shape as every other error."""
    log.error("http.unexpected_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return _error(500, "internal server error; the server log has the details under this request's id", "internal_error")


ROUTE_HANDLERS = [generate, health, flush_cache, tokenize, detokenize, models, model, metrics, openapi_json, *openai_api.ROUTES,
                  *info_api.ROUTES, *rl_api.ROUTES]  # fmt: skip


def create_app(frontend: Frontend | None) -> Litestar:
    """The routes over `frontend`; None: an app for its OpenAPI schema alone (docs/api-parameters.md)."""
    return Litestar(
        route_handlers=ROUTE_HANDLERS,
        dependencies={"frontend": Provide(lambda: frontend, sync_to_thread=False)},
        exception_handlers={
            InvalidRequest: _on_invalid,
            ValidationException: _on_validation,
            HTTPException: _on_http,
            ServiceUnavailable: _on_unavailable,
            RequestFailed: _on_unavailable,
            ClientGone: _on_client_gone,
            RecursionError: _on_too_deep,
            openai_api.ModelNotFound: _on_model_not_found,
            Exception: _on_unexpected,
        },
        request_max_body_size=MAX_BODY_BYTES,
        before_request=_json_bodies_only,
        openapi_config=OpenAPIConfig(title="Sparkwire", version=info_api.package_version(), path="/schema"),
        state=State({"frontend": frontend}),
        logging_config=None,  # Litestar's default would replace the process's handlers (ours: JSON, redaction)
    )


def create_asgi(frontend: Frontend) -> ASGIApp:
    """The app as uvicorn serves it: Litestar inside the edge (request id, API key, HTTP metrics)."""
    app = create_app(frontend)
    paths = {path for handler in ROUTE_HANDLERS for path in handler.paths}
    config = frontend.config
    return HttpEdge(app, frontend.metrics, paths, config.api_key, config.metrics_require_api_key)
