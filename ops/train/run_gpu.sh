#!/usr/bin/env bash
# The bundled-model recipe (issue 11) on one GPU call, from the repository root:
#   bash ops/train/run_gpu.sh CORPUS_DIR OUT DEADLINE_S JOB [JOB ...]
# JOB (all jobs run at once: each process is mostly launch-bound, so they interleave on one GPU):
#   pair:RECIPE:RUN                      train the target (seed 0), then its drafter (seed 0) on it,
#                                        then evaluate the pair (perplexity, accept length at T=0, 1)
#   drafter:RECIPE:RUN:TARGET_DIR[:SETS] train a drafter (seed 0) on a trained target and evaluate it;
#                                        SETS = FIELD=VALUE,FIELD=VALUE (recipe overrides, `--set`)
# Every job writes under WORK/<recipe>-<run>[-<label>]/; OUT/results.tar holds everything small
# (re-packed every 20 s and at the end, so a call cut short still returns what finished;
# weights over 10 MB stay behind). At DEADLINE_S seconds jobs still running are stopped.
set -uo pipefail
corpus=$1 out=$2 deadline=$3; shift 3
py=${PYTHON:-python3}
work=${WORK:-/tmp/sparkwire-train}
mkdir -p "$work"
export PYTHONUNBUFFERED=1
# Evaluation goes through the scheduler core, which needs the project's own dependencies (msgspec,
# structlog, ...): the GPU image lacks some, so carry them as wheels in .whl/ (see the device notes).
if [ -d .whl ] && ! $py -c 'import msgspec' 2>/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-.}
fi
$py -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'
tokenizer=ops/models/sparkwire-micro  # the one tokenizer every recipe shares

pack() {
    (cd "$work" && find . -name '*.safetensors' -size +10M > "$work/.big" \
        && tar cf "$out/results.tar.part" --exclude='*.log' -X "$work/.big" --transform 's,^\./,,' . 2>/dev/null \
        && mv "$out/results.tar.part" "$out/results.tar") || true
}

evaluate() {  # evaluate DIR TARGET_DIR [--no-target]: on the GPU, else (say, a missing package) on the CPU
    local device status
    for device in auto cpu; do
        $py -m ops.train.evaluate --corpus "$corpus" --model "$2" --draft "$1/draft" ${3:-} --device $device \
            --out "$1/eval.json" > "$1/eval-$device.log" 2>&1
        status=$?
        [ $status -gt 128 ] && return $status  # stopped by a signal (the deadline): no CPU retry
        grep -v 'Loading\|model.load' "$1/eval-$device.log" | tail -n 20
        [ $status -eq 0 ] && return 0
    done
    return $status
}

run_job() {
    local kind recipe run target sets dir
    IFS=: read -r kind recipe run target sets <<< "$1"
    case $kind in
        pair)
            dir=$work/$recipe-$run
            mkdir -p "$dir"
            $py -m ops.train.train_target --corpus "$corpus" --tokenizer "$tokenizer" --recipe "$recipe" --seed 0 \
                --out "$dir/target" --results "$dir/target.json" || return 1
            $py -m ops.train.train_drafter --corpus "$corpus" --target "$dir/target" --recipe "$recipe" --seed 0 \
                --out "$dir/draft" --results "$dir/drafter.json" || return 1
            evaluate "$dir" "$dir/target" ;;
        drafter)
            dir=$work/$recipe-$run${sets:+-$(echo "$sets" | tr ',=' '__')}
            mkdir -p "$dir"
            local flags=()
            IFS=, read -ra pairs <<< "${sets:-}"
            for pair in "${pairs[@]}"; do flags+=(--set "$pair"); done
            $py -m ops.train.train_drafter --corpus "$corpus" --target "$target" --recipe "$recipe" --seed 0 \
                "${flags[@]}" --out "$dir/draft" --results "$dir/drafter.json" || return 1
            evaluate "$dir" "$target" --no-target ;;
        *) echo "unknown job $1"; return 2 ;;
    esac
}

pids=() names=()
for job in "$@"; do
    name=$(echo "$job" | tr ':/=,' '____')
    (run_job "$job") > "$work/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
done
while [ "$SECONDS" -lt "$deadline" ] && jobs -r | grep -q .; do
    sleep 20
    pack
    echo "[$SECONDS s] running: $(jobs -r | wc -l)"
done
stopped=()
for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null && stopped+=("$i"); done
for i in "${stopped[@]}"; do pkill -P "${pids[$i]}"; done  # the jobs' python processes: their subshells' children
sleep 1
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; status=$?
    if [[ " ${stopped[*]} " == *" $i "* ]]; then echo "== ${names[$i]}: STOPPED at the deadline"; else echo "== ${names[$i]}: exit $status"; fi
    grep -hv 'it/s\|^\s*$' "$work/${names[$i]}.log" | tail -n 12
done
pack
$py -m ops.train.summarize "$work" | tee "$out/summary.txt"
