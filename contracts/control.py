"""Liveness messages every service publishes and every service may watch."""

from __future__ import annotations

import msgspec

from contracts.limits import Count, InstanceId, Reason


class Heartbeat(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Published every `heartbeat_interval_s` on `subjects.heartbeat(service)`.

    `alive=False` is the "dead" sentinel: a service that hits a fatal error or shuts down says so,
    so that whoever waits on it fails fast instead of waiting for the heartbeat timeout.

    `drained` (on a sentinel): the sender already published the last message of every request it
    held (a finish, or a failure with its reason). Those messages may still be on their way, on a
    longer path than the sentinel's (scheduler -> detokenizer -> tokenizer), so dependents let them
    arrive: they treat the sender as dead only one heartbeat timeout later (`HeartbeatMonitor`).
    """

    service: InstanceId  # "scheduler" | "detokenizer" | "tokenizer"
    instance_id: InstanceId
    alive: bool = True
    num_running: Count = 0
    reason: Reason | None = None
    drained: bool = False  # appended: old readers ignore it and fail at once, as before
