"""Every NATS subject Sparkwire uses, in one place. Each carries the wire version.

Routing in one picture (instance ids are uuid4 hex strings chosen at start-up):

    tokenizer ──request──▶ DETOKENIZER_REGISTER      (queue group: one detokenizer takes the rid)
    tokenizer ──request──▶ SCHEDULER_CLAIM           (queue group: one scheduler takes the rid)
    tokenizer ──publish──▶ scheduler_generate(id)    (direct: the claimed scheduler)
    anyone    ──publish──▶ SCHEDULER_ABORT           (broadcast: unknown rids are ignored)
    scheduler ──publish──▶ detokenizer_tokens(id)    (direct: one TokenBatch per step per detokenizer)
    detok.    ──publish──▶ tokenizer_outputs(id)     (direct: one TextBatch per batch per tokenizer)
    all       ──publish──▶ heartbeat(service)        (broadcast liveness + "dead" sentinel)
    tokenizer ──request──▶ SCHEDULER_PING            (queue group: /health)
    tokenizer ──request──▶ scheduler_claim(id)       (direct: the scheduler holding the prompt's prefix)
    tokenizer ──publish──▶ SCHEDULER_FLUSH_CACHE     (broadcast: every scheduler forgets its prefix cache)
    scheduler ──publish──▶ PREFIX_SUMMARY            (broadcast: the blocks it caches, for placement)
    tokenizer ──request──▶ scheduler_control(id)     (direct: every live scheduler, RL endpoints)
    pusher    ──publish──▶ scheduler_weights(id)     (direct: weight pieces, then a commit request)

Direct subjects have exactly one subscriber, which is what makes splitting a large message into
chunks safe: every chunk reaches the same process, in order.
"""

from __future__ import annotations

VERSION = "v2"  # v2: logprobs travel as LogprobColumns alone (contracts/logprobs.py)
PREFIX = f"sparkwire.{VERSION}"
ALL = f"{PREFIX}.>"  # what `sparkwire record` captures

SCHEDULER_CLAIM = f"{PREFIX}.scheduler.claim"
SCHEDULER_ABORT = f"{PREFIX}.scheduler.abort"
SCHEDULER_PING = f"{PREFIX}.scheduler.ping"
SCHEDULER_FLUSH_CACHE = f"{PREFIX}.scheduler.flush_cache"
PREFIX_SUMMARY = f"{PREFIX}.tokenizer.prefix_summary"
DETOKENIZER_REGISTER = f"{PREFIX}.detokenizer.register"

SCHEDULER_QUEUE = "scheduler"
DETOKENIZER_QUEUE = "detokenizer"


def scheduler_generate(instance_id: str) -> str:
    return f"{PREFIX}.scheduler.{instance_id}.generate"


def scheduler_claim(instance_id: str) -> str:
    return f"{PREFIX}.scheduler.{instance_id}.claim"
def scheduler_control(instance_id: str) -> str:
    """Direct: pause, continue, release, resume, update from disk (contracts/weights.py)."""
    return f"{PREFIX}.scheduler.{instance_id}.control"


def scheduler_weights(instance_id: str) -> str:
    """Direct: pushed weight pieces and their commit (contracts/weights.py)."""
    return f"{PREFIX}.scheduler.{instance_id}.weights"


def detokenizer_tokens(instance_id: str) -> str:
    return f"{PREFIX}.detokenizer.{instance_id}.tokens"


def tokenizer_outputs(instance_id: str) -> str:
    return f"{PREFIX}.tokenizer.{instance_id}.outputs"


def heartbeat(service: str) -> str:
    return f"{PREFIX}.heartbeat.{service}"


HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"
