"""`sparkwire up` and the service commands: the operating flags (issue 14) reach the service that
uses them, parse with the real CLI, and every flag has help text."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from services.cli import build_parser
from services.common.connection import add_connection_arguments
from services.common.settings import connection_values
from services.launcher import service_argv

OPERATING = ["--served-model-name", "tiny-prod", "--max-model-len", "512", "--max-running-requests", "8",
             "--dtype", "bfloat16", "--kv-cache-memory-fraction", "0.5"]  # fmt: skip


def value_after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_up_passes_the_operating_flags_to_the_services_that_use_them():
    args = build_parser(["up", *OPERATING]).parse_args(["up", *OPERATING])
    scheduler, tokenizer, detokenizer = (service_argv(name, args) for name in ("scheduler", "tokenizer", "detokenizer"))
    assert [value_after(scheduler, f) for f in ("--max-model-len", "--max-running-requests", "--dtype",
                                                "--kv-cache-memory-fraction")] == ["512", "8", "bfloat16", "0.5"]  # fmt: skip
    assert value_after(tokenizer, "--served-model-name") == "tiny-prod" and value_after(tokenizer, "--max-model-len") == "512"
    assert "--served-model-name" not in scheduler and "--dtype" not in detokenizer
    for argv in (scheduler, tokenizer, detokenizer):
        parsed = build_parser(argv[3:]).parse_args(argv[3:])  # what the child parses
        assert callable(parsed.run)
    parsed = build_parser(scheduler[3:]).parse_args(scheduler[3:])
    assert (parsed.max_model_len, parsed.max_running_requests, parsed.dtype, parsed.kv_cache_memory_fraction) == (
        512, 8, "bfloat16", 0.5,
    )  # fmt: skip


def test_the_api_key_is_not_on_any_command_line():
    args = build_parser(["up", "--api-key", "sk-secret"]).parse_args(["up", "--api-key", "sk-secret"])
    assert args.api_key == "sk-secret"
    assert all("sk-secret" not in " ".join(service_argv(name, args)) for name in ("scheduler", "tokenizer", "detokenizer"))


def test_the_api_key_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPARKWIRE_API_KEY", "from-env")
    assert build_parser(["up"]).parse_args(["up"]).api_key == "from-env"
    assert build_parser(["tokenizer"]).parse_args(["tokenizer"]).api_key == "from-env"


@pytest.mark.parametrize("command", ["up", "tokenizer", "scheduler", "detokenizer"])
def test_every_flag_has_help_text(command):
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    missing = [a.option_strings[0] for a in sub._actions if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert missing == []


def test_a_bad_kv_cache_fraction_is_one_clear_line(capsys):
    argv = ["scheduler", "--kv-cache-memory-fraction", "1.5"]
    args = build_parser(argv).parse_args(argv)
    assert args.run(args) == 2
    assert "kv_cache_memory_fraction must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["tokenizer", "detokenizer", "scheduler"])
def test_a_bad_model_path_is_one_clear_line_not_a_traceback(command, tmp_path, capfd):
    argv = [command, "--model", str(tmp_path / "no-such-model")]
    args = build_parser(argv).parse_args(argv)
    assert args.run(args) == 2
    err = capfd.readouterr().err
    assert "no-such-model" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["tokenizer", "scheduler", "detokenizer"])
def test_every_service_takes_the_log_flags_with_the_environments_defaults(command, monkeypatch):
    monkeypatch.setenv("SPARKWIRE_LOG_FORMAT", "json")
    parsed = build_parser([command]).parse_args([command])
    assert (parsed.log_format, parsed.log_level) == ("json", "info")
    argv = [command, "--log-format", "console", "--log-level", "debug"]
    assert (lambda p: (p.log_format, p.log_level))(build_parser(argv).parse_args(argv)) == ("console", "debug")


@pytest.mark.parametrize(
    ("flag", "default"),
    [("ragged-cuda-graphs", True), ("logprob-cuda-graphs", True), ("greedy-logprob-graphs", True), ("fused-kernels", True),
     ("split-kv-decode", True)],
)
def test_up_passes_each_cuda_flag_to_the_scheduler_config(flag, default):
    from services.scheduler.__main__ import config_from_args

    for up, wanted in ((["up"], default), (["up", f"--{flag}"], True), (["up", f"--no-{flag}"], False)):
        scheduler = service_argv("scheduler", build_parser(up).parse_args(up))
        parsed = build_parser(scheduler[3:]).parse_args(scheduler[3:])
        assert (f"--{flag}" in scheduler) == wanted and getattr(config_from_args(parsed), flag.replace("-", "_")) == wanted


def test_every_scheduler_flag_of_up_reaches_the_scheduler_with_its_value(tmp_path):
    """Each flag `sparkwire up` shares with `sparkwire scheduler` (services/scheduler/flags.py),
    given a value other than its default, arrives in the scheduler's parsed arguments unchanged."""
    values = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float16", "--load-format", "dummy", "--quantization", "fp8",
              "--logprobs-mode", "processed", "--chunked-prefill-size", "4096", "--max-prefill-tokens", "9000", "--no-dense-prefill", "--dense-attention", "sdpa", "--max-running-requests", "7", "--no-overlap-decode", "--no-prefix-caching",
              "--max-model-len", "300", "--kv-cache-memory-fraction", "0.25", "--no-ragged-cuda-graphs",
              "--no-logprob-cuda-graphs", "--no-greedy-logprob-graphs", "--no-fused-kernels", "--no-fused-logprobs", "--no-split-kv-decode", "--speculative-algorithm", "dspark", "--draft-model", str(tmp_path / "d"),
              "--speculative-num-draft-tokens", "5", "--draft-context-window", "512", "--verify-mode", "compact",
              "--step-trace", str(tmp_path / "trace"), "--revision", "v2", "--deterministic", "--tp", "2"]  # fmt: skip
    up = build_parser(["up", *values]).parse_args(["up", *values])
    defaults = build_parser(["up"]).parse_args(["up"])
    scheduler_argv = service_argv("scheduler", up)[3:]
    scheduler = build_parser(scheduler_argv).parse_args(scheduler_argv)
    connection = argparse.ArgumentParser()
    add_connection_arguments(connection, connection_values())  # these travel in the child's environment
    # --trust-remote-code: refused by `up` itself, never handed on
    elsewhere = {"run", "command", "log_level", "log_format", "trust_remote_code", *vars(connection.parse_args([]))}
    shared = [name for name in vars(scheduler) if name in vars(up) and name not in elsewhere]
    assert {name: getattr(scheduler, name) for name in shared} == {name: getattr(up, name) for name in shared}
    assert all(getattr(up, name) != getattr(defaults, name) for name in shared), [n for n in shared if getattr(up, n) == getattr(defaults, n)]
    assert len(shared) >= 15, shared


def test_up_hands_the_model_source_flags_to_the_services_that_read_them(tmp_path):
    flags = ["--model", "org/name", "--revision", "v2", "--tokenizer", "org/tok", "--chat-template", str(tmp_path / "t.jinja")]
    args = build_parser(["up", *flags]).parse_args(["up", *flags])
    scheduler, tokenizer, detokenizer = (service_argv(name, args) for name in ("scheduler", "tokenizer", "detokenizer"))
    assert [value_after(argv, "--revision") for argv in (scheduler, tokenizer, detokenizer)] == ["v2"] * 3
    assert [value_after(argv, "--tokenizer") for argv in (scheduler, tokenizer, detokenizer)] == [None, "org/tok", "org/tok"]
    assert value_after(tokenizer, "--chat-template") == str(tmp_path / "t.jinja") and "--chat-template" not in detokenizer
    for argv in (scheduler, tokenizer, detokenizer):
        build_parser(argv[3:]).parse_args(argv[3:])  # each child takes what it is given


def test_up_refuses_remote_code_in_words(capsys):
    from services import launcher

    args = build_parser(["up", "--trust-remote-code"]).parse_args(["up", "--trust-remote-code"])
    assert launcher.main(args) == 2
    assert "--trust-remote-code is not supported" in capsys.readouterr().err


def test_up_refuses_fewer_than_one_tokenizer_in_words(capsys):
    from services import launcher

    args = build_parser(["up", "--tokenizers", "0"]).parse_args(["up", "--tokenizers", "0"])
    assert launcher.main(args) == 2
    assert "--tokenizers must be at least 1, got 0" in capsys.readouterr().err


def test_the_default_number_of_tokenizers_grows_with_the_cores_where_a_gpu_serves():
    from services.launcher import gpu_tokenizers, num_tokenizers

    def parsed(*flags):
        return build_parser(["up", *flags]).parse_args(["up", *flags])

    assert [gpu_tokenizers(cores) for cores in (1, 2, 8, 11, 12, 15, 16, 64)] == [2, 2, 2, 2, 3, 3, 4, 4]
    def sixteen():
        return 16

    assert num_tokenizers(parsed("--device", "cuda"), gpu_present=lambda: False, cores=sixteen) == 4
    assert num_tokenizers(parsed("--device", "cuda"), gpu_present=lambda: False, cores=lambda: 2) == 2
    assert num_tokenizers(parsed("--device", "cpu"), gpu_present=lambda: True, cores=sixteen) == 1
    assert num_tokenizers(parsed("--device", "auto"), gpu_present=lambda: True, cores=sixteen) == 4
    assert num_tokenizers(parsed("--device", "auto"), gpu_present=lambda: False, cores=sixteen) == 1
    assert num_tokenizers(parsed("--device", "cuda", "--tokenizers", "1"), gpu_present=lambda: True, cores=sixteen) == 1  # asked for


def test_usable_cores_are_this_process_s():
    from services.launcher import usable_cores

    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_more_than_one_tokenizer_share_the_port():
    one = build_parser(["up", "--device", "cpu"]).parse_args(["up", "--device", "cpu"])
    two = build_parser(["up", "--tokenizers", "2"]).parse_args(["up", "--tokenizers", "2"])
    assert "--reuse-port" not in service_argv("tokenizer", one) and "--reuse-port" in service_argv("tokenizer", two)
    assert "--reuse-port" not in service_argv("scheduler", two)


def test_the_children_s_relayed_lines_never_run_together(capsys):
    """Each child's output is relayed by its own thread: two chatty children, every line whole."""
    from services.supervision import Child

    script = "import sys\nfor i in range(20000): sys.stdout.write(f'line {i} of this child\\n')"
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the relay threads switch as often as they can
    try:
        children = [Child.start(name, [sys.executable, "-c", script], env=dict(os.environ)) for name in ("one", "two")]
        for child in children:
            assert child.process.wait(timeout=60) == 0
            child.reader.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    lines = capsys.readouterr().err.splitlines()
    for name in ("one", "two"):
        mine = [line for line in lines if line.startswith(f"[{name}] ")]
        assert mine == [f"[{name}] line {i} of this child" for i in range(20000)]
    assert len(lines) == 40000


def test_the_install_hint_names_this_python_and_where_the_project_comes_from(tmp_path):
    """Not from PyPI: from the checkout the code runs from, or, installed from a wheel, from one."""
    from services.cli import CHECKOUT, install_commands

    here = install_commands("/opt/py/bin/python3")
    assert here["then"] == f"/opt/py/bin/python3 -m pip install -e '{CHECKOUT}[scheduler]'"
    assert here["CPU only"].endswith("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    wheel = install_commands("/opt/py/bin/python3", checkout=tmp_path)  # no pyproject.toml there
    assert wheel["then"] == "/opt/py/bin/python3 -m pip install '<the sparkwire wheel or checkout>[scheduler]'"


@pytest.mark.parametrize("spelling", ["--deterministic", "--enable-deterministic-inference"])
def test_deterministic_and_its_peer_spelling_reach_the_scheduler_config(spelling, monkeypatch):
    from services.scheduler.__main__ import config_from_args

    for up, wanted in ((["up"], False), (["up", spelling], True)):
        scheduler = service_argv("scheduler", build_parser(up).parse_args(up))
        assert config_from_args(build_parser(scheduler[3:]).parse_args(scheduler[3:])).deterministic == wanted
    monkeypatch.setenv("SPARKWIRE_DETERMINISTIC", "1")
    assert build_parser(["up"]).parse_args(["up"]).deterministic
    monkeypatch.setenv("SPARKWIRE_DETERMINISTIC", "0")
    assert not build_parser(["up"]).parse_args(["up"]).deterministic
