"""`SchedulerCore.has_room`: the load question a scheduler asks before it takes a claim."""

from __future__ import annotations

import numpy as np

from contracts.scheduler import SamplingParams
from services.scheduler.request import SchedulerRequest


def request(rid: str, prompt_len: int = 4) -> SchedulerRequest:
    return SchedulerRequest(rid, np.arange(1, prompt_len + 1, dtype=np.int32), "detok", SamplingParams(max_new_tokens=4, temperature=0.0))


def test_running_waiting_queued_and_claimed_requests_all_count_against_the_limit(make_core):
    core = make_core(max_running_requests=3)
    assert core.has_room(4) and core.has_room(4, num_claimed=2) and not core.has_room(4, num_claimed=3)
    core.add(request("a"))
    core.add(request("b"))
    assert core.has_room(4) and not core.has_room(4, num_claimed=1)  # queued in the inbox
    core.step()  # now running (or waiting)
    assert core.num_running == 2 and core.has_room(4) and not core.has_room(4, num_claimed=1)
    while core.has_work():
        core.step()
    assert core.has_room(4, num_claimed=2)


def test_a_prompt_whose_kv_blocks_are_not_free_finds_no_room(make_core):
    core = make_core(num_blocks=4)  # 4 blocks x 16 tokens
    assert core.has_room(40) and not core.has_room(70)
    core.add(request("long", prompt_len=40))
    core.step()  # holds 3 of the 4 blocks
    assert core.has_room(10) and not core.has_room(40)
