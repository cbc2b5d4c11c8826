"""run_gpu.sh's one report: a line per job folder."""

from __future__ import annotations

import json

from ops.train.summarize import main, summarize


def _write(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_a_pair_job_reports_target_drafter_and_evaluation(tmp_path):
    job = tmp_path / "micro-1"
    _write(job / "target.json", {"parameters": 3410688, "train_seconds": 112.0, "final_train_loss": 1.6233,
                                 "final_eval_loss": 1.8807})  # fmt: skip
    _write(job / "drafter.json", {"parameters": 1509393, "train_seconds": 232.0, "final_train_loss": 1.1232,
                                  "final_eval_loss": 1.2724, "final_eval_teacher_forced_greedy_accept": 2.66})  # fmt: skip
    _write(job / "eval.json", {"target": {"held_out": {"perplexity": 6.54, "bits_per_byte": 0.882},
                                          "shuffled": {"perplexity": 11114.2}},
                               "drafter": {"dtype": "float32", "temperature_0": {"mean_accept_length": 4.4934},
                                           "temperature_1": {"mean_accept_length": 2.38}}})  # fmt: skip
    line = summarize(job)
    assert line.startswith("micro-1 | target 3,410,688 params 112.0s loss 1.623/1.881")
    assert "drafter 1,509,393 params 232.0s loss 1.123/1.272 tf-accept 2.66" in line
    assert "ppl 6.540 bpb 0.8820 (shuffled ppl 11114)" in line
    assert line.endswith("accept {'temperature_0': 4.493, 'temperature_1': 2.38}")


def test_a_drafter_job_without_target_figures_and_a_truncated_json_are_skipped_parts(tmp_path, capsys):
    job = tmp_path / "micro-2"
    _write(job / "eval.json", {"drafter": {"temperature_0": {"mean_accept_length": 4.3}}})
    (job / "drafter.json").write_text('{"parameters": 15')  # cut short by the call's deadline
    assert summarize(job) == "micro-2 | accept {'temperature_0': 4.3}"
    (tmp_path / "pair_toy_1.log").write_text("not a job")
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["micro-2 | accept {'temperature_0': 4.3}"]
