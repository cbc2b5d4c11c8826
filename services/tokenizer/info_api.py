"""What scripts ask a server about itself, in SGLang's shapes as far as they apply here:
`/version`, `/get_model_info`, `/get_server_info`."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

import msgspec
from litestar import get

from services.tokenizer.error_schema import ERROR_RESPONSES
from services.tokenizer.frontend import Frontend

PACKAGE = "sparkwire"


@functools.cache
def package_version() -> str:
    """The installed package's version (pyproject.toml's, through the install's metadata)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@get("/version", responses=ERROR_RESPONSES, summary="The server's version (SGLang's shape)")
async def version() -> dict[str, str]:
    return {"version": package_version()}


@get("/get_model_info", responses=ERROR_RESPONSES, summary="The served model (SGLang's shape)")
async def get_model_info(frontend: Frontend) -> dict[str, Any]:
    model, path = frontend.model, str(frontend.config.model_dir)
    scheduler = await frontend.service.ping()
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": frontend.config.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": None if scheduler is None else scheduler.weight_version,  # a scheduler's (RL updates)
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
        "max_model_len": model.max_model_len,
    }


@get("/get_server_info", responses=ERROR_RESPONSES,
     summary="This front end's settings, the live services and the state of a scheduler that answers (SGLang's shape)")  # fmt: skip
async def get_server_info(frontend: Frontend) -> dict[str, Any]:
    config, model = frontend.config, frontend.model
    scheduler = await frontend.service.ping()
    alive = frontend.service.liveness() | {"tokenizer": [config.instance_id]}
    return {
        "version": package_version(),
        "model_path": str(config.model_dir),
        "tokenizer_path": str(config.model_dir),
        "served_model_name": config.model_name,
        "context_length": model.max_model_len,
        "vocab_size": model.vocab_size,
        "max_logprobs": config.max_logprobs,
        "host": config.host,
        "port": config.port,
        "api_key_required": config.api_key is not None,
        "speculative_algorithm": None if scheduler is None else scheduler.speculative_algorithm,
        "services": alive,
        "internal_states": [] if scheduler is None else [msgspec.structs.asdict(scheduler)],
    }


ROUTES = [version, get_model_info, get_server_info]
