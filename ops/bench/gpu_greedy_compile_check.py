"""The first greedy logprob step of each batch rung after start-up: does it compile anything?

`sparkwire up` compiles the logprob kernels at start-up (`triton_logprobs.warm_kernels`, fresh
tensors), yet the first run on a fresh machine paid one logprob graph capture of 150-310 ms while
serving (`gpu_serve.md`, run 33). Triton compiles a kernel again for a pointer argument that is not
16-byte aligned, and `LogprobGraphs.greedy` writes its rows into one packed buffer whose columns
were back to back (at 1 or 2 rows, or some k, not 16-byte aligned). This runs, in a fresh Triton
cache, the warm-up as the service does it, then the first `LogprobGraphs.greedy` call of each rung
(captured, as served), timed: seconds well above a capture's ~5 ms are a compile.

    PYTHONPATH=. python ops/bench/gpu_greedy_compile_check.py --out $OUT/greedy_compile.json
    (cd OTHER_TREE && PYTHONPATH=. python $REPO/ops/bench/gpu_greedy_compile_check.py --out ...)   # the tree before
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")  # before triton is imported: a cold cache

import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.scheduler.logprob_graphs import LogprobGraphs  # noqa: E402
from services.scheduler.logprobs import LogprobQuery, TopKKeys, logprob_inputs  # noqa: E402
from services.scheduler.triton_logprobs import warm_kernels  # noqa: E402

VOCAB = 151_936  # Qwen3's
ROWS = (1, 2, 3, 4, 8, 24, 64)
KS = (20, 5)


def first_calls(device: torch.device) -> dict:
    start = time.perf_counter()
    warm_kernels(VOCAB, device, (torch.float32, torch.bfloat16))
    torch.cuda.synchronize()
    result = {"warm_s": round(time.perf_counter() - start, 3), "rows": []}
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, device), capture=True, fused=True)
    for k in KS:
        for rows in ROWS:
            logits = torch.randn(rows, VOCAB, device=device)
            queries = [LogprobQuery(np.asarray([i], np.int64), None, k, ()) for i in range(rows)]
            inputs = {name: torch.from_numpy(a).to(device) for name, a in logprob_inputs(queries, False, rows).items()}
            times = []
            for _ in range(2):  # the first call (capture, and any compile), then a replay
                torch.cuda.synchronize()
                begin = time.perf_counter()
                found = graphs.greedy(queries, inputs, logits, False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - begin)
            assert found is not None, (rows, k)
            result["rows"].append({"rows": rows, "k": k, "first_ms": round(1e3 * times[0], 1), "replay_ms": round(1e3 * times[1], 3)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "tree": str(Path.cwd()), **first_calls(torch.device("cuda"))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"warm-up {result['warm_s']} s")
    print("| k | rows | first call ms | replay ms |\n|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['k']} | {row['rows']} | {row['first_ms']} | {row['replay_ms']} |")


if __name__ == "__main__":
    main()
