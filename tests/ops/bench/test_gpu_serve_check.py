"""`sparkwire bench gpu-serve` (ops/bench/gpu_serve_check.py) at toy size on CPU, so the H200 script cannot rot: every scenario
runs through a launched stack serving a shape directory with no tokenizer of its own."""

from __future__ import annotations

import json

import pytest

from ops.bench.gpu_serve_check import SCENARIOS, CheckConfig, closed_loop_turnaround, run, serving_model_dir
from services.models import BUNDLED_MODEL
from tests.ops.bench.bench_cli import bench


@pytest.fixture
def shape_dir(tmp_path):
    """The bundled model's config with a vocabulary twice its tokenizer's, like an 8B shape
    served with the bundled tokenizer: generated ids past the tokenizer must not break anything."""
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({**config, "vocab_size": 2 * config["vocab_size"]}))
    return shape


def test_serving_dir_has_the_shape_and_the_bundled_tokenizer(shape_dir, tmp_path):
    served = serving_model_dir(shape_dir, tmp_path / "served")
    bundled_vocab = json.loads((BUNDLED_MODEL / "config.json").read_text())["vocab_size"]
    assert json.loads((served / "config.json").read_text())["vocab_size"] == 2 * bundled_vocab
    assert (served / "tokenizer.json").read_bytes() == (BUNDLED_MODEL / "tokenizer.json").read_bytes()


@pytest.mark.timeout(120)
def test_every_scenario_runs_at_toy_size(shape_dir, tmp_path, capsys):
    out = tmp_path / "gpu_serve.json"
    (tmp_path / "gpu_serve_trace").mkdir()  # an earlier run's trace with the same --out: not read as this one's
    (tmp_path / "gpu_serve_trace" / "scheduler-earlier.jsonl").write_text(json.dumps({"t": 0.0, "dur_s": 1.0}) + "\n")
    assert bench("gpu-serve", "--model-config", shape_dir, "--device", "cpu", "--concurrency", 3, "--num-prompts", 6, "--batch1-prompts", 2,
                 "--input-len", 8, "--output-len", 4, "--num-warmups", 1, "--no-core-baseline", "--long-prompt-len", 40, "--out", out) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["scenarios"]) == list(SCENARIOS) and result["up_exit_code"] == 0
    for name, figures in result["scenarios"].items():  # (requests, prompt and output tokens of each)
        expected, input_len, output_len = {"batch1": (2, 8, 4), "batch1_logprobs": (2, 8, 4), "long_prompt_top2": (3, 40, 1)}.get(name, (6, 8, 4))
        assert "error" not in figures, figures.get("error")
        assert (figures["completed"], figures["failed"]) == (expected, 0), name
        assert figures["total_output_tokens"] == expected * output_len and figures["total_input_tokens"] == expected * input_len, name
    long = result["scenarios"]["long_prompt_top2"]["config"]
    assert (long["logprobs"], long["prompt_logprobs"], long["max_concurrency"]) == (2, True, 1)
    scenarios = result["scenarios"]
    assert scenarios["concurrency_logprobs"]["config"]["logprobs"] == 20
    assert scenarios["batch1"]["config"]["max_concurrency"] == 1 and scenarios["concurrency"]["config"]["max_concurrency"] == 3
    rate = scenarios["poisson"]["config"]["request_rate"]
    assert rate == pytest.approx(0.8 * scenarios["concurrency"]["request_throughput"])
    assert result["stack_vs_core"] is None  # no core baseline on CPU
    printed = capsys.readouterr().out
    assert "| poisson | 6 / 0 |" in printed
    for name, figures in scenarios.items():  # the scheduler's steps inside each timed window
        trace = figures["step_trace"]
        prefilled = sum(row["steps"] * row["prefill_tokens"] for kind, row in trace["kinds"].items() if kind != "idle")
        assert prefilled == pytest.approx(figures["total_input_tokens"]), name  # warm-ups and other scenarios cut out
        assert 0 < trace["busy_s"] <= trace["span_s"] + 1e-6 <= figures["duration_s"] + 1e-6, name
        assert trace["admitted"] == figures["completed"], name  # each timed request first scheduled inside the window
    turnaround = scenarios["concurrency"]["turnaround"]
    assert turnaround["slot_idle_ms"] >= 0 and 0 <= turnaround["client_ms"] < 1e3 and turnaround["queued_ms"] >= 0, turnaround
    assert turnaround["in_stack_ms"] == pytest.approx(turnaround["slot_idle_ms"] - turnaround["queued_ms"] - turnaround["client_ms"])
    assert "turnaround of `concurrency`, ms a turnover: slot_idle" in printed
    assert "steps of `concurrency`" in printed and (tmp_path / "gpu_serve_trace").is_dir()
    cpu = scenarios["concurrency"]["stack_cpu"]  # cores each of the stack's processes used
    assert {"sparkwire tokenizer", "sparkwire scheduler", "sparkwire detokenizer", "nats-server"} <= set(cpu), cpu
    assert cpu["sparkwire scheduler"] > 0.05 and all(0 <= cores < 2.5 for cores in cpu.values()), cpu


@pytest.mark.timeout(120)
def test_a_stack_that_does_not_come_up_is_recorded_not_lost(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture", "vocab_size": 64}))
    out = tmp_path / "gpu_serve.json"
    run(CheckConfig(model_config=broken, device="cpu", core_baseline=False, progress=False), out)
    result = json.loads(out.read_text())
    assert "sparkwire up exited" in result["stack_error"] and result["scenarios"] == {}
    assert "the stack did not serve" in capsys.readouterr().out


def test_graph_captures_are_read_from_the_scheduler_log(tmp_path):
    from ops.bench.gpu_serve_check import LOGPROB_CAPTURE, RAGGED_CAPTURE, captures_in_log

    log = tmp_path / "up.log"
    log.write_text(
        "[scheduler] 2026-12-02 00:34:06 [info     ] cuda_graphs.ragged_capture.done keys=3 seconds=0.25\n"
        "[scheduler] 2026-12-02 00:34:07 [info     ] logprob_graph_captured         capture_ms=161.0 graphs=1 ids=0 k=20 rows=64\n"
        "[scheduler] 2026-12-02 00:34:08 [info     ] cuda_graphs.ragged_capture.done keys=1 seconds=1.5\n"
        "[scheduler] 2026-12-02 00:34:09 [info     ] logprob_graph_captured         capture_ms=40.5 graphs=2 ids=0 k=20 rows=128\n"
        "[scheduler] 2026-12-02 00:34:09 [info     ] request.done                   seconds=9.0\n"
    )  # fmt: skip
    assert captures_in_log(log, RAGGED_CAPTURE) == {"count": 2, "seconds": 1.75, "longest_s": 1.5}
    assert captures_in_log(log, LOGPROB_CAPTURE) == {"count": 2, "seconds": 0.202, "longest_s": 0.161}
    assert captures_in_log(tmp_path / "missing.log", LOGPROB_CAPTURE) == {"count": 0, "seconds": 0.0, "longest_s": 0.0}


def test_the_flash4_warm_up_is_read_from_the_scheduler_log(tmp_path):
    from ops.bench.gpu_serve_check import flash4_warmed_s

    log = tmp_path / "up.log"
    log.write_text("[scheduler] 2026-12-02 05:30:01 [info     ] dense_attention.warmed         kernel=flash4 seconds=10.69\n")
    assert flash4_warmed_s(log) == 10.69
    log.write_text("[scheduler] 2026-12-02 05:30:01 [info     ] logprob_kernels.warmed         seconds=1.98\n")
    assert flash4_warmed_s(log) is None  # no FA4: long prompts attended by SDPA


@pytest.mark.timeout(120)
def test_profile_scheduler_records_the_schedulers_gil_per_scenario(shape_dir, tmp_path, capsys):
    from ops.bench import scheduler_profile

    try:
        scheduler_profile.py_spy()
    except RuntimeError:
        pytest.skip("py-spy is not installed (the test extras install it)")
    check = CheckConfig(model_config=shape_dir, device="cpu", concurrency=3, num_prompts=12, input_len=8, output_len=16, num_warmups=1,
                        core_baseline=False, progress=False, scenarios=("concurrency",), profile_scheduler=True)  # fmt: skip
    out = tmp_path / "gpu_serve.json"
    run(check, out)
    profile = json.loads(out.read_text())["scenarios"]["concurrency"]["scheduler_profile"]
    if "error" in profile and ("ermission" in profile["error"] or "not permitted" in profile["error"]):
        pytest.skip(f"this machine does not let py-spy read another process: {profile['error']}")
    assert "error" not in profile, profile
    assert profile["samples"] > 0 and 0 < profile["gil_held_share"] <= 1.2
    assert "scheduler-step" in profile["threads"]  # the step thread, by its name
    assert any(name.startswith("SchedulerCore.step ") for name in profile["inclusive"]), profile["inclusive"]
    assert (tmp_path / "gpu_serve_spy_concurrency.txt").is_file()
    assert "`concurrency`: scheduler's GIL:" in capsys.readouterr().out


def test_the_turnaround_splits_a_slots_idle_time():
    """Two slots, six requests of 1 s: the first two sent at 100 s, each next one 50 ms after a
    stream ends. Over the steady window (100-102.1 s) the scheduler ran 1.77 requests on average and
    arrivals queued 10 ms there; steps outside it (the ramp, the drain) are not counted."""
    sent = (100.0, 100.0, 101.05, 101.05, 102.1, 102.1)
    requests = [{"ok": True, "sent_at": t, "e2e_s": 1.0, "last_token_s": 0.998} for t in sent]
    requests.append({"ok": False, "sent_at": 100.5, "e2e_s": 0.01, "last_token_s": None})  # failed: not counted

    def step(t, dur, running, queued=()):
        return {"t": t, "dur_s": dur, "turn_s": 0.0, "held": False, "running": running, "num_seqs": running, "num_tokens": running,
                "num_prefill_tokens": 0, "followed": False, "collect_s": 0.0} | ({"queued_s": list(queued)} if queued else {})  # fmt: skip

    lines = [step(99.0, 1.0, 0, (0.5,)),  # before the window
             step(100.0, 1.0, 2, (0.01, 0.01)), step(101.0, 0.5, 2, (0.01,)), step(101.5, 0.6, 1.2, (0.01,)),
             step(102.5, 1.0, 2, (0.9,))]  # after the window  # fmt: skip
    turnaround = closed_loop_turnaround(requests, lines, concurrency=2)
    # the steady steps: 2 x 1.0 + 2 x 0.5 + 1.2 x 0.6 over 2.1 s: 1.77 running; 4 turnovers: 120 ms idle each
    idle = 1e3 * (2 - (2 * 1.0 + 2 * 0.5 + 1.2 * 0.6) / 2.1) * 2.1 / 4
    assert turnaround == {"slot_idle_ms": pytest.approx(idle), "queued_ms": pytest.approx(10.0), "client_ms": pytest.approx(50.0),
                          "in_stack_ms": pytest.approx(idle - 60.0), "stream_tail_ms": pytest.approx(2.0)}  # fmt: skip
    assert closed_loop_turnaround(requests, [{k: v for k, v in line.items() if k != "queued_s"} for line in lines], 2) is None  # an older trace
    assert closed_loop_turnaround([{**r, "sent_at": 0.0} for r in requests], lines, concurrency=2) is None  # results without sent_at
