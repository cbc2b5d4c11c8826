"""One /metrics page from several processes' registries (services/common/metrics_shared.py): sums,
the earliest `_created`, gauges refused, exited processes kept, and no counter going down between
scrapes whichever process answers each, where answering from one's own registry does."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import name
from services.common.metrics_shared import SharedMetricsDir
from services.tokenizer.metrics import Metrics

pytestmark = pytest.mark.timeout(20)


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(page) for s in f.samples}


def process(directory, instance: str) -> tuple[CollectorRegistry, Counter, Histogram, SharedMetricsDir]:
    registry = CollectorRegistry()
    counter = Counter(name("things"), "things", ["kind"], registry=registry)
    histogram = Histogram(name("wait_seconds"), "waits", buckets=(0.1, 1.0), registry=registry)
    return registry, counter, histogram, SharedMetricsDir(registry, directory, instance)


def test_a_page_sums_every_process_and_keeps_the_earliest_created(tmp_path):
    _, count_a, wait_a, shared_a = process(tmp_path, "a")
    _, count_b, wait_b, shared_b = process(tmp_path, "b")
    count_a.labels("x").inc(2)
    count_b.labels("x").inc(3)
    count_b.labels("y").inc()
    wait_a.observe(0.05)
    wait_b.observe(0.5)
    shared_b.publish()
    got = samples(shared_a.render())
    assert got[("sparkwire:things_total", (("kind", "x"),))] == 5 and got[("sparkwire:things_total", (("kind", "y"),))] == 1
    assert got[("sparkwire:wait_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("sparkwire:wait_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("sparkwire:wait_seconds_count", ())] == 2 and got[("sparkwire:wait_seconds_sum", ())] == pytest.approx(0.55)
    created = [samples(s.render())[("sparkwire:things_created", (("kind", "x"),))] for s in (shared_a, shared_b)]
    assert got[("sparkwire:things_created", (("kind", "x"),))] == min(created)


def test_processes_that_have_gone_still_count_folded_into_one_file(tmp_path):
    _, count_a, _, shared_a = process(tmp_path, "a")
    _, count_b, _, shared_b = process(tmp_path, "b")
    count_a.labels("x").inc(4)
    count_b.labels("x").inc()
    shared_a.publish()
    shared_a.close()  # exited: its snapshot stays
    x_total = ("sparkwire:things_total", (("kind", "x"),))
    assert samples(shared_b.render())[x_total] == 5
    for restart in range(3):  # each start folds what the exited ones left
        _, count, _, shared = process(tmp_path, f"restart-{restart}")
        count.labels("x").inc(10)
        shared.publish()
        shared.close()
    _, _, _, shared_c = process(tmp_path, "c")
    assert samples(shared_c.render())[x_total] == 35
    assert sorted(path.name for path in tmp_path.glob("*.msgpack")) == ["b.msgpack", "c.msgpack", "retired.msgpack"]
    assert samples(shared_b.render())[x_total] == 35  # a live process's page has the same sum


def test_a_gauge_is_refused_it_has_no_sum_across_processes(tmp_path):
    registry = CollectorRegistry()
    Gauge(name("level"), "a level", registry=registry).set(3)
    with pytest.raises(ValueError, match="gauge"):
        SharedMetricsDir(registry, tmp_path, "a").publish()


def counters(page: bytes) -> dict:
    """The samples that may only grow: counters' totals, histograms' buckets, counts and sums."""
    return {key: value for key, value in samples(page).items() if not key[0].endswith("_created")}


def scrapes_while_counting(rng: random.Random, processes: list[Metrics]) -> tuple[list[dict], int]:
    """40 scrapes, each answered by a random process, with 0 to 2 requests counted by random
    processes before each; returns the pages and the number of requests counted."""
    pages, counted = [], 0
    for _ in range(40):
        for _ in range(rng.randrange(3)):
            rng.choice(processes).observe_http("/generate", "POST", 200, rng.random())
            counted += 1
        pages.append(counters(rng.choice(processes).render()))
    return pages, counted


def decreases(pages: list[dict]) -> list[tuple]:
    return [(key, before[key], after.get(key)) for before, after in zip(pages, pages[1:])
            for key in before if after.get(key, 0) < before[key]]  # fmt: skip


GENERATE_200 = ("sparkwire:http_requests_total", (("handler", "/generate"), ("method", "POST"), ("status", "200")))


def test_three_tokenizers_scraped_at_random_never_show_a_counter_going_down(tmp_path):
    tokenizers = [Metrics("m") for _ in range(3)]
    for index, metrics in enumerate(tokenizers):
        metrics.shared = SharedMetricsDir(metrics.registry, tmp_path, f"tok-{index}")
    pages, counted = scrapes_while_counting(random.Random(7), tokenizers)
    assert decreases(pages) == []
    for metrics in tokenizers:  # what each one's periodic publish does
        metrics.shared.publish()
    assert counted > 0 and counters(tokenizers[0].render())[GENERATE_200] == counted
    alone = [Metrics("m") for _ in range(3)]  # what one port served before: each its own registry
    assert decreases(scrapes_while_counting(random.Random(7), alone)[0]) != []
