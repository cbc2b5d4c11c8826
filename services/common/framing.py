"""The transport's framing: the headers every message and chunk carries, how a large payload is
cut into chunks that fit `max_payload` with their headers (exactly), and how a receiver reads
those headers back without trusting them. Plain functions of headers and sizes, kept apart
from `transport.py`: its send side and its receive side both use them.
"""

from __future__ import annotations

import itertools
import re

from services.common.scatter import header_block
from services.common.transport_errors import PayloadTooLarge

MSG_HEADER = "Sw-Msg"
CHUNK_HEADER = "Sw-Chunk"
ACK_HEADER = "Sw-Ack"
SEQ_HEADER = "Sw-Seq"
MARK_HEADER = "Sw-Mark"  # no message: the sender's last Sw-Seq number to this subject
CHUNK_FIELD = re.compile(r"(\d{1,9})/(\d{1,9})")
# Our message ids are `<sender hex>-<n>`. Held to that, the ack a receiver sends back
# (`<msg id> <index>`, all bytes < 0x80: MessagePack fixints) can never decode as a message, on
# whatever subject a hostile `Sw-Ack` names.
MSG_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def header_block_size(headers: dict[str, str]) -> int:
    """Bytes of the encoded NATS header block: `NATS/1.0\\r\\n` + `Key: Value\\r\\n`... + `\\r\\n`."""
    return len(header_block(headers))


def chunk_headers(
    msg_id: str, index: int, num_chunks: int, width: int, ack_subject: str | None, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """A chunk's headers: the message's own (`extra`: Sw-Seq, the request id) and the framing."""
    headers = (extra or {}) | {MSG_HEADER: msg_id, CHUNK_HEADER: f"{index:0{width}d}/{num_chunks:0{width}d}"}
    if ack_subject is not None:
        headers[ACK_HEADER] = ack_subject
    return headers


def plan_chunks(
    payload_len: int, max_payload: int, msg_id: str, ack_subject: str | None, extra: dict[str, str] | None = None
) -> tuple[int, int, int]:
    """(chunk_size, num_chunks, width) with header block + chunk <= max_payload for every chunk.

    Chunk numbers are zero-padded to `width` digits so every header has the same size; the
    smallest width that fits wins (a wider header leaves less room per chunk).
    """
    for width in itertools.count(1):
        header = header_block_size(chunk_headers(msg_id, 0, 0, width, ack_subject, extra))
        chunk_size = max_payload - header
        if chunk_size <= 0:
            raise PayloadTooLarge(f"max_payload {max_payload} bytes leaves no room after a {header}-byte header")
        num_chunks = max(1, -(-payload_len // chunk_size))
        if num_chunks < 10**width:
            return chunk_size, num_chunks, width
    raise AssertionError("unreachable")


class BadFraming(ValueError):
    """A chunk whose framing headers cannot be from our sender (or announce too much)."""


def parse_framing(headers: dict[str, str] | None) -> tuple[str, int, int] | None:
    """(message id, chunk index, number of chunks) of a framed chunk, None for a plain message.
    Raises `BadFraming` for anything else: the headers are the sender's word, not to be trusted."""
    msg_id = headers.get(MSG_HEADER) if headers else None
    if msg_id is None or headers is None:
        return None
    match = CHUNK_FIELD.fullmatch(headers.get(CHUNK_HEADER, ""))
    if MSG_ID.fullmatch(msg_id) is None:
        raise BadFraming(f"{MSG_HEADER} {msg_id[:80]!r} is not a message id")
    if match is None:
        raise BadFraming(f"{CHUNK_HEADER} {headers.get(CHUNK_HEADER, '')[:80]!r} is not <index>/<count>")
    index, total = int(match[1]), int(match[2])
    if not 0 <= index < total:
        raise BadFraming(f"chunk {index} of {total}")
    return msg_id, index, total


def parse_seq(headers: dict[str, str] | None) -> tuple[str, int] | None:
    """(sender, number) from `Sw-Seq`, None when absent or malformed (nothing to check then)."""
    sender, _, number = (headers or {}).get(SEQ_HEADER, "").partition(" ")
    return (sender, int(number)) if sender and number.isdigit() and len(number) < 20 else None
