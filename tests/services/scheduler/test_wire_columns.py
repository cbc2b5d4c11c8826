"""A batch's output logprob columns cut from the step's readback columns (`logprob_rows._span_columns`)
hold byte for byte what joining each request's arrays gives (`_joined_columns`), over a core's real steps:
decodes and prefill chunks, requests with and without logprobs, one k or two, one detokenizer (the
step's columns as they are) or two (a gather of their rows)."""

from __future__ import annotations

import dataclasses

import numpy as np

from contracts.scheduler import LogprobParams
from services.common import logprob_rows
from services.common.logprob_rows import RowSpan
from test_scheduler_core import prompt_of, request

TOP20 = LogprobParams(return_logprob=True, top_logprobs_num=20)
TOP5_IDS = LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))


def _fields(columns) -> dict:
    return {name: None if (v := getattr(columns, name)) is None else (v.dtype, tuple(v.shape), bytes(v.data))
            for name in columns.__struct_fields__}  # fmt: skip


def assert_columns_agree(outputs) -> dict[str, int]:
    """Per detokenizer group of one step's outputs with columns: the source path's columns equal
    the joined ones; how often it took them ("source") or fell back ("joined")."""
    taken = {"source": 0, "joined": 0}
    groups: dict[str, list] = {}
    for output in outputs:
        groups.setdefault(output.detokenizer_id, []).append(output)
    for group in groups.values():
        rows = [None if o.logprobs is None else o.logprobs.output for o in group]
        present = [r for r in rows if r is not None]
        if len(present) < 2:
            continue
        source = present[0].source if present[0].__class__ is RowSpan else None
        if source is None or not all(r.__class__ is RowSpan and r.source is source for r in present):
            taken["joined"] += 1
            continue
        cut, joined = logprob_rows._span_columns(rows, source), logprob_rows._joined_columns(rows, present)
        assert _fields(cut) == _fields(joined)
        taken["source"] += 1
    return taken


def _run(core, requests) -> dict[str, int]:
    taken = {"source": 0, "joined": 0}
    for r in requests:
        core.add(r)
    while core.has_work():
        for name, count in assert_columns_agree(core.step()).items():
            taken[name] += count
    return taken


def _requests(kinds, num_detokenizers: int) -> list:
    return [
        dataclasses.replace(request(f"r{i}", prompt_of(40 + i, 5 + 3 * i), max_new_tokens=3 + i % 5, ignore_eos=True,
                                    logprobs=kinds[i % len(kinds)]), detokenizer_id=f"d{i % num_detokenizers}")  # fmt: skip
        for i in range(8)
    ]


def test_one_detokenizer_of_top20_requests_sends_the_steps_columns(make_core):
    taken = _run(make_core(chunked_prefill_size=24), _requests([TOP20, None], 1))
    assert taken["source"] > 0 and taken["joined"] == 0


def test_two_detokenizers_gather_their_rows_of_the_steps_columns(make_core):
    taken = _run(make_core(chunked_prefill_size=24), _requests([TOP20, TOP20, None], 2))
    assert taken["source"] > 0 and taken["joined"] == 0


def test_requests_of_different_widths_fall_back_to_joining_their_arrays(make_core):
    taken = _run(make_core(chunked_prefill_size=24), _requests([TOP20, TOP5_IDS], 1))
    assert taken["joined"] > 0  # k 5 < 20: its rows are cut copies, no view of the step's columns


def test_source_rows_of_runs_and_of_every_row_in_order():
    assert logprob_rows._source_rows([0, 1, 2], [1, 1, 1], 3) is None  # all rows in order
    assert logprob_rows._source_rows([0, 1, 2], [1, 0, 1, 1], 3) is None  # a request without rows between them
    assert logprob_rows._source_rows([], [0, 0], 0) is None
    assert logprob_rows._source_rows([0, 2], [1, 1], 3).tolist() == [0, 2]
    assert logprob_rows._source_rows([1, 0], [1, 1], 2).tolist() == [1, 0]  # two detokenizers' requests interleaved
    assert logprob_rows._source_rows([4, 0], [2, 0, 3], 6).tolist() == [4, 5, 0, 1, 2]  # verify blocks
    assert logprob_rows._source_rows([0, 3], [3, 1], 5).tolist() == [0, 1, 2, 3]  # the last row unused
    assert logprob_rows._source_rows([0, 3], [3, 2], 5) is None  # runs that make up every row in order
