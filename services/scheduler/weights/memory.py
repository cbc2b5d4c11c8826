"""Release and resume the scheduler's memory (SGLang's release/resume_memory_occupation, vLLM's
sleep levels 1 and 2): the KV caches' storage is freed and later allocated again (empty: nothing
is held across a release), the weights' device storage is offloaded to the host and copied back.
Storage is resized in place, so every tensor object (and every view of it) stays valid."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from services.scheduler.weights.tensors import dspark_proposer
from services.scheduler.worker import ModelWorker


@dataclass
class Released:
    """What a release freed, to give back on resume."""

    caches: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, its storage bytes)
    weights: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device tensor, host copy)
    pointers: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # every freed storage's address before


def kv_tensors(worker: ModelWorker) -> list[torch.Tensor]:
    """The paged KV caches: the target's and, under DSpark, the drafter's."""
    caches = [worker.runner.kv_cache.kv]
    drafter_cache = getattr(dspark_proposer(worker), "kv_cache", None)
    return caches + ([drafter_cache.kv] if drafter_cache is not None else [])


def weight_tensors(worker: ModelWorker) -> list[torch.Tensor]:
    modules = [worker.runner.model, getattr(dspark_proposer(worker), "drafter", None)]
    seen: dict[int, torch.Tensor] = {}
    for module in filter(None, modules):
        for param in module.parameters():
            seen.setdefault(param.untyped_storage().data_ptr(), param)
    return list(seen.values())


def release(worker: ModelWorker, weights: bool) -> Released:
    """Free the KV caches' storage (and, on CUDA with `weights`, the weights' after a host copy)."""
    released = Released()
    for tensor in kv_tensors(worker):
        storage = tensor.untyped_storage()
        released.caches.append((tensor, storage.nbytes()))
        released.pointers.append((tensor, storage.data_ptr()))
        storage.resize_(0)
    if weights and worker.runner.device.type == "cuda":
        for param in weight_tensors(worker):
            released.weights.append((param, param.detach().to("cpu", copy=True)))
            released.pointers.append((param, param.untyped_storage().data_ptr()))
            param.untyped_storage().resize_(0)
    _settle(worker.runner.device)
    return released


@torch.no_grad()
def resume(worker: ModelWorker, released: Released) -> None:
    for tensor, nbytes in released.caches:
        tensor.untyped_storage().resize_(nbytes)
        tensor.zero_()
    for param, host in released.weights:
        param.untyped_storage().resize_(host.untyped_storage().nbytes())
        param.copy_(host)
    runner = worker.runner
    moved = any(tensor.untyped_storage().data_ptr() != pointer for tensor, pointer in released.pointers)
    if runner.device.type == "cuda" and moved:  # captured graphs read the old addresses: run eager from here
        runner.drop_decode_graphs()
        runner.drop_ragged_graphs()
        if hasattr(worker.proposer, "drop_graphs"):
            worker.proposer.drop_graphs()
    _settle(runner.device)


def used_bytes(device: torch.device) -> int:
    """Memory in use, measured: the device's (CUDA) or this process's resident set (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
