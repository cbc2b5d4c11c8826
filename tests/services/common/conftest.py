"""Fixtures shared by the tests of the services' common runtime."""

from __future__ import annotations

import logging

import pytest
import structlog


@pytest.fixture
def restore_logging():
    """Tests that call `configure_logging` leave the root logger and structlog as they found them."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()
