"""Controls the core runs between steps (services/scheduler/between_steps.py), and the pushed
pieces' assembly (services/scheduler/weights/pieces.py), without NATS."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from contracts.weights import TensorSpec, WeightCommit, WeightTarget
from services.scheduler.between_steps import Control
from services.scheduler.weights import pieces as staging
from services.scheduler.weights.pieces import IncompleteVersion, PushedVersions
from services.scheduler.weights.tensors import WeightMismatch, check_shapes
from services.weights.push import manifest, pieces
from test_scheduler_core import prompt_of, request


def step_until_idle(core, on_output) -> None:
    for _ in range(500):
        if not core.has_work():
            return
        for output in core.step():
            on_output(output)
    raise AssertionError("core did not finish")


def test_a_draining_control_runs_once_nothing_is_held_and_arrivals_wait_for_it(make_core):
    core = make_core()  # overlapped decoding on: a step is in flight between steps
    events: list[tuple[str, object]] = []

    def control(c) -> list:
        events.append(("control", (len(c.policy.held()), c.has_in_flight)))
        return []

    core.add(request("a", prompt_of(1, 9), max_new_tokens=8, ignore_eos=True))
    for _ in range(3):
        core.step()
    done = core.controls.add(Control(control, drain=True))
    core.add(request("b", prompt_of(2, 9), max_new_tokens=4, ignore_eos=True))
    step_until_idle(core, lambda o: events.append((o.rid, o.finish is not None)))
    ran = events.index(("control", (0, False)))  # nothing held, nothing in flight
    assert ("a", True) in events[:ran] and all(rid != "b" for rid, _ in events[:ran])
    assert ("b", True) in events[ran:] and done.result() == 0


def test_a_paused_core_holds_arrivals_and_still_applies_aborts(make_core):
    core = make_core()
    core.add(request("a", prompt_of(3, 9), max_new_tokens=50, ignore_eos=True))
    core.step()
    core.controls.add(Control(lambda c: (setattr(c.controls, "paused", True), [])[1]))
    core.step()  # collects what was in flight; the control runs in the next step
    core.step()
    core.add(request("b", prompt_of(4, 9), max_new_tokens=4, ignore_eos=True))
    assert core.controls.paused and not core.has_work()
    core.abort("a", "abort")
    assert core.has_work()
    finished = [o.rid for o in core.step() if o.finish is not None]
    assert finished == ["a"] and not core.has_work()  # b waits in the inbox
    core.controls.paused = False
    got: list[str] = []
    step_until_idle(core, lambda o: got.append(o.rid))
    assert "b" in got


def test_a_failing_control_reports_its_error_and_the_core_goes_on(make_core):
    core = make_core()
    done = core.controls.add(Control(lambda c: 1 / 0))
    core.step()
    with pytest.raises(ZeroDivisionError):
        done.result()
    got: list[str] = []
    core.add(request("a", prompt_of(5, 5), max_new_tokens=2, ignore_eos=True))
    step_until_idle(core, lambda o: got.append(o.rid))
    assert got[-1] == "a"


TENSORS = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "n": torch.ones(5, dtype=torch.bfloat16)}


def commit(push_id: str = "p") -> WeightCommit:
    return WeightCommit(push_id, tuple(TENSORS))


def test_pieces_reassemble_into_the_pushed_tensors():
    versions = PushedVersions()
    for piece in pieces(TENSORS, "p", WeightTarget.MODEL, piece_bytes=8):
        versions.add(piece)
    got = versions.take(commit())
    assert all(torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype for name, tensor in TENSORS.items())


def test_the_next_push_is_staged_in_the_buffers_of_the_last_one_once_recycled():
    versions = PushedVersions()
    staged = []
    for push_id, recycled in (("p1", True), ("p2", False), ("p3", True)):
        for piece in pieces(TENSORS, push_id, WeightTarget.MODEL, piece_bytes=8):
            versions.add(piece)
        got = versions.take(commit(push_id))
        assert all(torch.equal(got[name], tensor) for name, tensor in TENSORS.items())
        staged.append({name: t.data_ptr() for name, t in got.items()})
        if recycled:
            versions.recycle()
    assert staged[1] == staged[0]  # p1 was swapped and recycled: p2 reuses its buffers
    assert not set(staged[2].values()) & set(staged[1].values())  # p2 was not recycled (still being swapped): never written


@pytest.mark.parametrize("fault", ["dropped", "checksum", "gap"])
def test_a_faulty_push_is_refused_with_its_reason(fault):
    versions = PushedVersions()
    parts = list(pieces(TENSORS, "p", WeightTarget.MODEL, piece_bytes=8))
    if fault == "dropped":
        del parts[2]
    if fault == "checksum":
        parts[2] = msgspec.structs.replace(parts[2], xxh3=parts[2].xxh3 ^ 1)
    for index, piece in enumerate(parts):
        versions.add(piece, missed=int(fault == "gap" and index == 3))
    reason = {"dropped": "bytes arrived", "checksum": "checksum", "gap": "lost in transit"}[fault]
    with pytest.raises(IncompleteVersion, match=reason):
        versions.take(commit())


def test_a_manifest_allocates_every_buffer_before_any_piece_arrives(monkeypatch):
    allocated: list[int] = []
    allocate = staging._allocate
    monkeypatch.setattr(staging, "_allocate", lambda nbytes: allocated.append(nbytes) or allocate(nbytes))
    versions = PushedVersions()
    versions.plan(manifest(TENSORS, "p1", WeightTarget.MODEL))
    for _ in range(1000):  # the pool allocates them in the background
        if len(allocated) == len(TENSORS):
            break
        time.sleep(0.01)
    assert sorted(allocated) == sorted(t.numel() * t.element_size() for t in TENSORS.values())
    for piece in pieces(TENSORS, "p1", WeightTarget.MODEL, piece_bytes=8):
        versions.add(piece)
    got = versions.take(commit("p1"))
    assert all(torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype for name, tensor in TENSORS.items())
    assert len(allocated) == len(TENSORS)  # the pieces allocated nothing more
    first = {name: t.data_ptr() for name, t in got.items()}
    versions.recycle()
    versions.plan(manifest(TENSORS, "p2", WeightTarget.MODEL))  # the next push: the spare buffers, nothing allocated
    for piece in pieces(TENSORS, "p2", WeightTarget.MODEL, piece_bytes=8):
        versions.add(piece)
    assert {name: t.data_ptr() for name, t in versions.take(commit("p2")).items()} == first
    assert len(allocated) == len(TENSORS)


@pytest.mark.parametrize("fault", ["shape", "dtype", "unlisted", "late_and_right"])
def test_pieces_that_disagree_with_their_manifest_are_refused(fault):
    listed = manifest(TENSORS, "p", WeightTarget.MODEL)
    wrong = {"shape": TensorSpec("n", "bfloat16", (6,)), "dtype": TensorSpec("n", "float16", (5,))}
    kept = [spec for spec in listed.tensors if fault != "unlisted" or spec.name != "n"]
    specs = tuple(wrong.get(fault, spec) if spec.name == "n" else spec for spec in kept)
    versions = PushedVersions()
    parts = list(pieces(TENSORS, "p", WeightTarget.MODEL, piece_bytes=8))
    late = fault == "late_and_right"  # a piece overtook the manifest (it came on another connection): staged all the same
    for piece in parts[:1] if late else []:
        versions.add(piece)
    versions.plan(msgspec.structs.replace(listed, tensors=specs))
    for piece in parts[1:] if late else parts:
        versions.add(piece)
    if late:
        got = versions.take(commit())
        assert all(torch.equal(got[name], tensor) for name, tensor in TENSORS.items())
        return
    reason = {"shape": r"shape \[5\] bfloat16 but the push's manifest declared \[6\]", "dtype": "manifest declared \\[5\\] float16",
              "unlisted": "manifest does not list"}[fault]  # fmt: skip
    with pytest.raises(IncompleteVersion, match=reason):
        versions.take(commit())


def test_new_weights_of_another_shape_name_the_first_tensor_at_fault():
    served = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_shapes(served, {"a": ((2, 3), "float32"), "b": ((4,), "bfloat16")})
    with pytest.raises(WeightMismatch, match="'b' has shape \\[5\\]"):
        check_shapes(served, {"a": ((2, 3), "float32"), "b": ((5,), "float32")})
    with pytest.raises(WeightMismatch, match="'b' is missing"):
        check_shapes(served, {"a": ((2, 3), "float32")})
    with pytest.raises(WeightMismatch, match="'c' is not one"):
        check_shapes(served, {"a": ((2, 3), "float32"), "b": ((4,), "float32"), "c": ((1,), "float32")})
    with pytest.raises(WeightMismatch, match="'a' is I8"):
        check_shapes(served, {"a": ((2, 3), "I8"), "b": ((4,), "float32")})


def test_the_drafters_weights_update_apart_from_the_targets(make_core, tiny_runner, tmp_path):
    from services.scheduler.spec.dspark import DSparkProposer
    from services.scheduler.spec.dspark_config import draft_config_for_target
    from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights, save_drafter
    from services.scheduler.weights.tensors import copy_weights, read_safetensors, served_tensors
    from test_scheduler_core import run

    config = draft_config_for_target(tiny_runner.config, num_draft_layers=1, mask_token_id=5, block_size=4, markov_rank=8)
    drafters = [empty_drafter(config, tiny_runner.model.model.embed_tokens, tiny_runner.lm_head_weight) for _ in range(2)]
    for seed, drafter in zip((3, 4), drafters):
        fill_random_weights(drafter, seed=seed)
    save_drafter(drafters[1], tmp_path / "draft")
    core = make_core(proposer=DSparkProposer(drafters[0].eval(), tiny_runner.num_blocks, tiny_runner.block_size))
    with pytest.raises(WeightMismatch, match="runs no drafter"):
        served_tensors(make_core().worker, WeightTarget.DRAFT)
    target_before = {name: t.clone() for name, t in served_tensors(core.worker, WeightTarget.MODEL).items()}
    served = served_tensors(core.worker, WeightTarget.DRAFT)
    core.controls.add(Control(lambda c: (copy_weights(served, read_safetensors(tmp_path / "draft", served)), [])[1]))
    plain = run(make_core(), [request("a", prompt_of(7, 11), max_new_tokens=10, ignore_eos=True)])["a"].tokens
    spec = run(core, [request("a", prompt_of(7, 11), max_new_tokens=10, ignore_eos=True)])["a"].tokens
    assert spec == plain  # greedy output is the target's, whatever drafts
    new = dict(drafters[1].checkpoint_tensors())
    assert all(torch.equal(tensor, new[name]) for name, tensor in dict(drafters[0].checkpoint_tensors()).items())
    assert all(torch.equal(t, target_before[name]) for name, t in served_tensors(core.worker, WeightTarget.MODEL).items())


def test_release_frees_both_kv_caches_and_resume_serves_the_same(make_core, tiny_runner):
    from services.scheduler.spec.dspark import DSparkProposer
    from services.scheduler.spec.dspark_config import draft_config_for_target
    from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights
    from services.scheduler.weights import memory
    from test_scheduler_core import run

    config = draft_config_for_target(tiny_runner.config, num_draft_layers=1, mask_token_id=5, block_size=4, markov_rank=8)
    drafter = empty_drafter(config, tiny_runner.model.model.embed_tokens, tiny_runner.lm_head_weight)
    fill_random_weights(drafter, seed=3)
    core = make_core(proposer=DSparkProposer(drafter.eval(), tiny_runner.num_blocks, tiny_runner.block_size))
    ask = [request("a", prompt_of(8, 13), max_new_tokens=10, ignore_eos=True)]
    before = run(core, ask)["a"].tokens
    caches = memory.kv_tensors(core.worker)
    sizes = [t.untyped_storage().nbytes() for t in caches]
    assert len(caches) == 2 and min(sizes) > 0
    released = memory.release(core.worker, weights=True)  # weights stay on the CPU: only the caches go
    assert [t.untyped_storage().nbytes() for t in caches] == [0, 0] and released.weights == []
    memory.resume(core.worker, released)
    assert [t.untyped_storage().nbytes() for t in caches] == sizes
    assert run(core, [request("a", prompt_of(8, 13), max_new_tokens=10, ignore_eos=True)])["a"].tokens == before


def test_a_weight_swap_leaves_no_cached_prefix_of_the_old_weights(make_core):
    # The prefix cache keys blocks by the weights' version: after `weights_changed` the same prompt
    # finds nothing cached (its KV would be the old weights'), and a flush control forgets too.
    from services.scheduler.between_steps import flush_prefix_cache, weights_changed

    core = make_core(prefix_caching=True)
    cached: dict[str, int] = {}

    def serve(rid: str) -> None:
        core.add(request(rid, prompt_of(7, 40), max_new_tokens=2, ignore_eos=True))
        step_until_idle(core, lambda o: cached.__setitem__(o.rid, max(cached.get(o.rid, 0), o.cached_tokens)))

    serve("first")
    serve("again")
    assert cached["first"] == 0 and cached["again"] > 0  # the cache serves a repeat
    core.controls.add(Control(lambda c: (weights_changed(c, "v2"), [])[1]))
    serve("after_swap")
    assert cached["after_swap"] == 0
    serve("again_on_v2")
    assert cached["again_on_v2"] > 0
    core.controls.add(Control(flush_prefix_cache))
    serve("after_flush")
    assert cached["after_flush"] == 0
