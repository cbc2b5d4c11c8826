"""The confidence head's calibration (DSpark's STS): the temperature tau with c = sigmoid(logit / tau).

Held-out drafts of a trained pair: the first tokens of the repository's own Python files (as
`dspark-accept`; the bundled pair trained on other text), continued greedily by the target; the
target's captured layers over each whole sequence, then the drafter's teacher-forced blocks at
every `--anchor-stride`-th position (`forward_train`, the serving math). A slot's outcome is
whether its draft (the argmax) equals the target's next token, i.e. whether greedy verification
keeps it once the drafts before it were kept: what c_k estimates. tau is the grid's (41 values,
0.1 .. 10) lowest expected calibration error (10 bins); the ECE at tau = 1 is reported beside it.
`--save` writes tau beside the drafter (dspark_sts.json), where the scheduler reads it.

    sparkwire bench dspark-sts --out $OUT/dspark_sts.json   # the bundled pair (CPU is fine)
    sparkwire bench dspark-sts --model M --draft D --device cuda --save --out $OUT/dspark_sts.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.scheduler import SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import RESULTS, bench_dtype, device_name, ragged_step, script, write_json
from ops.bench.dspark_context_accept import repository_prompts
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from services.scheduler.model.loader import load_model_runner
from services.scheduler.spec.calibration import expected_calibration_error, fit_temperature, save_temperature
from services.scheduler.spec.dspark_model import draft_targets


def continuations(runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt with the target's greedy continuation (plain decoding through the core)."""
    core = harness.core_for(runner, max_running_requests=len(prompts), chunked_prefill_size=4096)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    for rid, prompt in tokens.items():
        core.add(harness.new_request(rid, np.asarray(prompt, np.int32), sampling))
    while core.has_work():
        for output in core.step():
            tokens[output.rid].extend(output.new_token_ids)
    return list(tokens.values())


@torch.inference_mode()
def slot_outcomes(runner, drafter, ids: list[int], stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence logits [N], outcomes [N]) of every valid slot of the blocks anchored every `stride` positions."""
    page = runner.block_size
    batch = ragged_step([(0, len(ids))], page, -(-len(ids) // page), runner.device.type)
    batch = dataclasses.replace(batch, input_ids=torch.tensor(ids, device=runner.device),
                                capture_layers=tuple(drafter.config.target_layer_ids))  # fmt: skip
    hidden = runner.forward(batch).captured[None].to(drafter.fc.weight.dtype)  # [1, S, K*H]
    input_ids = torch.tensor([ids], device=runner.device)  # [1, S]
    anchors = torch.arange(0, len(ids) - 1, stride, device=runner.device)[None]  # [1, A]
    out = drafter.forward_train(hidden, input_ids, anchors)
    labels, valid = draft_targets(input_ids, anchors, drafter.num_draft_tokens)  # [1, A, gamma]
    hits = (out.logits.argmax(dim=-1) == labels).float()
    return out.confidence[valid].float().cpu(), hits[valid].cpu()


def table(result: dict) -> str:
    return "\n".join([
        "| slots | accepted share | tau | ECE at tau | ECE at 1 |", "|---|---|---|---|---|",
        f"| {result['slots']} | {result['accepted_share']:.3f} | {result['temperature']:.3f} | {result['ece']:.4f} | "
        f"{result['ece_at_1']:.4f} |",
    ])  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="the trained target")
    parser.add_argument("--draft", type=Path, default=BUNDLED_DRAFT_MODEL, help="its DSpark drafter (with a confidence head)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--anchor-stride", type=int, default=3)
    parser.add_argument("--save", action="store_true", help="write tau beside the drafter (DRAFT/dspark_sts.json)")
    parser.add_argument("--out", type=Path, default=RESULTS / "dspark_sts.json")


def main(args: argparse.Namespace) -> int:
    runner = load_model_runner(args.model, device=args.device, dtype=bench_dtype(args.device), cuda_graphs=False)
    drafter = harness.dspark_drafter(runner, args.draft)
    if drafter.confidence_head is None:
        raise SystemExit(f"{args.draft}: the drafter has no confidence head (enable_confidence_head)")
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    sequences = continuations(runner, repository_prompts(tokenizer, args.num_prompts, args.prompt_len), args.new_tokens)
    logits, outcomes = map(torch.cat, zip(*(slot_outcomes(runner, drafter, ids, args.anchor_stride) for ids in sequences)))
    temperature, ece = fit_temperature(logits, outcomes)
    result = {"device": device_name(args.device), "model": str(args.model), "draft": str(args.draft), "slots": len(outcomes),
              "accepted_share": float(outcomes.mean()), "temperature": temperature, "ece": ece,
              "ece_at_1": expected_calibration_error(logits.sigmoid(), outcomes)}  # fmt: skip
    if args.save:
        result["saved"] = str(save_temperature(args.draft, temperature, ece=ece, slots=len(outcomes), model=args.model.name))
    write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
