"""One `/metrics` page for a service kind that several processes serve: `sparkwire up --tokenizers N`
(N tokenizers on one port, each scrape reaching whichever accepts it) or compose replicas that
share a volume.

Each process writes a snapshot of its own registry to `<directory>/<instance id>.msgpack`, every
`PUBLISH_INTERVAL_S` and just before it answers a scrape; a scrape answers the sum of every
snapshot in the directory. Why a counter never goes down from one scrape to the next, whichever
process answers each: a process's snapshots only grow, each replaces the last in one
`os.replace`, and the answering process writes its own first, so every term of a sum is at least
what the previous scrape read.

The counts of a process that has exited stay in the sums (prometheus_client's multiprocess mode
keeps dead processes' files too), folded into one `retired.msgpack` by the next process to start,
so a scrape reads one file per live process plus one however often processes were restarted.
Each process holds an flock on its `<instance id>.alive` for its whole life: a free one is an
exited process's. Folding holds the directory's `.lock` exclusively and scrapes hold it shared,
so no scrape sees an exited process's counts both in its own file and in the retired one.

Counters and histograms are summed; a `_created` sample takes the earliest. A gauge has no sum
that means anything across live and exited processes, so a registry holding one is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

PUBLISH_INTERVAL_S = 1.0  # what another process's counts lag behind at most on a scrape
SUFFIX = ".msgpack"
ALIVE = ".alive"
RETIRED = "retired"
LOCK = ".lock"
SUMMED_TYPES = frozenset({"counter", "histogram", "summary"})

Labels = tuple[tuple[str, str], ...]


class Sample(msgspec.Struct, array_like=True, frozen=True, gc=False):
    name: str
    labels: dict[str, str]
    value: float


class Family(msgspec.Struct, array_like=True, frozen=True, gc=False):
    name: str
    documentation: str
    type: str
    unit: str
    samples: list[Sample]


class SharedMetricsDir:
    """This process's registry, published into `directory` beside its siblings'; `render` is the
    text of all of them summed. Linux (flock)."""

    def __init__(self, registry: CollectorRegistry, directory: Path, instance_id: str) -> None:
        self._registry = registry
        self._directory = directory
        self._path = directory / f"{instance_id}{SUFFIX}"
        self._decoder = msgspec.msgpack.Decoder(list[Family])
        self._encoder = msgspec.msgpack.Encoder()
        with _locked(directory, fcntl.LOCK_EX):
            self._alive = _hold(directory / f"{instance_id}{ALIVE}")
            self._fold_exited()

    def publish(self) -> None:
        """Replace this process's snapshot with its counts of now (one rename: readers see the
        last snapshot or this one, never a mix)."""
        self._write(self._path, snapshot(self._registry))

    def render(self) -> bytes:
        self.publish()
        with _locked(self._directory, fcntl.LOCK_SH):
            families = merge(self._read(path) for path in sorted(self._directory.glob(f"*{SUFFIX}")))
        return generate_latest(_Families([_metric(family) for family in families]))  # type: ignore[arg-type]

    def close(self) -> None:
        """This process is done (its snapshot stays, for the next process to fold)."""
        os.close(self._alive)

    def _fold_exited(self) -> None:
        exited = [path for path in self._directory.glob(f"*{ALIVE}") if _is_free(path)]
        if not exited:
            return
        retired = self._directory / f"{RETIRED}{SUFFIX}"
        snapshots = [self._read(path) for path in (retired, *(path.with_suffix(SUFFIX) for path in exited))]
        self._write(retired, merge(snapshots))
        for path in exited:
            path.with_suffix(SUFFIX).unlink(missing_ok=True)
            path.unlink()

    def _write(self, path: Path, families: list[Family]) -> None:
        partial = path.with_suffix(".partial")
        partial.write_bytes(self._encoder.encode(families))
        os.replace(partial, path)

    def _read(self, path: Path) -> list[Family]:
        try:
            return self._decoder.decode(path.read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            return []


@contextlib.contextmanager
def _locked(directory: Path, operation: int) -> Iterator[None]:
    with open(directory / LOCK, "a+b") as handle:
        fcntl.flock(handle, operation)
        yield


def _hold(path: Path) -> int:
    """Open and lock `path` for this process's life (the lock goes when the process does)."""
    descriptor = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return descriptor


def _is_free(path: Path) -> bool:
    """No live process holds `path`'s lock (ours is held through another descriptor, so it is not free)."""
    descriptor = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)
    return True


def snapshot(registry: CollectorRegistry) -> list[Family]:
    families = []
    for metric in registry.collect():
        if metric.type not in SUMMED_TYPES:
            raise ValueError(f"{metric.name} is a {metric.type}: only counters and histograms sum across processes")
        samples = [Sample(s.name, dict(s.labels), s.value) for s in metric.samples]
        families.append(Family(metric.name, metric.documentation, metric.type, metric.unit, samples))
    return families


def merge(snapshots: Iterable[list[Family]]) -> list[Family]:
    """Families in first-seen order; per (sample name, labels) the sum, or for `_created` the minimum."""
    heads: dict[str, Family] = {}
    values: dict[str, dict[tuple[str, Labels], float]] = {}
    for families in snapshots:
        for family in families:
            heads.setdefault(family.name, family)
            totals = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                seen = totals.get(key)
                totals[key] = sample.value if seen is None else _combine(sample.name, seen, sample.value)
    return [_family(heads[name], totals) for name, totals in values.items()]


def _combine(sample_name: str, seen: float, value: float) -> float:
    return min(seen, value) if sample_name.endswith("_created") else seen + value


def _family(head: Family, totals: dict[tuple[str, Labels], float]) -> Family:
    samples = [Sample(sample_name, dict(labels), value) for (sample_name, labels), value in totals.items()]
    return Family(head.name, head.documentation, head.type, head.unit, samples)


def _metric(family: Family) -> Metric:
    metric = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        metric.add_sample(sample.name, sample.labels, sample.value)
    return metric


class _Families:
    """What `generate_latest` reads: anything with `collect()`."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics
