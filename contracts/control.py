"""Liveness messages every service publishes and every service may watch."""

from __future__ import annotations

import msgspec

from contracts.limits import Count, InstanceId, Reason


class Heartbeat(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Published every `heartbeat_interval_s` on `subjects.heartbeat(service)`.

    `alive=False` is the "dead" sentinel: a service that hits a fatal error or shuts down says so,
    so that whoever waits on it fails fast instead of waiting for the heartbeat timeout.
    """

    service: InstanceId  # "scheduler" | "detokenizer" | "tokenizer"
    instance_id: InstanceId
    alive: bool = True
    num_running: Count = 0
    reason: Reason | None = None
