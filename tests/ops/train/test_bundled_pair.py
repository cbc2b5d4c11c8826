"""The committed pair does what the model card says, checked on CPU without the corpus."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from ops.train.evaluate import SAMPLE_PROMPT, accept_lengths
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from services.scheduler.model.loader import load_model_runner
from tests.plain_forward import reference_logprobs

REPO = Path(__file__).resolve().parents[3]
NUM_NEW = 48


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))


def greedy_continuation(prompt: str, tokenizer: Tokenizer, num_new: int) -> str:
    runner = load_model_runner(BUNDLED_MODEL, num_kv_blocks=8, kv_block_size=16)
    ids = tokenizer.encode(prompt).ids
    for _ in range(num_new):
        ids.append(int(reference_logprobs(runner, ids)[-1].argmax()))
    return tokenizer.decode(ids[-num_new:])


def longest_parsable_prefix(text: str) -> tuple[ast.Module, int]:
    """The module parsed from the most whole lines of `text` that parse, and how many lines that is."""
    lines = text.split("\n")[:-1]  # the last line may be cut mid-token
    for count in range(len(lines), 0, -1):
        try:
            return ast.parse("\n".join(lines[:count])), count
        except SyntaxError:
            continue
    raise AssertionError(f"no prefix of the continuation parses:\n{text}")


def test_fibonacci_continues_as_a_python_function_at_temperature_zero(tokenizer):
    text = SAMPLE_PROMPT + greedy_continuation(SAMPLE_PROMPT, tokenizer, NUM_NEW)
    module, num_lines = longest_parsable_prefix(text)
    function = module.body[0]
    assert isinstance(function, ast.FunctionDef) and function.name == "fibonacci", text
    assert [arg.arg for arg in function.args.args] == ["n"]
    assert num_lines >= 2 and any(isinstance(node, ast.Return) for node in ast.walk(function)), text


def test_the_drafter_speeds_up_greedy_decoding_of_unseen_code(tokenizer):
    """Prompts from this repository's own sources (not in the corpus): accepted drafts per verify."""
    sources = [tokenizer.encode(path.read_text()).ids for path in sorted((REPO / "services" / "scheduler").glob("*.py"))]
    prompts = [ids[:48] for ids in sources if len(ids) >= 48][:4]
    figures = accept_lengths(BUNDLED_MODEL, BUNDLED_DRAFT_MODEL, prompts, torch.device("cpu"), new_tokens=32)
    assert figures["temperature_0"]["mean_accept_length"] > 2.2, figures  # measured 2.82 (1-layer drafter: 2.0); none: 1.0
    assert figures["temperature_1"]["mean_accept_length"] > 1.6, figures  # measured 2.25


def test_the_pair_is_described_by_its_configs():
    target = json.loads((BUNDLED_MODEL / "config.json").read_text())
    draft = json.loads((BUNDLED_DRAFT_MODEL / "config.json").read_text())
    assert target["sparkwire_weights"] == draft["sparkwire_weights"] == "trained"
    assert draft["architectures"] == ["Qwen3DSparkModel"] and draft["block_size"] == 7
    assert draft["num_target_layers"] == target["num_hidden_layers"] and draft["hidden_size"] == target["hidden_size"]
    assert (BUNDLED_MODEL / "README.md").is_file()


def test_dspark_without_a_draft_flag_serves_the_bundled_drafter():
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.build import build_core

    config = SchedulerConfig(speculative_algorithm="dspark", device="cpu", num_kv_blocks=16)
    assert config.model == str(BUNDLED_MODEL) and config.resolved_draft_model == str(BUNDLED_DRAFT_MODEL)
    proposer = build_core(config).worker.proposer
    assert proposer is not None and proposer.num_draft_tokens == 7 and proposer.capture_layers == (1, 2, 3)
