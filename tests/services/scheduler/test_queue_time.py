"""Queue time in vLLM's sense, measured in the scheduler core: from `add` until the first step
that schedules the request; exported as `sparkwire:request_queue_time_seconds`."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.common.metrics_scheduler import SchedulerMetrics, SchedulerStats
from test_fork_core import forked
from test_scheduler_core import prompt_of, request, run


def step_clock(holder: dict):
    """A clock that reads the core's step count: queue times come out in steps, exactly."""
    return lambda: float(holder["core"].num_steps)


def test_a_request_held_waiting_queues_longer_than_one_scheduled_at_once(make_core):
    holder: dict = {}
    core = holder["core"] = make_core(max_running_requests=1, clock=step_clock(holder))
    metrics = SchedulerMetrics(lambda: SchedulerStats(num_running=0), "tiny")
    queue_times: dict[str, float] = {}
    core.add(request("first", prompt_of(1, 8), max_new_tokens=4, ignore_eos=True))
    core.add(request("second", prompt_of(2, 8), max_new_tokens=4, ignore_eos=True))
    while core.has_work():
        core.step()
        taken = core.take_queue_times()
        metrics.observe_queue_times(taken.values())
        queue_times |= taken
    assert queue_times["first"] == 0.0  # scheduled by the step it arrived before
    assert queue_times["second"] >= 4.0  # waited for all four steps of the first
    text = generate_latest(metrics.registry).decode()
    assert 'sparkwire:request_queue_time_seconds_count{model_name="tiny"} 2.0' in text
    assert f'sparkwire:request_queue_time_seconds_sum{{model_name="tiny"}} {queue_times["second"]}' in text


def test_each_request_is_observed_once_and_one_aborted_while_waiting_never(make_core):
    core = make_core(num_blocks=5, chunked_prefill_size=64)  # 80 KV slots: decodes outgrow admissions
    prompts = [prompt_of(20 + i, 2 + 3 * (i % 4)) for i in range(12)]
    requests = [request(f"r{i}", prompt, max_new_tokens=14, ignore_eos=True) for i, prompt in enumerate(prompts)]
    requests.append(request("late", prompt_of(9, 60), max_new_tokens=14))  # waits behind the rest
    taken: list[str] = []
    original = core.step

    def step():
        outputs = original()
        taken.extend(core.take_queue_times())
        return outputs

    core.step = step
    run(core, requests, abort_at={1: ["late"]})
    assert core.num_preemptions > 0  # re-prefills are not first schedules
    assert sorted(taken) == sorted(f"r{i}" for i in range(12))  # once each; "late" never ran
    assert core.take_queue_times() == {} and core._queue_times._unscheduled == {}


def test_forked_choices_queue_until_their_own_first_step(make_core):
    """n > 1: each choice is a request of its own; a fork is first scheduled after the prefill."""
    holder: dict = {}
    core = holder["core"] = make_core(chunked_prefill_size=16, clock=step_clock(holder))
    core.add(forked("p", prompt_of(3, 40), (1, 2, 3), max_new_tokens=3, temperature=1.0))
    queue_times: dict[str, float] = {}
    while core.has_work():
        core.step()
        queue_times |= core.take_queue_times()
    assert queue_times["p"] == 0.0
    assert queue_times["p.1"] == queue_times["p.2"] >= 3.0  # a 40-token prompt in chunks of 16
    assert core._queue_times._unscheduled == {}
