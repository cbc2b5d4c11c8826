"""The step trace (`--step-trace`, `step_trace.py`): a real core stepped by `StepThread` on the
tiny CPU model writes one line per step, and the lines add up to what the core computed."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.step_loop import StepThread
from services.scheduler.step_trace import StepTrace
from test_scheduler_core import prompt_of, request

PROMPT_LENS = (9, 23, 5, 17)
NEW_TOKENS = 6


async def _serve(core, requests) -> int:
    """Step every request to its finish through a StepThread; the tokens generated."""
    for r in requests:
        core.add(r)
    steps = StepThread(core, StepTrace.open(core.trace_dir, "sched-1"))
    steps.start()
    generated, finished = 0, set()
    while len(finished) < len(requests):
        result = await asyncio.wait_for(steps.next(), 60)
        generated += sum(len(o.new_token_ids) for o in result.outputs)
        finished |= {o.rid for o in result.outputs if o.finish is not None}
        steps.published()
    await steps.stop()
    return generated


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
async def test_each_step_is_one_line_and_the_lines_add_up(make_core, tmp_path, overlap):
    core = make_core(chunked_prefill_size=16, overlap_decode=overlap)  # prompts in chunks beside decodes
    core.trace_dir = tmp_path / "trace"
    reqs = [request(f"r{i}", prompt_of(i, n), max_new_tokens=NEW_TOKENS, ignore_eos=True) for i, n in enumerate(PROMPT_LENS)]
    generated = await _serve(core, reqs)
    lines = [msgspec.json.decode(line) for line in (tmp_path / "trace" / "sched-1.jsonl").read_bytes().splitlines()]
    ran = [line for line in lines if "num_seqs" in line]
    assert len(lines) == core.num_steps and generated == len(reqs) * NEW_TOKENS
    assert sum(line["num_prefill_tokens"] for line in ran) == sum(PROMPT_LENS)  # every prompt token, once
    assert all(line["num_tokens"] - line["num_prefill_tokens"] <= line["num_seqs"] <= 16 for line in ran)  # chunk budget 16
    assert sum(line["num_sampling"] for line in ran) >= generated  # a followed step may sample for a finished request
    assert max(line["num_prefill_tokens"] for line in ran) <= 16 and len(ran) >= sum(PROMPT_LENS) // 16
    assert all(line["dur_s"] > 0 and line["turn_s"] >= 0 and line["collect_s"] <= line["dur_s"] for line in ran)
    assert all(0 <= line["wait_s"] <= line["collect_s"] for line in ran)  # the readback wait is part of collecting
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    assert any(line["followed"] for line in ran) is overlap and any(line["follows"] for line in ran) is overlap
    assert lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0
    queued = [seconds for line in lines for seconds in line.get("queued_s", ())]  # each request's, in the step that first scheduled it
    assert len(queued) == len(reqs) and all(0 <= seconds < 60 for seconds in queued)
    assert "queued_s" in lines[0] and all(line["num_prefill_tokens"] > 0 for line in ran if "queued_s" in line)


def test_the_scheduler_config_takes_a_trace_directory():
    assert SchedulerConfig(device="cpu", step_trace="/tmp/x").step_trace == "/tmp/x"
    assert SchedulerConfig(device="cpu").step_trace is None
