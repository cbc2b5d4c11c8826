"""One `/metrics` page for a service kind that several processes serve: `sparkwire up --tokenizers N`
(N tokenizers on one port, each scrape reaching whichever accepts it) or compose replicas that
share a volume.

Each process writes a snapshot of its own registry to `<directory>/<instance id>.msgpack`, every
`PUBLISH_INTERVAL_S` and just before it answers a scrape; a scrape answers the sum of every
snapshot in the directory. Why a counter never goes down from one scrape to the next, whichever
process answers each: a process's snapshots only grow, each replaces the last in one
`os.replace`, and the answering process writes its own first, so every term of a sum is at least
what the previous scrape read. The snapshot of a process that has exited stays, so its counts
never leave the sums (prometheus_client's multiprocess mode keeps dead processes' files too);
`sparkwire up` removes the directory when the stack stops.

Counters and histograms are summed; a `_created` sample takes the earliest. A gauge has no sum
that means anything across live and exited processes, so a registry holding one is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

PUBLISH_INTERVAL_S = 1.0  # what another process's counts lag behind at most on a scrape
SUFFIX = ".msgpack"
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
    text of all of them summed."""

    def __init__(self, registry: CollectorRegistry, directory: Path, instance_id: str) -> None:
        self._registry = registry
        self._directory = directory
        self._path = directory / f"{instance_id}{SUFFIX}"
        self._decoder = msgspec.msgpack.Decoder(list[Family])
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self) -> None:
        """Replace this process's snapshot with its counts of now (one rename: readers see the
        last snapshot or this one, never a mix)."""
        families = snapshot(self._registry)
        partial = self._path.with_suffix(".partial")
        partial.write_bytes(self._encoder.encode(families))
        os.replace(partial, self._path)

    def render(self) -> bytes:
        self.publish()
        return generate_latest(_Families(merge(self._read_all())))  # type: ignore[arg-type]

    def _read_all(self) -> Iterator[list[Family]]:
        for path in sorted(self._directory.glob(f"*{SUFFIX}")):
            with contextlib.suppress(FileNotFoundError, msgspec.DecodeError):
                yield self._decoder.decode(path.read_bytes())


def snapshot(registry: CollectorRegistry) -> list[Family]:
    families = []
    for metric in registry.collect():
        if metric.type not in SUMMED_TYPES:
            raise ValueError(f"{metric.name} is a {metric.type}: only counters and histograms sum across processes")
        samples = [Sample(s.name, dict(s.labels), s.value) for s in metric.samples]
        families.append(Family(metric.name, metric.documentation, metric.type, metric.unit, samples))
    return families


def merge(snapshots: Iterable[list[Family]]) -> list[Metric]:
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
    return [_metric(heads[name], totals) for name, totals in values.items()]


def _combine(sample_name: str, seen: float, value: float) -> float:
    return min(seen, value) if sample_name.endswith("_created") else seen + value


def _metric(head: Family, totals: dict[tuple[str, Labels], float]) -> Metric:
    metric = Metric(head.name, head.documentation, head.type, head.unit)
    for (sample_name, labels), value in totals.items():
        metric.add_sample(sample_name, dict(labels), value)
    return metric


class _Families:
    """What `generate_latest` reads: anything with `collect()`."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics
