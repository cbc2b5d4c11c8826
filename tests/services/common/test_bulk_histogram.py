"""`BulkHistogram`: the same exposition as prometheus_client's `Histogram` fed the same values one by one."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.common.metrics import INTER_TOKEN_BUCKETS, BulkHistogram


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("batches", [[[]], [[0.0]], [[0.001, 0.0015, 7.5, 1e6]], [[0.003] * 5, [], [0.2, 0.0005]]])
def test_the_same_lines_as_histogram(batches):
    edges = list(INTER_TOKEN_BUCKETS)
    batches = [*batches, edges]  # values equal to an upper bound count in that bucket (le)
    want, got = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("sparkwire:itl", "gaps", ["model_name"], buckets=INTER_TOKEN_BUCKETS, registry=want)
    bulk = BulkHistogram("sparkwire:itl", "gaps", {"model_name": "m"}, INTER_TOKEN_BUCKETS)
    got.register(bulk)
    for values in batches:
        for value in values:
            histogram.labels("m").observe(value)
        bulk.observe_many(values)
    assert _exposition(got) == _exposition(want)


def test_many_batches_count_exactly_and_sum_to_float_noise():
    rng = np.random.default_rng(1)
    bulk = BulkHistogram("itl", "gaps", {"model_name": "m"}, (0.01, 0.1))
    values = [rng.exponential(0.05, 127).tolist() for _ in range(50)]
    for batch in values:
        bulk.observe_many(batch)
    family = next(iter(bulk.collect()))
    counts = {s.labels.get("le"): s.value for s in family.samples if s.name.endswith("_bucket")}
    flat = np.concatenate(values)
    assert counts == {"0.01": (flat <= 0.01).sum(), "0.1": (flat <= 0.1).sum(), "+Inf": flat.size}
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    assert total == pytest.approx(flat.sum(), rel=1e-12)
