"""What `build_core` hands `load_model_runner` for a config, without loading anything: the tests
of each scheduler flag that reaches the loader read it from here."""

from __future__ import annotations

import pytest


def loader_options(monkeypatch: pytest.MonkeyPatch, config) -> dict:
    from services.scheduler import build

    class Loaded(Exception):
        pass

    def load(path, **options):
        raise Loaded(options)

    monkeypatch.setattr(build, "load_model_runner", load)
    with pytest.raises(Loaded) as loaded:
        build.build_core(config)
    return loaded.value.args[0]
