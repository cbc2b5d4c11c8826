"""The training loop and run plumbing both training scripts share (ops/train/common.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from ops.train import common
from ops.train.recipes import DRAFTERS, TARGETS


def toy_recipe(steps: int, eval_every: int):
    return dataclasses.replace(TARGETS["toy"], steps=steps, eval_every=eval_every, warmup_steps=2)


class Recorder(torch.nn.Module):
    """One 2x2 weight, which the tests' losses pull towards 3."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))


def test_train_loop_logs_evaluates_and_schedules_as_the_recipe_says():
    recipe = toy_recipe(steps=120, eval_every=40)
    module = Recorder()
    params = list(module.parameters())
    optimizer = common.adamw(params, recipe.lr, weight_decay=0.0)
    lrs, modes = [], []

    def step_loss() -> torch.Tensor:
        lrs.append(optimizer.param_groups[0]["lr"])
        modes.append(module.training)
        return ((module.weight - 3.0) ** 2).mean()

    def evaluate() -> dict[str, float]:
        module.eval()
        score = float(((module.weight - 3.0) ** 2).mean())
        module.train()
        return {"eval": score, "eval_extra": -score}

    history = common.train_loop(module, params, optimizer, recipe, step_loss, evaluate, "test")
    assert list(history) == ["train", "eval", "eval_extra"]
    assert [step for step, _ in history["train"]] == [50, 100, 120]  # every LOG_EVERY steps, and the last
    assert [step for step, _ in history["eval"]] == [40, 80, 120]
    assert history["eval"][-1][1] < history["eval"][0][1] and history["train"][-1][1] < history["train"][0][1]
    assert lrs == [common.lr_at(step, recipe.lr, 2, 120) for step in range(120)] and all(modes)


def test_train_loop_mean_loss_covers_each_log_window():
    recipe = toy_recipe(steps=60, eval_every=1000)
    module = Recorder()
    params = list(module.parameters())
    losses = iter(float(step) for step in range(60))

    def step_loss() -> torch.Tensor:  # a loss of `step` (plus a zero term, so it has a gradient)
        return next(losses) + 0.0 * module.weight.sum()

    optimizer = common.adamw(params, 0.0, 0.0)
    history = common.train_loop(module, params, optimizer, recipe, step_loss, lambda: {}, "test")
    assert history["train"] == [(50, sum(range(50)) / 50), (60, sum(range(50, 60)) / 10)]


def test_train_loop_stops_at_the_first_step_past_max_seconds_and_logs_it_as_the_last(monkeypatch):
    recipe = toy_recipe(steps=120, eval_every=40)
    module = Recorder()
    params = list(module.parameters())
    ticks = iter(range(1000))  # the loop's clock: one second a reading
    monkeypatch.setattr(common, "time", type("Clock", (), {"monotonic": staticmethod(lambda: float(next(ticks)))}))

    def step_loss() -> torch.Tensor:
        return ((module.weight - 3.0) ** 2).mean()

    optimizer = common.adamw(params, recipe.lr, 0.0)
    history = common.train_loop(module, params, optimizer, recipe, step_loss, lambda: {"eval": 0.0}, "test", max_seconds=2.5)
    # read at the start (0), then after each step: 1, 2, 3 > 2.5 -> step 3 is the last, logged and evaluated
    assert [step for step, _ in history["train"]] == [3] and [step for step, _ in history["eval"]] == [3]
    assert common.steps_run(history) == 3


def test_adamw_decays_matrices_only_when_asked():
    matrix, vector = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    split = common.adamw([matrix, vector], 1e-3, 0.1, decay_vectors=False)
    assert [(group["params"], group["weight_decay"]) for group in split.param_groups] == [([matrix], 0.1), ([vector], 0.0)]
    whole = common.adamw([matrix, vector], 1e-3, 0.1)
    assert len(whole.param_groups) == 1 and whole.param_groups[0]["weight_decay"] == 0.1
    assert whole.param_groups[0]["betas"] == common.BETAS


def test_run_arguments_and_recipe_override():
    parser = argparse.ArgumentParser()
    common.add_run_arguments(parser, DRAFTERS, out_help="where")
    args = parser.parse_args(["--recipe", "toy", "--out", "o", "--results", "r.json", "--steps", "1"])
    assert (args.seed, args.device) == (0, "auto")
    recipe = common.run_recipe(DRAFTERS, args)
    assert recipe.steps == 1 and recipe.warmup_steps == 0 and recipe.lr == DRAFTERS["toy"].lr
    args.steps = None
    assert common.run_recipe(DRAFTERS, args) is DRAFTERS["toy"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "o"])  # --results is required


def test_set_overrides_recipe_fields_by_their_types_and_names_bad_ones():
    parser = argparse.ArgumentParser()
    common.add_run_arguments(parser, DRAFTERS, out_help="where")
    args = parser.parse_args(["--recipe", "toy", "--out", "o", "--results", "r.json",
                              "--set", "num_layers=2", "--set", "distill_fraction=0.75", "--set", "target_layer_ids=1,0"])  # fmt: skip
    recipe = common.run_recipe(DRAFTERS, args)
    assert (recipe.num_layers, recipe.distill_fraction, recipe.target_layer_ids) == (2, 0.75, (1, 0))
    assert recipe.steps == DRAFTERS["toy"].steps
    for bad in ("layers=2", "num_layers", "num_layers=two"):
        args.overrides = [bad]
        with pytest.raises(SystemExit, match="--set"):
            common.run_recipe(DRAFTERS, args)
    args.overrides = ["distill_fraction=1.5"]  # the recipe's own checks still run
    with pytest.raises(ValueError, match="distill_fraction"):
        common.run_recipe(DRAFTERS, args)


def test_write_results_puts_the_run_first_and_history_last(tmp_path):
    args = argparse.Namespace(recipe="toy", seed=3, results=tmp_path / "run" / "r.json")
    history = {"train": [(1, 2.0)], "eval": [(1, 2.5)]}
    results = common.write_results(args, TARGETS["toy"], history, "title", {"parameters": 7}, history)
    written = json.loads(args.results.read_text())
    assert list(written) == ["recipe", "seed", "recipe_settings", "parameters", "loss_curve_png", "history", "environment"]
    assert written["recipe_settings"]["steps"] == TARGETS["toy"].steps and results["seed"] == 3
    assert written["loss_curve_png"] in (None, "r.png")
    assert (written["loss_curve_png"] is None) != args.results.with_suffix(".png").is_file()


def test_target_features_minus_one_is_the_embedding_output():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ops.train.train_drafter import TargetFeatures

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 7))
    _, features = TargetFeatures(model, (-1, 1))(ids, torch.device("cpu"))
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([states[0], states[2]], dim=-1))
