"""Start-up progress: a tqdm bar on a terminal with console logs, log records everywhere else."""

from __future__ import annotations

import io
import json

from structlog.testing import capture_logs

from services.common.logging import configure_logging
from services.common.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(progress: Progress, sizes: list[int]) -> None:
    for index, size in enumerate(sizes):
        progress.advance(num_bytes=size, tensor=f"t{index}")
    progress.close()


def test_without_a_terminal_every_item_is_a_record_when_the_interval_allows():
    with capture_logs() as records:
        run(Progress("model.load", "tensors", 3, total_bytes=60, min_interval_s=0, stream=io.StringIO()), [10, 20, 30])
    progress = [r for r in records if r["event"] == "model.load.progress"]
    assert [(r["tensor"], r["tensors"], r["bytes"]) for r in progress] == [("t0", 1, 10), ("t1", 2, 30), ("t2", 3, 60)]
    assert all(r["num_tensors"] == 3 and r["total_bytes"] == 60 for r in progress)
    done = records[-1]
    assert done["event"] == "model.load.done" and (done["tensors"], done["bytes"]) == (3, 60) and done["seconds"] >= 0


def test_records_are_spaced_by_the_interval_so_a_log_file_is_not_spammed():
    stream = io.StringIO()
    with capture_logs() as records:
        run(Progress("model.load", "tensors", 500, total_bytes=500, min_interval_s=3600, stream=stream), [1] * 500)
    assert [r["event"] for r in records] == ["model.load.progress", "model.load.done"]  # the first item, the end
    assert stream.getvalue() == ""  # no bar where nobody watches


def test_a_terminal_with_console_logs_gets_a_bar(restore_logging, capsys):
    configure_logging("info", "console")
    terminal = Terminal()
    run(Progress("model.load", "tensors", 3, total_bytes=3 * 1024, stream=terminal), [1024] * 3)
    bar = terminal.getvalue()
    assert "model.load" in bar and "100%" in bar and "tensors 3/3" in bar
    out = capsys.readouterr().out
    assert "model.load.progress" not in out and "model.load.done" in out  # the bar replaces the records


def test_json_logs_get_records_even_on_a_terminal(restore_logging, capsys):
    configure_logging("info", "json")
    terminal = Terminal()
    run(Progress("cuda_graphs.capture", "graphs", 2, min_interval_s=0, stream=terminal), [0, 0])
    assert terminal.getvalue() == ""
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(line["event"], line["graphs"]) for line in lines] == [
        ("cuda_graphs.capture.progress", 1), ("cuda_graphs.capture.progress", 2), ("cuda_graphs.capture.done", 2),
    ]  # fmt: skip
    assert all(line["num_graphs"] == 2 and "bytes" not in line for line in lines)
