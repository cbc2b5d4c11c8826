"""`--dtype auto`: the checkpoint's own dtype (config.json `torch_dtype`, or `dtype` as transformers >= 5 writes it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.models import RANDOM_TINY_MODEL
from services.scheduler.config import SchedulerConfig


def model_with(tmp_path: Path, **keys) -> str:
    config = json.loads((RANDOM_TINY_MODEL / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    (tmp_path / "config.json").write_text(json.dumps({**config, **keys}))
    return str(tmp_path)


@pytest.mark.parametrize(("keys", "dtype"), [({"torch_dtype": "bfloat16"}, torch.bfloat16),
                                             ({"dtype": "float16"}, torch.float16), ({}, torch.float32)])  # fmt: skip
def test_auto_takes_the_checkpoints_dtype(tmp_path: Path, keys: dict, dtype: torch.dtype) -> None:
    assert SchedulerConfig(model=model_with(tmp_path, **keys), dtype="auto", device="cpu").torch_dtype == dtype


def test_auto_refuses_a_dtype_it_cannot_serve(tmp_path: Path) -> None:
    config = SchedulerConfig(model=model_with(tmp_path, torch_dtype="float8_e4m3fn"), dtype="auto", device="cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        config.torch_dtype


def test_named_dtypes_are_unchanged(tmp_path: Path) -> None:
    path = model_with(tmp_path, torch_dtype="bfloat16")
    assert SchedulerConfig(model=path, dtype="float32", device="cpu").torch_dtype == torch.float32
    assert SchedulerConfig(model=path, device="cpu").torch_dtype == torch.float32  # the device default
