"""docs/api-parameters.md is what `python -m ops.api_reference` writes from the OpenAPI schema
(tests/services/tokenizer/test_tokenizer_info.py checks that schema is the one /openapi.json serves)."""

from __future__ import annotations

import msgspec

from ops.api_reference import REFERENCE, openapi_schema, reference
from services.tokenizer.api_types import ChatBody, GenerateBody, SamplingParamsBody
from services.tokenizer.http_app import ROUTE_HANDLERS


def test_the_committed_reference_is_not_stale():
    assert REFERENCE.read_text() == reference(openapi_schema()), "stale: run python -m ops.api_reference"


def test_the_reference_has_every_route_and_every_body_parameter():
    text = reference(openapi_schema())
    for handler in ROUTE_HANDLERS:
        if handler.include_in_schema:
            for path in handler.paths:
                heading = path.replace("{model_id:path}", "{model_id}")
                assert any(f"## {method} {heading}\n" in text for method in handler.http_methods), path
    rows = {line.split(" | ")[0].removeprefix("| ") for line in text.splitlines() if line.startswith("| ")}
    assert {f.name for f in msgspec.structs.fields(GenerateBody)} <= rows
    assert {f"sampling_params.{f.name}" for f in msgspec.structs.fields(SamplingParamsBody)} <= rows
    assert {"messages[].content[].type", "stream_options.continuous_usage_stats"} <= rows
    assert {f.name for f in msgspec.structs.fields(ChatBody)} <= rows


def test_unsupported_parameters_say_so():
    text = reference(openapi_schema())
    row = next(line for line in text.splitlines() if line.startswith("| guided_json |"))
    assert "Not supported here" in row
