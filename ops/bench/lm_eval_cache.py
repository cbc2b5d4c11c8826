"""`sparkwire bench lm-eval-cache`: lm-evaluation-harness (`local-completions`) on a multiple-choice
task with one shared few-shot context, against `sparkwire up` with the prefix cache on and then off
(issue 44, point 5): the scores must be identical; the wall time of each run and the scheduler's
prefix-cache counters are reported.

The task is built here, deterministically, as files (nothing comes from a hub): `python-idioms`,
a JSONL of items about Python code (what the bundled model was trained on: it continues Python
source), each a code prefix and four continuations scored by loglikelihood (acc, acc_norm), and a
task YAML over it (`dataset_path: json`). Every item's context starts with the same preamble and
the same first `--fewshot` solved items (sampler `first_n`), so all requests share a long prefix.
lm-eval runs in this process (`lm_eval.simple_evaluate`) with the model's own tokenizer directory
and the hubs offline; it is the `eval` extra (`pip install -e '.[eval]'`), which CI does not install.

    sparkwire bench lm-eval-cache --out /tmp/lm_eval_cache.json
    sparkwire bench lm-eval-cache --items 8 --fewshot 2 --out /tmp/lm_eval_cache.json  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

from ops.bench.serve_launch import launched_stack, prefix_cache_counters, scheduler_metrics_url
from services.common.nats_server import free_port
from services.models import BUNDLED_MODEL

TASK = "python-idioms"
PREAMBLE = (
    '"""Python idioms, one small complete block each, as the standard library writes them."""\n\n'
    "from __future__ import annotations\n\nimport os\nimport re\nimport sys\nfrom collections import defaultdict\n"
    "from pathlib import Path\n\n\n"
)
NAMES = ("name", "value", "path", "data", "item", "key", "count", "result", "line", "node", "text", "config", "index",
         "size", "buf", "parts", "entry", "token", "field", "state")  # fmt: skip
CLASSES = ("Parser", "Reader", "Handler", "Node", "Config", "Buffer", "Cache", "Stream", "Task", "Record", "Writer", "Loader")
ERRORS = ("ValueError", "KeyError", "TypeError", "OSError", "IndexError", "RuntimeError")


@dataclass(frozen=True)
class EvalCheck:
    model: Path = BUNDLED_MODEL
    device: str = "auto"
    items: int = 240
    fewshot: int = 8
    num_concurrent: int = 4  # lm-eval's requests in flight
    seed: int = 0
    up_args: tuple[str, ...] = ()


# ---- the task: items (code prefix, four continuations, the right one's index) and its YAML ----


def idiom(rng: random.Random) -> tuple[str, list[str]]:
    """One code prefix and its continuations, the right one first."""
    a, b, c = rng.sample(NAMES, 3)
    cls, base = rng.sample(CLASSES, 2)
    error = rng.choice(ERRORS)
    kinds = [
        (f"for {a}, {b} in {c}.", ["items():", "append():", "split():", "strip():"]),
        (f"def {a}():\n    return {b}\n\n\nif __name__ == \"", ['__main__":', '__init__":', '__file__":', '__all__":']),
        (f"class {cls}:\n    def __init__(self, {a}):\n        self.{a} = ", [a, "self", "__init__", "class"]),
        (f"with open({a}) as f:\n    {b} = f.", ["read()", "append()", "items()", "__init__()"]),
        (f"try:\n    {a}({b})\nexcept {error} as", [" e:", " self:", " def:", " return:"]),
        (f"def {a}({b}):\n    if not isinstance({b}, int):\n        raise ", ["TypeError(", "return(", "import(", "self("]),
        (f"class {cls}({base}):\n    def __init__(self):\n        super().", ["__init__()", "__main__()", "items()", "append()"]),
        (f"for {a}, {b} in ", [f"enumerate({c}):", f"len({c}):", f"{c}.append():", "return:"]),
        (f"{a} = [{b}.strip() for {b} in {c}", ["]", ")", ":", " return"]),
        (f"import sys\n\n\ndef main({a}):\n    return 0\n\n\nif __name__ == \"__main__\":\n    sys.",
         ["exit(main(sys.argv))", "append(main)", "items(main)", "strip()"]),
    ]  # fmt: skip
    return rng.choice(kinds)


def items(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` items, choices shuffled; the same for the same seed on every machine."""
    rng, docs = random.Random(seed), []
    for _ in range(count):
        context, choices = idiom(rng)
        order = rng.sample(range(len(choices)), len(choices))
        docs.append({"context": context, "choices": [choices[i] for i in order], "label": order.index(0)})
    return docs


def write_task(check: EvalCheck, work: Path) -> Path:
    """The JSONL splits and the task YAML in `work`; returns the folder lm-eval includes."""
    work.mkdir(parents=True, exist_ok=True)
    splits = {"train": items(check.fewshot, check.seed + 1), "test": items(check.items, check.seed)}
    for split, docs in splits.items():
        (work / f"{split}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    task = {
        "task": TASK, "dataset_path": "json", "output_type": "multiple_choice",
        "dataset_kwargs": {"data_files": {split: str(work / f"{split}.jsonl") for split in splits}, "cache_dir": str(work / "hf")},
        "training_split": "train", "fewshot_split": "train", "test_split": "test",
        "num_fewshot": check.fewshot, "fewshot_config": {"sampler": "first_n"}, "description": PREAMBLE,
        "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label",
        "target_delimiter": "", "fewshot_delimiter": "\n\n\n",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }  # fmt: skip
    (work / f"{TASK}.yaml").write_text(json.dumps(task, indent=2) + "\n")  # JSON is YAML
    return work


# ---- one lm-eval run against a running stack ----


def prepare(task_dir: Path, model: Path) -> Any:
    """lm-eval's index of this one task (not its thousands of built-in ones); the task's dataset
    built and the model's tokenizer loaded once, before either run is timed."""
    import importlib

    import transformers
    from lm_eval.tasks import TaskManager, get_task_dict

    importlib.import_module("lm_eval.models.openai_completions")  # local-completions: else its imports are the first run's

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    get_task_dict([TASK], tasks)
    transformers.AutoTokenizer.from_pretrained(model)
    return tasks


def warm_up(base_url: str) -> str:
    """The served model's name, after one request that shares no prefix with the task's."""
    model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "x = 1\n", "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).raise_for_status()
    return model


def evaluate(base_url: str, model: str, check: EvalCheck, tasks: Any) -> dict[str, Any]:
    """lm-eval's scores, every choice's loglikelihood, and the run's wall time."""
    import lm_eval

    model_args = {"model": model, "base_url": f"{base_url}/v1/completions", "tokenizer_backend": "huggingface",
                  "tokenizer": str(check.model), "num_concurrent": check.num_concurrent, "max_retries": 1,
                  "max_length": 4096}  # fmt: skip
    began = time.monotonic()
    output = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[TASK],
                                     task_manager=tasks, log_samples=True)  # fmt: skip
    wall_s = time.monotonic() - began
    scores = output["results"][TASK]
    samples = sorted(output["samples"][TASK], key=lambda s: s["doc_id"])
    return {"wall_s": wall_s, "acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"],
            "loglikelihoods": [[resp[0][0] for resp in sample["resps"]] for sample in samples]}  # fmt: skip


def run_stack(check: EvalCheck, flags: tuple[str, ...], tasks: Any, log: Path) -> dict[str, Any]:
    up_args = ("--model", str(check.model), "--device", check.device, *flags, *check.up_args)
    base_url = f"http://127.0.0.1:{free_port()}"
    with launched_stack(up_args, base_url, log) as stack:
        metrics_url = scheduler_metrics_url(stack)
        model = warm_up(base_url)
        before = prefix_cache_counters(metrics_url)
        run = evaluate(base_url, model, check, tasks)
        after = prefix_cache_counters(metrics_url)
    run["prefix_cache"] = {name: after[name] - before[name] for name in after}
    return {"up_flags": list(flags), "ready_s": stack.ready_s, **run}


# ---- both stacks, the verdict ----


def run(check: EvalCheck, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"check": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(check).items()}}
    with tempfile.TemporaryDirectory(prefix="sparkwire-lm-eval-") as tmp, offline_hubs():
        tasks = prepare(write_task(check, Path(tmp) / "task"), check.model)
        for cache, flags in (("on", ()), ("off", ("--no-prefix-caching",))):
            result[cache] = run_stack(check, flags, tasks, out.with_name(f"{out.stem}_{cache}_up.log"))
    result["summary"] = summary(result["on"], result["off"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def offline_hubs() -> contextlib.AbstractContextManager:
    """No model or dataset hub for the run (`datasets` reads the task's own files, transformers the
    model's tokenizer directory); the environment as it was afterwards."""
    return mock.patch.dict(os.environ, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})


def summary(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    pairs = [(x, y) for row_on, row_off in zip(on["loglikelihoods"], off["loglikelihoods"]) for x, y in zip(row_on, row_off)]
    return {
        "scores_identical": on["acc"] == off["acc"] and on["acc_norm"] == off["acc_norm"],
        "choices_scored": len(pairs),
        "loglikelihood_max_abs_diff": max(abs(x - y) for x, y in pairs),
        "loglikelihoods_bitwise_equal": sum(x == y for x, y in pairs),
        "hit_fraction_on": on["prefix_cache"]["hits"] / max(on["prefix_cache"]["queries"], 1),
        "wall_on_over_off": on["wall_s"] / off["wall_s"],
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| cache | acc | acc_norm | wall s | prompt tokens | of those cached (hits) |", "|---|---|---|---|---|---|"]
    for cache in ("on", "off"):
        row, counts = result[cache], result[cache]["prefix_cache"]
        lines.append(f"| {cache} | {row['acc']:.4f} | {row['acc_norm']:.4f} | {row['wall_s']:.1f} | "
                     f"{counts['queries']:.0f} | {counts['hits']:.0f} |")  # fmt: skip
    lines += [f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}" for name, value in result["summary"].items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EvalCheck()
    parser.add_argument("--model", type=Path, default=defaults.model, help="a model directory (its tokenizer is lm-eval's)")
    parser.add_argument("--device", default=defaults.device)
    for name in ("items", "fewshot", "num_concurrent", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--up-args", default="", help="more `sparkwire up` flags for both stacks")
    parser.add_argument("--out", type=Path, default=Path("lm_eval_cache.json"), help="the JSON (figures go to "
                        "results/lm_eval_cache.md)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import shlex

    check = EvalCheck(model=args.model, device=args.device, items=args.items, fewshot=args.fewshot,
                      num_concurrent=args.num_concurrent, seed=args.seed, up_args=tuple(shlex.split(args.up_args)))  # fmt: skip
    result = run(check, args.out)
    return 0 if result["summary"]["scores_identical"] and result["on"]["prefix_cache"]["hits"] > 0 else 1


if __name__ == "__main__":
    from ops.bench.common import script

    raise SystemExit(script(__doc__, add_arguments, main))
