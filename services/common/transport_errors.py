"""The transport's errors, in a module of their own: `transport.py` raises them, and so do the
modules it is built from (`framing.plan_chunks`: `PayloadTooLarge`), which it imports. Callers
import them from `services.common.transport`, the transport's API.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of the errors the transport raises."""


class PayloadTooLarge(TransportError):
    """A message that must travel in one piece (a request or a reply) exceeds `max_payload`."""


class ReceiverGone(TransportError):
    """Flow control: the receiver of a subject stopped acking (it died or left)."""
