"""One stack (nats-server + the three services as processes) per test module, to keep CI short.

Modules that kill or restart services get their own stack by being their own module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.stack import Stack, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = start_stack(tmp_path_factory.mktemp("e2e-logs"))
    yield started
    started.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failing e2e test shows the services' last log lines."""
    report = yield
    stack = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(stack, Stack):
        report.sections.append(("service logs", stack.logs()))
    return report
