"""The recording file format (a file format, not a wire message: it lives with the recorder).

A recording is a sequence of frames, each a 4-byte little-endian length followed by that many
bytes of MessagePack. The first frame is a `RecordingHeader`, every later one a
`RecordedMessage`. Messages are the raw NATS messages as the server delivered them: a large
message split by the transport stays split (its chunk headers included), so replay reproduces
exactly what subscribers saw. A truncated last frame (recorder killed mid-write) is ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

MAGIC = "sparkwire-recording"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<I")


class RecordingHeader(msgspec.Struct, frozen=True):
    magic: str
    version: int
    created_at: float  # unix time
    nats_url: str
    subject: str  # the subscription pattern that was recorded


class RecordedMessage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    subject: str
    headers: dict[str, str] | None
    received_at: float  # unix time
    data: bytes
    reply: str = ""  # non-empty when the message was a request; replay sends a fresh inbox


class RecordingError(Exception):
    """Not a recording, or one written by a newer format version."""


class RecordingWriter:
    """Appends frames and flushes each, so a recording is readable up to the last message."""

    def __init__(self, stream: BinaryIO, header: RecordingHeader) -> None:
        self._stream = stream
        self._encoder = msgspec.msgpack.Encoder()
        self.num_messages = 0
        self.num_bytes = 0  # message payload bytes, headers not counted
        self._write_frame(header)

    def write(self, message: RecordedMessage) -> None:
        self._write_frame(message)
        self.num_messages += 1
        self.num_bytes += len(message.data)

    def _write_frame(self, record: msgspec.Struct) -> None:
        payload = self._encoder.encode(record)
        self._stream.write(_LENGTH.pack(len(payload)))
        self._stream.write(payload)
        self._stream.flush()


@dataclass(frozen=True)
class Recording:
    header: RecordingHeader
    messages: list[RecordedMessage]


def read_recording(path: Path | str) -> Recording:
    with open(path, "rb") as stream:
        header = read_header(stream)
        return Recording(header, list(iter_messages(stream)))


def read_header(stream: BinaryIO) -> RecordingHeader:
    frame = _read_frame(stream)
    try:
        header = msgspec.msgpack.decode(frame or b"", type=RecordingHeader)
    except msgspec.DecodeError as exc:
        raise RecordingError(f"not a sparkwire recording: {exc}") from exc
    if header.magic != MAGIC:
        raise RecordingError(f"not a sparkwire recording (magic {header.magic!r})")
    if header.version > FORMAT_VERSION:
        raise RecordingError(f"recording format {header.version} is newer than this reader ({FORMAT_VERSION})")
    return header


def iter_messages(stream: BinaryIO) -> Iterator[RecordedMessage]:
    """The messages after the header, in recorded order; stops at a truncated last frame."""
    decoder = msgspec.msgpack.Decoder(RecordedMessage)
    while (frame := _read_frame(stream)) is not None:
        yield decoder.decode(frame)


def _read_frame(stream: BinaryIO) -> bytes | None:
    prefix = stream.read(_LENGTH.size)
    if len(prefix) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(prefix)
    payload = stream.read(length)
    return payload if len(payload) == length else None
