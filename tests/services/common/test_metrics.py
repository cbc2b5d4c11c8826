"""The shared metrics pieces: the `/metrics` endpoint, bucket ladders, the scheduler's exporter
over a stats snapshot and its periodic engine line."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from contracts.detokenizer import Finish, FinishType
from services.common.metrics import MetricsServer, geometric_buckets, name
from services.common.metrics_scheduler import EngineLine, SchedulerMetrics, SchedulerStats, SchedulerTelemetry

pytestmark = pytest.mark.timeout(20)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def http_get(port: int, target: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body.decode()


def test_names_carry_the_prefix_and_buckets_grow_geometrically():
    assert name("num_requests_running") == "sparkwire:num_requests_running"
    assert geometric_buckets(0.001, 2.0, 4) == (0.001, 0.002, 0.004, 0.008)


async def test_metrics_server_serves_its_registry_and_nothing_else():
    registry = CollectorRegistry()
    Counter(name("things"), "things seen", registry=registry).inc(3)
    server = await MetricsServer(registry).start("127.0.0.1", 0)
    try:
        status, body = await http_get(server.port, "/metrics")
        missing, _ = await http_get(server.port, "/other")
    finally:
        await server.close()
    assert status == 200 and samples(body)[("sparkwire:things_total", ())] == 3.0
    assert missing == 404


def step_output(tokens: int, finish: FinishType | None = None, prompt: int = 5):
    class Output:
        new_token_ids = list(range(tokens))
        prompt_tokens = prompt

    output = Output()
    output.finish = None if finish is None else Finish(finish)
    return output


def test_scheduler_metrics_export_the_snapshot_and_the_steps():
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=4,
                           num_spec_drafts=10, num_spec_draft_tokens=70, num_spec_accepted_tokens=31,
                           num_prefix_cache_queries=120, num_prefix_cache_hits=96)  # fmt: skip
    metrics = SchedulerMetrics(lambda: stats, "tiny")
    metrics.observe_step([step_output(1), step_output(2, FinishType.STOP, prompt=7)])
    metrics.observe_step([step_output(1, FinishType.ABORT, prompt=9)])
    stopped_by_a_stop_string = step_output(0)
    stopped_by_a_stop_string.finish = Finish(FinishType.ABORT, message="stop")  # the detokenizer's abort
    metrics.observe_step([stopped_by_a_stop_string])
    got = samples(metrics.render().decode())
    model = (("model_name", "tiny"),)
    assert got[("sparkwire:num_requests_running", model)] == 3
    assert got[("sparkwire:num_requests_waiting", model)] == 2
    assert got[("sparkwire:kv_cache_usage_perc", model)] == 0.25
    assert got[("sparkwire:num_preemptions_total", model)] == 4
    assert got[("sparkwire:spec_decode_num_accepted_tokens_total", model)] == 31
    assert got[("sparkwire:spec_decode_num_draft_tokens_total", model)] == 70
    assert got[("sparkwire:prefix_cache_queries_total", model)] == 120
    assert got[("sparkwire:prefix_cache_hits_total", model)] == 96
    assert got[("sparkwire:generation_tokens_total", model)] == 4
    assert got[("sparkwire:prompt_tokens_total", model)] == 16 + 5
    assert got[("sparkwire:request_success_total", (("finished_reason", "stop"), *model))] == 2
    assert got[("sparkwire:request_success_total", (("finished_reason", "abort"), *model))] == 1
    assert got[("sparkwire:iteration_tokens_total_count", model)] == 3


def test_unknown_snapshot_fields_are_left_out_not_reported_as_zero():
    metrics = SchedulerMetrics(lambda: SchedulerStats(num_running=1), "tiny")
    names = {sample_name for sample_name, _ in samples(metrics.render().decode())}
    assert "sparkwire:num_requests_running" in names
    assert "sparkwire:num_requests_waiting" not in names and "sparkwire:kv_cache_usage_perc" not in names


def test_engine_line_reports_throughput_since_the_last_line_and_is_silent_when_idle():
    current = {"stats": SchedulerStats(num_running=2, num_waiting=1)}
    metrics = SchedulerMetrics(lambda: current["stats"], "tiny")
    line = EngineLine(metrics, _last_at=100.0)
    metrics.observe_step([step_output(30)])
    first = line.fields(now=110.0)
    assert first is not None and first["generation_tokens_per_s"] == 3.0
    assert first["running"] == 2 and first["waiting"] == 1
    current["stats"] = SchedulerStats(num_running=0, num_waiting=0)
    assert line.fields(now=120.0) is None  # nothing generated, nothing held: no line
    current["stats"] = SchedulerStats(num_running=1, num_prompt_tokens=500, num_generated_tokens=60)
    third = line.fields(now=130.0)  # the core's own counts win over ours when it reports them
    assert third["prompt_tokens_per_s"] == 50.0 and third["generation_tokens_per_s"] == 3.0


async def test_telemetry_serves_metrics_on_a_port_and_closes():
    telemetry = SchedulerTelemetry(lambda: SchedulerStats(num_running=0), "tiny", interval_s=60)
    await telemetry.start("127.0.0.1", 0)
    try:
        telemetry.observe_step([step_output(2)])
        status, body = await http_get(telemetry.port, "/metrics")
    finally:
        await telemetry.close()
    assert status == 200
    assert samples(body)[("sparkwire:generation_tokens_total", (("model_name", "tiny"),))] == 2


async def test_transport_traffic_counts_messages_chunks_and_bytes(nats_server_factory):
    nats_server = nats_server_factory(max_payload="1MB")
    import msgspec

    from services.common.connection import NatsConnection
    from services.common.transport import Transport

    connection = NatsConnection(nats_url=nats_server.url)
    sender, receiver = await Transport.connect(connection, "send"), await Transport.connect(connection, "recv")
    got = asyncio.Event()

    async def on_message(_message, _delivery):
        got.set()

    try:
        await receiver.subscribe("sparkwire.v1.test.traffic", bytes, on_message)
        await receiver.flush()
        big = bytearray(msgspec.msgpack.encode(b"x" * (3 << 20)))  # framed: several chunks
        await sender.publish("sparkwire.v1.test.traffic", big)
        await asyncio.wait_for(got.wait(), 10)
        sent, received = sender.events.traffic, receiver.events.traffic
        page = samples(_render_traffic(sent))
    finally:
        await sender.close()
        await receiver.close()
    assert sent.messages_sent == 1 and sent.chunks_sent > 1 and sent.bytes_sent == len(big)
    assert received.messages_received == 1 and received.chunks_received == sent.chunks_sent
    assert received.bytes_received == len(big)
    assert page[("sparkwire:nats_chunks_total", (("direction", "sent"),))] == sent.chunks_sent


def _render_traffic(traffic) -> str:
    from services.common.metrics import TrafficCollector, render

    registry = CollectorRegistry()
    registry.register(TrafficCollector(lambda: traffic))
    return render(registry).decode()


def test_no_metric_name_is_exported_by_both_the_tokenizer_and_the_scheduler():
    # Sums across jobs must not double-count: the tokenizer's token and request counters carry
    # names of their own (`tokenizer_*`), the scheduler keeps vLLM's.
    from services.tokenizer.metrics import Metrics

    def names(registry: CollectorRegistry) -> set[str]:
        return {family.name for family in registry.collect()}

    tokenizer, scheduler = Metrics("m"), SchedulerMetrics(lambda: SchedulerStats(num_running=0), "m")
    assert names(tokenizer.registry) and names(scheduler.registry)
    assert names(tokenizer.registry) & names(scheduler.registry) == set()
