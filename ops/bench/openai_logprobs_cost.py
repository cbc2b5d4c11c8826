"""What the tokenizer's logprobs objects cost per token: OpenAI's (`openai_format`: the position
rows from the wire arrays, then the completions object, `completion_logprobs`, or the chat items,
`chat_content`) and `/generate`'s output fields (`logprobs_format`: `token_triples`, `top_rows`),
then JSON (`json_body.encode_json`), for the bundled model's vocabulary, random ids, top-k of
--top-k, in calls of --tokens tokens (1: a streamed chunk; 128: a whole response); each figure the
best of 5 rounds of --repeats calls.

With --before DIR (another checkout, e.g. a `git worktree` of the previous commit), the same
timing runs there too, in a child process with DIR first on the path, in the same run: a row per
tree. Every tree's JSON bytes must equal this tree's (the format is not allowed to change).

    python -m ops.bench.openai_logprobs_cost --before /work/wt/before --out ops/bench/results/openai_logprobs_cost.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


ROUNDS = 5  # each figure: the best of this many rounds of `repeats` calls (the dev box is shared)


def _per_call_us(build, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        build()
    return 1e6 * (time.perf_counter() - start) / repeats


def time_formats(top_ks: list[int], token_counts: list[int], repeats: int, null_first: bool = False, heap: int = 0) -> list[dict]:
    """µs per token of each format (best of `ROUNDS`), in whichever tree `services` is imported from.
    null_first: the first position has no value and a null top-k row, as a prompt's first does
    (echo + logprobs, prompt logprobs). heap: that many small lists kept alive meanwhile, as a
    server holds its state (the cyclic GC's full collections walk all of them: a tokenizer with the
    bundled model holds ~73k tracked objects before any request)."""
    held = [[index] for index in range(heap)]  # noqa: F841 -- alive until the timing is done
    from services.models import BUNDLED_MODEL
    from services.tokenizer import logprobs_format, openai_format
    from services.tokenizer.json_body import encode_json
    from services.tokenizer.text_model import TextModel

    model = TextModel.from_dir(BUNDLED_MODEL)
    rows = []
    for k in top_ks:
        for tokens in token_counts:
            rng = np.random.default_rng(k * 1000 + tokens)
            ids = rng.integers(0, model.vocab_size, tokens).tolist()
            top_i = rng.integers(0, model.vocab_size, (tokens, k)).astype(np.int32)
            top_v = -rng.random((tokens, k)).astype(np.float32)
            values = -rng.random(tokens).astype(np.float32)
            if null_first:
                values[0], top_i[0] = np.nan, -1

            def completion() -> bytes:
                positions = openai_format._positions(values, ids, top_v, top_i)
                return encode_json(openai_format.completion_logprobs(positions, model, openai_format.visible_bytes(ids, model, True)))

            def chat() -> bytes:
                return encode_json({"content": openai_format.chat_content(openai_format._positions(values, ids, top_v, top_i), model)})

            def generate() -> bytes:
                return encode_json({"output_token_logprobs": logprobs_format.token_triples(values, ids, None),
                                    "output_top_logprobs": logprobs_format.top_rows(top_v, top_i, None)})  # fmt: skip

            for name, build in (("completion", completion), ("chat", chat), ("generate", generate)):
                body = build()  # first call: any table built on first use is built here, outside the timing
                us = min(_per_call_us(build, repeats) for _ in range(ROUNDS)) / tokens
                rows.append({"format": name, "top_k": k, "tokens": tokens, "us_per_token": round(us, 2),
                             "json_sha256": hashlib.sha256(body).hexdigest()})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict:
    trees = {"this": time_formats(args.top_k, args.tokens, args.repeats, args.null_first, args.heap)}
    if args.before is not None:
        from ops.bench.other_tree import run_on_tree  # the parent's only: the child imports from the other tree

        argv = ["--rows-only", "--repeats", str(args.repeats), "--top-k", *map(str, args.top_k), "--tokens", *map(str, args.tokens),
                *(["--null-first"] if args.null_first else []), "--heap", str(args.heap)]  # fmt: skip
        trees = {"before": run_on_tree(__file__, args.before, argv), **trees}
    reference = {(r["format"], r["top_k"], r["tokens"]): r["json_sha256"] for r in trees["this"]}
    result = {"trees": trees, "same_json": all(reference[(r["format"], r["top_k"], r["tokens"])] == r["json_sha256"]
                                               for rows in trees.values() for r in rows)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def table(result: dict) -> str:
    trees = list(result["trees"])
    lines = ["| format | top-k | tokens a call | " + " | ".join(f"µs/token, {t}" for t in trees) + " |",
             "|---|---|---|" + "---|" * len(trees)]  # fmt: skip
    for index, row in enumerate(result["trees"]["this"]):
        figures = " | ".join(str(result["trees"][t][index]["us_per_token"]) for t in trees)
        lines.append(f"| {row['format']} | {row['top_k']} | {row['tokens']} | {figures} |")
    return "\n".join(lines + [f"same JSON in every tree: {result['same_json']}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", type=int, nargs="*", default=[5, 20])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 128])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--before", type=Path, default=None, help="another checkout, timed in the same run")
    parser.add_argument("--null-first", action="store_true", help="the first position null, as a prompt's first is")
    parser.add_argument("--heap", type=int, default=0, help="small lists kept alive while timing, as a server's state")
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/openai_logprobs_cost.json")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # the --before child: rows as JSON
    args = parser.parse_args(argv)
    if args.rows_only:
        print(json.dumps(time_formats(args.top_k, args.tokens, args.repeats, args.null_first, args.heap)))
        return 0
    result = run(args)
    return 0 if result["same_json"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
