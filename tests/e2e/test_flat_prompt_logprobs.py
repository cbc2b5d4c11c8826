"""PRODUCT §5 end to end: flat raw prompt top logprobs of any size.

1. A real prompt of 8,192+ tokens with k = 20 through the real model and all three services;
   the flat arrays equal the nested rows of the same request.
2. 131072 x 20 arrays (~21 MB) built by the scheduler's own message code (`to_token_batches`)
   go from the scheduler's output subject through the real detokenizer and tokenizer services
   over a nats-server left at the default 1 MB `max_payload`, 8 requests at once, intact.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import numpy as np
import pybase64
import pytest

from e2e.stack import Service, Stack, service_argv
from ops.bench.standin_scheduler import StandInScheduler, seeded_top_logprobs
from services.common.transport import Transport

LONG_ROWS, LONG_K = 131072, 20


def flat_arrays(body: dict) -> tuple[np.ndarray, np.ndarray]:
    meta = body["meta_info"]
    rows, k = meta["input_top_logprobs_shape"]
    assert meta["input_top_logprobs_val_flat_b64_dtype"] == "float32"
    assert meta["input_top_logprobs_idx_flat_b64_dtype"] == "int32"
    values = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_val_flat_b64"]), "<f4").reshape(rows, k)
    ids = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), "<i4").reshape(rows, k)
    return values, ids


@pytest.mark.timeout(300)
def test_long_real_prompt_flat_equals_nested(stack: Stack) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 2000, size=8200)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": LONG_K}
    with httpx.Client(base_url=stack.base_url, timeout=240) as client:
        nested = client.post("/generate", json=body)
        flat = client.post("/generate", json={**body, "return_flat_raw_top_logprobs": True,
                                              "return_flat_raw_top_logprobs_b64": True})
    assert nested.status_code == 200, nested.text
    assert flat.status_code == 200, flat.text
    values, ids = flat_arrays(flat.json())
    meta = flat.json()["meta_info"]
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["input_top_logprobs_null_prefix"] == 1
    assert values.shape == (len(prompt) - 1, LONG_K)
    rows = nested.json()["meta_info"]["input_top_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    # the second request reuses the first's cached prefix (its rows kept, exact); its last rows are
    # computed over another split, rounding differently
    np.testing.assert_allclose(values, np.array([[e[0] for e in row] for row in rows[1:]], np.float32), atol=1e-5)
    np.testing.assert_array_equal(ids, np.array([[e[1] for e in row] for row in rows[1:]], np.int32))
    assert np.all(np.diff(values, axis=1) <= 0)  # each row sorted by logprob


def expected_arrays(seed: int) -> tuple[np.ndarray, np.ndarray]:
    return seeded_top_logprobs(seed, LONG_ROWS, LONG_K)


@pytest.mark.timeout(300)
async def test_131072x20_through_real_services_at_1mb_max_payload(nats_server_factory, tmp_path) -> None:
    server = nats_server_factory(max_payload="1MB")
    stack = Stack(server, tmp_path)
    stack.services["detokenizer"] = Service.start("detokenizer", service_argv("detokenizer", server.url), tmp_path)
    tokenizer_argv = service_argv("tokenizer", server.url, "--port", str(stack.port), "--max-model-len", str(LONG_ROWS + 8))
    stack.services["tokenizer"] = Service.start("tokenizer", tokenizer_argv, tmp_path)
    transport = await Transport.connect(server.url, "standin-scheduler")
    scheduler = StandInScheduler(transport, max_model_len=LONG_ROWS + 8)
    await scheduler.start()
    try:
        await asyncio.to_thread(stack.wait_healthy, 120)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=240) as client:
            responses = await asyncio.gather(*(client.post("/generate", json=long_body(seed)) for seed in range(3, 11)))
        for seed, response in zip(range(3, 11), responses):
            assert response.status_code == 200, response.text[:500]
            values, ids = flat_arrays(response.json())
            want_values, want_ids = expected_arrays(seed)
            np.testing.assert_array_equal(values, want_values)
            np.testing.assert_array_equal(ids, want_ids)
            assert response.json()["meta_info"]["input_top_logprobs_null_prefix"] == 1
        stack.raise_if_dead()
        assert "slow consumer" not in stack.logs().lower()
    finally:
        with contextlib.suppress(Exception):
            await scheduler.stop()
        await transport.close()
        for service in stack.services.values():
            service.stop()


def long_body(seed: int) -> dict:
    prompt = [seed] + [5] * LONG_ROWS  # 131073 tokens: 131072 rows after the null prefix; seed picks the arrays
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": LONG_K, "return_flat_raw_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}


@pytest.mark.timeout(240)
def test_rows_flat_cannot_hold_come_back_nested_through_the_whole_path(tmp_path, monkeypatch) -> None:
    """A model whose hidden states turn NaN at one token (as an fp16 overflow would): the prompt's top
    rows after it hold NaN, which flat arrays cannot represent (PRODUCT §5), so the scheduler sends
    nested rows for that request and the response carries them, with a warning in the log."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from e2e.stack import RANDOM_TINY_MODEL, start_stack
    from services.scheduler.model.loader import load_model_runner

    poison = 77
    model_dir = tmp_path / "nan-model"
    shutil.copytree(RANDOM_TINY_MODEL, model_dir)
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=4)
    tensors = {name: t.detach().clone().contiguous() for name, t in runner.model.checkpoint_tensors()}
    tensors["model.embed_tokens.weight"][poison] = float("nan")
    save_file(tensors, str(model_dir / "model.safetensors"))
    monkeypatch.setenv("SPARKWIRE_MODEL", str(model_dir))
    (tmp_path / "logs").mkdir()
    stack = start_stack(tmp_path / "logs")
    try:
        prompt = [5, 9, 11, 13, poison, 17, 19, 23]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": 2, "return_flat_raw_top_logprobs": True,
                "return_flat_raw_top_logprobs_b64": True}  # fmt: skip
        with httpx.Client(base_url=stack.base_url, timeout=60) as client:
            flat = client.post("/generate", json=body)
            nested = client.post("/generate", json={**body, "return_flat_raw_top_logprobs": False,
                                                    "return_flat_raw_top_logprobs_b64": False})  # fmt: skip
        assert flat.status_code == 200, flat.text
        meta = flat.json()["meta_info"]
        assert "input_top_logprobs_shape" not in meta  # no (empty) flat arrays pretending to be the rows
        rows = meta["input_top_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None
        # the same rows a plain nested request gets (masked NaN values may leak into earlier rows through
        # attention's 0 * NaN; what matters is that every row arrives, in place, NaN as null)
        assert rows == nested.json()["meta_info"]["input_top_logprobs"]
        assert all(len(row) == 2 and entry[0] is None for row in rows[5:] for entry in row)
        assert "flat_logprobs_fallback" in stack.logs()
    finally:
        stack.stop()
