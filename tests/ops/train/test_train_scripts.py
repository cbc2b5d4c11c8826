"""Every training script end to end at the toy size on CPU, so the recipe cannot rot unseen."""

from __future__ import annotations

import json

import pytest
import torch

from ops.train import evaluate, train_drafter, train_target
from services.scheduler.model.loader import load_model_runner
from services.scheduler.spec.dspark_loader import load_dspark_proposer
from tests.plain_forward import reference_logprobs


@pytest.fixture(scope="module")
def toy_pair(toy_corpus, toy_tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    target_args = ["--corpus", str(toy_corpus), "--tokenizer", str(toy_tokenizer_dir), "--recipe", "toy", "--device", "cpu"]
    assert train_target.main([*target_args, "--out", str(out / "target"), "--results", str(out / "target.json")]) == 0
    drafter_args = ["--corpus", str(toy_corpus), "--target", str(out / "target"), "--recipe", "toy", "--device", "cpu"]
    assert train_drafter.main([*drafter_args, "--out", str(out / "draft"), "--results", str(out / "drafter.json")]) == 0
    return out


def test_target_is_a_transformers_checkpoint_the_runtime_serves_identically(toy_pair):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(toy_pair / "target", dtype=torch.float32).eval()
    ids = list(range(4, 40))
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    runner = load_model_runner(toy_pair / "target", num_kv_blocks=4, kv_block_size=16)
    torch.testing.assert_close(reference_logprobs(runner, ids), expected, atol=1e-4, rtol=0)


def test_training_results_record_the_loss_history(toy_pair):
    target = json.loads((toy_pair / "target.json").read_text())
    assert [step for step, _ in target["history"]["train"]] == [4]  # toy: 4 steps, logged at the end
    assert [step for step, _ in target["history"]["eval"]] == [2, 4]
    assert target["final_train_loss"] < 1.5 * torch.log(torch.tensor(400.0)).item()
    drafter = json.loads((toy_pair / "drafter.json").read_text())
    assert drafter["loss_weights"] == {"ce": 0.1, "tv": 0.9, "bce": 1.0} and drafter["position_decay"] == 4.0
    assert drafter["distilled_sequences"] > 0 and len(drafter["history"]["eval"]) == 2


def test_drafter_is_a_dspark_checkpoint_the_runtime_loads(toy_pair):
    config = json.loads((toy_pair / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    runner = load_model_runner(toy_pair / "target", num_kv_blocks=4, kv_block_size=16)
    proposer = load_dspark_proposer(toy_pair / "draft", runner)
    assert proposer.capture_layers == (0, 1) and proposer.num_draft_tokens == 4


def test_evaluation_scores_held_out_text_and_accept_lengths(toy_pair, toy_corpus):
    figures = evaluate.evaluate_target(toy_pair / "target", toy_corpus, torch.device("cpu"))
    assert figures["held_out"]["tokens"] > 0 and figures["held_out"]["bits_per_byte"] > 0
    assert figures["shuffled"]["tokens"] == figures["held_out"]["tokens"]
    drafts = evaluate.evaluate_drafter(toy_pair / "target", toy_pair / "draft", toy_corpus, torch.device("cpu"),
                                       num_prompts=2, new_tokens=6)  # fmt: skip
    for temperature in ("0", "1"):
        accept = drafts[f"temperature_{temperature}"]
        assert accept["tokens_after_first"] == 2 * 5
        assert 1.0 <= accept["mean_accept_length"] <= 5.0  # gamma 4: at most 4 drafts + the bonus per forward
