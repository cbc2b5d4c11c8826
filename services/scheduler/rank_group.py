"""One scheduler over N tensor-parallel ranks: rank 0 is the scheduler, ranks 1..N-1 its followers.

`start_group` (rank 0, from `build.build_core`) spawns the followers as child processes of the
scheduler, on loopback, and joins them in two process groups built on one TCP store: a gloo
control group, over which rank 0 sends each model call as plain values (a msgspec `RankCall`: the
step's `ForwardBatch` shapes and host lengths, or the shape of the hidden rows whose logits it
wants), and the device group of the model's collectives (`TensorParallel`: gloo on CPU, NCCL on
CUDA), which carries the call's tensors from device to device (the batch's arrays packed in one
int64 buffer: no host read of a token the device sampled last step). Rank 0 runs
the policy, the worker and the NATS adapter; its `ModelRunner` hands each call to `Leader` first
(`ModelRunner.leader`), so every rank runs the same forward, in the same order, on its shard.

A follower that dies leaves rank 0's next call (or the collective it is in) raising
`RankLostError`/the group's error: the step fails, the scheduler fails its requests with that
error and exits, and `sparkwire up` restarts it, group and all. Followers exit when rank 0 does
(their parent gone, or a control call failing).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

import msgspec
import structlog
import torch
import torch.distributed as dist

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.tensor_parallel import RowDraw, TensorParallel
from services.scheduler.spec.base import ContextRows, DraftRequest

log = structlog.get_logger(__name__)

GROUP_TIMEOUT = datetime.timedelta(hours=24)  # followers wait this long between steps (an idle scheduler)
JOIN_TIMEOUT_S = 600.0  # every rank has joined the store by then (model loading comes after)
PARENT_POLL_S = 1.0
EXIT_WAIT_S = 5.0  # a collective broken by a dead rank waits this long for its exit code
EXIT_GRACE_S = 15.0  # a dead rank's scheduler has this long to fail its step and exit by itself
BATCH_ARRAYS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping")


class RankLostError(RuntimeError):
    """A tensor-parallel rank exited: the group cannot run another step."""


class RankCall(msgspec.Struct):
    """One model call, rank 0 to the followers: "forward" (a batch, whose arrays follow on the
    device group as one int64 buffer: no host copy of what the device holds), "head" (the LM head
    over hidden rows that follow on the device group), "columns" / "sample" (`ShardedRows`), "draft"
    (a DSpark `DraftRequest`: its anchors and block tables follow as one int64 buffer) or "stop"."""

    op: str
    shapes: tuple[tuple[int, ...], ...] = ()  # each of BATCH_ARRAYS'
    dtypes: tuple[str, ...] = ()
    capture_layers: tuple[int, ...] = ()
    host_query_lens: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None
    hidden_shape: tuple[int, ...] = ()
    top_k: int = 0  # "columns": the top-k width, and each row's number of requested ids (-1: none)
    num_ids: int = -1
    draws: tuple[RowDraw, ...] = ()  # "sample": each row's
    max_anchor_position: int = 0  # "draft": the request's host fields (shapes: its block tables' [B, M])
    temperatures: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()

    def batch(self, packed: torch.Tensor) -> ForwardBatch:
        sizes = [math.prod(shape) for shape in self.shapes]
        parts = packed.split(sizes)
        tensors = {name: part.view(shape).to(getattr(torch, dtype))
                   for name, part, shape, dtype in zip(BATCH_ARRAYS, parts, self.shapes, self.dtypes)}  # fmt: skip
        return ForwardBatch(**tensors, capture_layers=self.capture_layers, host_query_lens=self.host_query_lens,
                            host_seq_lens=self.host_seq_lens)  # fmt: skip

    def draft_request(self, packed: torch.Tensor) -> DraftRequest:
        """packed: [anchor tokens [B], anchor positions [B], block tables [B, M]] as one int64 buffer."""
        rows = self.shapes[0][0]
        tokens, positions, tables = packed.split([rows, rows, self.num_packed])
        return DraftRequest(("",) * rows, tokens, positions, tables.view(self.shapes[0]).int(), self.max_anchor_position,
                            self.temperatures, self.seeds)  # fmt: skip

    @property
    def num_packed(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankCall)


@dataclasses.dataclass
class Groups:
    rank: int
    size: int
    control: object  # ProcessGroupGloo: RankCall bytes, on the host
    device: object  # the model's collectives: ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA

    def send(self, call: RankCall) -> None:
        data = _encoder.encode(call)
        self.control.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.control.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def receive(self) -> RankCall:
        length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(length, 0).wait()
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return _decoder.decode(data.numpy().tobytes())


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA, the CPU otherwise."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def join(rank: int, size: int, port: int, device: str) -> Groups:
    """This rank's two groups, on the store rank 0 serves at 127.0.0.1:port."""
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, GROUP_TIMEOUT)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, size, GROUP_TIMEOUT)
    return Groups(rank, size, control, group)


def tensor_parallel(groups: Groups, config: ModelConfig, leader: Leader | None = None) -> TensorParallel:
    return TensorParallel(groups.rank, groups.size, groups.device, config, None if leader is None else leader.explain)


class Leader:
    """Rank 0's side: each model call sent to the followers before rank 0 runs it (`ModelRunner.leader`)."""

    def __init__(self, groups: Groups, followers: list[multiprocessing.Process], device: str) -> None:
        self.groups = groups
        self.followers = followers
        self.device = torch.device(device)
        self._stopped = threading.Event()
        atexit.register(self._stopped.set)  # followers end with this process: no loss to report then
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """A dead rank normally fails the next step (`explain`), and the service exits; a collective
        that cannot notice it (NCCL waits for a peer that is gone) or an idle scheduler would not:
        after EXIT_GRACE_S this process ends itself, and the supervisor restarts the group."""
        while not self._stopped.wait(PARENT_POLL_S):
            try:
                self._check_alive()
            except RankLostError as lost:
                log.error("rank_group.rank_lost", error=str(lost))
                if not self._stopped.wait(EXIT_GRACE_S):
                    print(f"sparkwire scheduler: {lost}; leaving", file=sys.stderr, flush=True)
                    os._exit(1)
                return

    def forward(self, batch: ForwardBatch) -> None:
        self._check_alive()
        tensors = [getattr(batch, name) for name in BATCH_ARRAYS]
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
        packed = torch.cat([t.reshape(-1).to(self.device, torch.int64) for t in tensors])
        call = RankCall("forward", shapes, dtypes, tuple(batch.capture_layers), batch.host_query_lens, batch.host_seq_lens)
        self._send(call, packed)

    def head(self, hidden: torch.Tensor) -> None:
        self._check_alive()
        self._send(RankCall("head", hidden_shape=tuple(hidden.shape)), hidden.contiguous())

    def columns(self, hidden: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor | None) -> None:
        self._check_alive()
        wanted = targets.reshape(-1) if ids is None else torch.cat([targets.reshape(-1), ids.reshape(-1)])
        call = RankCall("columns", hidden_shape=tuple(hidden.shape), top_k=k, num_ids=-1 if ids is None else ids.shape[1])
        self._send(call, hidden.contiguous(), wanted.to(self.device, torch.int64))

    def sample(self, hidden: torch.Tensor, draws: tuple[RowDraw, ...]) -> None:
        self._check_alive()
        self._send(RankCall("sample", hidden_shape=tuple(hidden.shape), draws=draws), hidden.contiguous())

    def draft(self, request: DraftRequest) -> None:
        self._check_alive()
        tables = request.block_tables
        call = RankCall("draft", shapes=(tuple(tables.shape),), max_anchor_position=request.max_anchor_position,
                        temperatures=request.temperatures, seeds=request.seeds)  # fmt: skip
        parts = (request.anchor_tokens, request.anchor_positions, tables)
        self._send(call, torch.cat([t.reshape(-1).to(self.device, torch.int64) for t in parts]))

    def _send(self, call: RankCall, *payload: torch.Tensor) -> None:
        try:
            self.groups.send(call)
            for tensor in payload:
                self.groups.device.broadcast(tensor, 0).wait()
        except RuntimeError as exc:
            raise self.explain(exc) from exc

    def stop(self) -> None:
        """Followers leave their loop; those still running after a while are terminated."""
        self._stopped.set()
        if all(p.exitcode is None for p in self.followers):
            try:
                self.groups.send(RankCall("stop"))
            except Exception:  # noqa: BLE001 - a follower already gone: terminated below
                pass
        for process in self.followers:
            process.join(timeout=5.0)
            if process.exitcode is None:
                process.terminate()

    def explain(self, error: Exception) -> Exception:
        """A failed collective's error: the rank that died, once it has (within EXIT_WAIT_S), else as it came."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            try:
                self._check_alive()
            except RankLostError as lost:
                return lost
            time.sleep(0.05)
        return error

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.followers, start=1):
            if process.exitcode is not None:
                raise RankLostError(f"tensor-parallel rank {rank} of {self.groups.size} exited with code {process.exitcode}")


def start_group(config) -> tuple[Groups, Leader]:
    """Rank 0 of a `SchedulerConfig`'s group: spawn ranks 1..N-1 (`follower_main`), join them."""
    size = config.tensor_parallel_size
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    followers = [
        context.Process(target=follower_main, args=(config, rank, port), name=f"sparkwire-tp-rank{rank}", daemon=True)
        for rank in range(1, size)
    ]
    for process in followers:
        process.start()
    joined = threading.Event()
    threading.Thread(target=_fail_start_if_one_exits, args=(followers, joined), name="tp-start-watch", daemon=True).start()
    device = rank_device(config.resolved_device, 0)
    groups = join(0, size, port, device)
    joined.set()
    log.info("rank_group.joined", size=size, followers=[p.pid for p in followers])
    return groups, Leader(groups, followers, device)


def _fail_start_if_one_exits(followers: list[multiprocessing.Process], joined: threading.Event) -> None:
    """A follower that dies before the group is joined would leave rank 0 waiting for it: end the process instead."""
    while not joined.wait(PARENT_POLL_S):
        for rank, process in enumerate(followers, start=1):
            if process.exitcode is not None:
                print(f"sparkwire scheduler: tensor-parallel rank {rank} exited with code {process.exitcode} "
                      "before the group was joined", file=sys.stderr, flush=True)  # fmt: skip
                os._exit(1)


def follower_main(config, rank: int, port: int) -> None:
    """A follower's process: join, load its shard as rank 0 loads its own, then run rank 0's calls until "stop"."""
    from services.scheduler.build import load_follower  # the composition root builds this rank's runner

    for stop in (signal.SIGINT, signal.SIGTERM):  # a follower leaves when rank 0 does, after its drain
        signal.signal(stop, signal.SIG_IGN)
    _exit_with_parent()
    groups = join(rank, config.tensor_parallel_size, port, rank_device(config.resolved_device, rank))
    runner, proposer = load_follower(config, groups)
    try:
        serve(runner, groups, proposer)
    except Exception as exc:  # noqa: BLE001 - rank 0 gone or the group broken: nothing left to serve
        print(f"sparkwire scheduler rank {rank}: leaving: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)


def serve(runner, groups: Groups, proposer=None) -> None:
    """Run rank 0's calls on this rank's runner and drafter, in order, until "stop". A forward's
    captured rows go into this rank's draft KV cache at once, as rank 0's worker injects them (no
    collective: rank 0 sends nothing for it)."""
    while (call := groups.receive()).op != "stop":
        if call.op == "forward":
            packed = torch.empty(call.num_packed, dtype=torch.int64, device=runner.device)
            groups.device.broadcast(packed, 0).wait()
            batch = call.batch(packed)
            out = runner.forward(batch)
            if proposer is not None and out.captured is not None:
                proposer.inject(ContextRows(out.captured, batch.positions, batch.slot_mapping))
        elif call.op == "draft":
            rows, width = call.shapes[0]
            packed = torch.empty(rows * (2 + width), dtype=torch.int64, device=runner.device)
            groups.device.broadcast(packed, 0).wait()
            proposer.propose(call.draft_request(packed))
        elif call.op == "head":
            hidden = torch.empty(call.hidden_shape, dtype=runner.dtype, device=runner.device)
            groups.device.broadcast(hidden, 0).wait()
            runner.head_logits(hidden)
        elif call.op == "columns":
            hidden = torch.empty(call.hidden_shape, dtype=runner.dtype, device=runner.device)
            rows = call.hidden_shape[0]
            wanted = torch.empty(rows * (1 + max(call.num_ids, 0)), dtype=torch.int64, device=runner.device)
            groups.device.broadcast(hidden, 0).wait()
            groups.device.broadcast(wanted, 0).wait()
            ids = None if call.num_ids < 0 else wanted[rows:].view(rows, call.num_ids)
            runner.sharded_rows.columns(hidden, wanted[:rows], call.top_k, ids)
        elif call.op == "sample":
            hidden = torch.empty(call.hidden_shape, dtype=runner.dtype, device=runner.device)
            groups.device.broadcast(hidden, 0).wait()
            runner.sharded_rows.sample(hidden, call.draws)
        else:
            raise ValueError(f"unknown rank call {call.op!r}")


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
