"""Schema-driven fuzzing of the HTTP API (schemathesis against our own /openapi.json), bounded:
no input gives a 5xx, and every response with a documented status matches its schema. The
backend is the scripted stand-in (tests/services/tokenizer/conftest.py), so a generated
`max_new_tokens` of a billion costs nothing."""

from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

EXAMPLES_PER_OPERATION = 30


def fuzz(url: str) -> list[str]:
    """Every operation of the schema, `EXAMPLES_PER_OPERATION` generated cases each."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def check(case) -> None:
            response = case.call(timeout=30)
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            except (Exception, BaseExceptionGroup) as exc:  # collect: one run shows every broken operation
                failures.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:400]}")

        check()
    return failures


@pytest.mark.timeout(300)
async def test_generated_requests_get_no_5xx_and_responses_match_the_schema(url, backend):
    failures = await asyncio.to_thread(fuzz, url)
    assert failures == []
