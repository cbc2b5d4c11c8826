"""What the training scripts share: seeding, the token stream, batches, the schedule, the outputs."""

from __future__ import annotations

import json
import math
import platform
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ops.train.corpus import read_split
from ops.train.tokenizer import END_OF_TEXT


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device) -> torch.autocast:
    """bf16 matmuls on CUDA (master weights stay fp32); plain fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def load_hf_target(model_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The target as transformers loads it (so every use also checks the checkpoint is HF-loadable)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_stream(tokenizer: Tokenizer, corpus_dir: Path, split: str) -> torch.Tensor:
    """Every document of a split, each followed by END_OF_TEXT, as one int64 tensor [N]."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    docs = encode_documents(tokenizer, [text for _, text in read_split(corpus_dir, split)])
    return torch.tensor([token for doc in docs for token in (*doc, eot)], dtype=torch.int64)


def sample_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] windows of the stream at uniformly random starts (drawn on the host)."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return stream[starts[:, None] + torch.arange(length)]


def eval_windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping [n, length] windows from the start (the tail is dropped)."""
    count = stream.numel() // length if limit is None else min(limit, stream.numel() // length)
    return stream[: count * length].view(count, length)


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine down to floor·peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, mininterval=2.0, dynamic_ncols=False, ncols=100)


def write_loss_curve(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> bool:
    """A PNG of each named (step, loss) curve; False (and no file) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        if points:
            axes.plot(*zip(*points), label=name)
    axes.set(xlabel="step", ylabel="loss", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def environment() -> dict:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__, "device": device}


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
