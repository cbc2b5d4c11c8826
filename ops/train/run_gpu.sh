#!/usr/bin/env bash
# The whole bundled-model recipe (issue 11) in one GPU call, from the repository root:
#   bash ops/train/run_gpu.sh CORPUS_DIR TOKENIZER_DIR OUT [RECIPE]
# 1. the target twice from the same seed, both at once (each process is launch-bound, so the two
#    interleave on one GPU); 2. the drafter twice on run 1's target, both at once; 3. evaluation of
#    both pairs. OUT/results.tar gets everything small (re-packed after each phase, so a run cut
#    short still returns what finished); OUT/log is written by the caller (tee).
set -euo pipefail
corpus=$1 tokenizer=$2 out=$3 recipe=${4:-micro}
py=${PYTHON:-python3}
work=${WORK:-/tmp/sparkwire-train}
mkdir -p "$work"
export PYTHONUNBUFFERED=1
# Run 2's weights stay behind (16 MiB a file comes back): its JSON is what the reproducibility check needs.
pack() {
    (cd "$work" && tar cf "$out/results.tar.part" --exclude='*.log' --exclude='run2/*/model.safetensors' run1 run2 2>/dev/null \
        && mv "$out/results.tar.part" "$out/results.tar") || true
}
both() {  # both "name" command-with-RUN: runs it for run 1 and run 2 at once, then prints both logs
    local name=$1; shift
    for run in 1 2; do
        (RUN=$run; eval "$*") > "$work/$name$run.log" 2>&1 &
    done
    local status=0
    wait %1 || status=1
    wait %2 || status=1
    grep -hv 'it/s' "$work/${name}1.log" "$work/${name}2.log" | tail -n 20
    return $status
}
# Evaluation goes through the scheduler core, which needs the project's own dependencies (msgspec,
# structlog, ...): the GPU image lacks some, so carry them as wheels in .whl/ (see the device notes).
if [ -d .whl ]; then
    $py -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
$py -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'

both target '$py -m ops.train.train_target --corpus "$corpus" --tokenizer "$tokenizer" --recipe $recipe --seed 0 \
    --out "$work/run$RUN/sparkwire-micro" --results "$work/run$RUN/target.json"'
pack
both drafter '$py -m ops.train.train_drafter --corpus "$corpus" --target "$work/run1/sparkwire-micro" --recipe $recipe \
    --seed 0 --out "$work/run$RUN/sparkwire-micro-dspark" --results "$work/run$RUN/drafter.json"'
pack
$py -m ops.train.evaluate --corpus "$corpus" --model "$work/run1/sparkwire-micro" \
    --draft "$work/run1/sparkwire-micro-dspark" --out "$work/run1/eval_pair.json" 2>&1 | grep -v Loading
pack
$py -m ops.train.evaluate --corpus "$corpus" --model "$work/run2/sparkwire-micro" --out "$work/run2/eval_target.json" 2>&1 | grep -v Loading
pack
$py -m ops.train.evaluate --corpus "$corpus" --model "$work/run1/sparkwire-micro" --no-target \
    --draft "$work/run2/sparkwire-micro-dspark" --out "$work/run2/eval_pair.json" 2>&1 | grep -v Loading
pack
$py - "$work" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
for run in (1, 2):
    t = json.loads((work / f"run{run}/target.json").read_text())
    d = json.loads((work / f"run{run}/drafter.json").read_text())
    e = json.loads((work / f"run{run}/eval_pair.json").read_text())
    et = json.loads((work / f"run{run}/{'eval_pair' if run == 1 else 'eval_target'}.json").read_text())["target"]
    # run 2's drafter is trained and evaluated on run 1's target, so the drafter figures compare alone
    acc = {k: round(v["mean_accept_length"], 3) for k, v in e["drafter"].items() if k.startswith("temperature")}
    print(f"run{run}: target {t['parameters']:,} {t['train_seconds']}s loss {t['final_train_loss']:.3f}/{t['final_eval_loss']:.3f} "
          f"ppl {et['held_out']['perplexity']:.3f} bpb {et['held_out']['bits_per_byte']:.4f} shuffled ppl {et['shuffled']['perplexity']:.0f} | "
          f"drafter {d['parameters']:,} {d['train_seconds']}s loss {d['final_eval_loss']:.3f} tf-acc {d['final_eval_teacher_forced_greedy_accept']:.2f} | accept {acc}")
PY
