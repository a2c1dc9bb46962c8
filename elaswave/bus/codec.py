"""The bus's wire codec: an :class:`~elaswave.bus.schema.Event` to and from its two-frame
ZeroMQ multipart message ``[topic/sender, msgpack payload]`` (the format is described in
:mod:`elaswave.bus.schema`, the only module that defines events).

The first frame names the topic and the sender (``b"control/core"``), so that a SUB
socket can take one sender's messages only: a worker acts on the Core's, and does not
receive every other worker's beacons and acknowledgements (a number of messages that
grows with the job). Event logs written before carry the topic alone, and still decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import msgpack

from elaswave.bus.fields import is_int, short
from elaswave.bus.schema import (
    EVENT_TYPES,
    FIELD_SPECS,
    KIND_KEY,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    Event,
    EventKind,
    SchemaError,
)

MAX_PAYLOAD_BYTES = 1 << 20
"""Largest payload frame :func:`decode` reads and :func:`encode` writes (1 MiB). Events
carry plan inputs, never plans or tensors: the largest in practice are a few KiB."""

MAX_SENDER_BYTES = 100
"""Longest sender name (UTF-8 bytes) the bus carries: :func:`check_sender`."""

MAX_TOPIC_BYTES = 16 + MAX_SENDER_BYTES
"""Largest first frame :func:`decode` reads: a topic (a few letters), ``/`` and a sender."""

_SEP = b"/"

_NUM_FRAMES = 2

_E = TypeVar("_E", bound=Event)


def with_seq(event: _E, seq: int) -> _E:
    """Return a copy of ``event`` with ``seq`` replaced."""
    return dataclasses.replace(event, seq=seq)


def check_sender(name: str) -> str:
    """``name`` if it can name a sender on the bus, else ValueError saying why: a
    non-empty name of at most :data:`MAX_SENDER_BYTES` bytes without ``/``."""
    size = len(name.encode())
    if not name or "/" in name or size > MAX_SENDER_BYTES:
        raise ValueError(
            f"bus sender name {name!r} is not valid: give a non-empty name without '/' "
            f"of at most {MAX_SENDER_BYTES} bytes (such as 'core', 'rank3', 'observer')"
        )
    return name


def topic_frame(topic: str, sender: str) -> bytes:
    """The first frame of ``sender``'s messages on ``topic``: what SUB sockets filter on
    (a subscription is a prefix: ``topic/`` takes every sender's, ``topic/name`` one's)."""
    return f"{topic}/{sender}".encode()


def encode(event: Event) -> list[bytes]:
    """Encode ``event`` as the two-frame multipart message ``[topic/sender, msgpack payload]``."""
    cls = type(event)
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, EventKind) or EVENT_TYPES.get(kind) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered event class")
    payload: dict[str, Any] = {KIND_KEY: cls.KIND.value}
    for spec in FIELD_SPECS[cls.KIND]:
        payload[spec.name] = getattr(event, spec.name)
    if len(name := event.sender.encode()) > MAX_SENDER_BYTES:
        raise SchemaError(
            f"sender name of {len(name)} bytes, over the bus limit of {MAX_SENDER_BYTES}: "
            f"{short(event.sender)}"
        )
    body = msgpack.packb(payload, use_bin_type=True)
    if len(body) > MAX_PAYLOAD_BYTES:  # receivers would refuse it: say so at the source
        raise SchemaError(
            f"{cls.KIND.value} encodes to {len(body)} bytes, over the bus limit of "
            f"{MAX_PAYLOAD_BYTES}"
        )
    return [topic_frame(cls.TOPIC.value, event.sender), body]


def decode(frames: Sequence[bytes]) -> Event:
    """Decode a multipart message into its event, or raise :class:`SchemaError`.

    Frames past :data:`MAX_TOPIC_BYTES` and :data:`MAX_PAYLOAD_BYTES` are refused before
    anything is unpacked. Unknown extra payload fields are ignored (forward-compatible
    additions); ``float`` fields accept integers.
    """
    if len(frames) != _NUM_FRAMES:
        raise SchemaError(
            f"expected {_NUM_FRAMES} frames [topic/sender, payload], got {len(frames)} frame(s)"
        )
    first, body = bytes(frames[0]), bytes(frames[1])
    if len(first) > MAX_TOPIC_BYTES:
        raise SchemaError(
            f"topic frame of {len(first)} bytes: topics are at most {MAX_TOPIC_BYTES}"
        )
    if len(body) > MAX_PAYLOAD_BYTES:
        raise SchemaError(
            f"payload of {len(body)} bytes exceeds the bus limit of {MAX_PAYLOAD_BYTES} bytes"
        )
    try:
        payload = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise SchemaError(f"undecodable msgpack payload ({detail}): {short(body)}") from None
    if not isinstance(payload, dict):
        raise SchemaError(f"payload must be a map, got {type(payload).__name__} {short(payload)}")

    version = payload.get("schema_version", dataclasses.MISSING)
    if version is dataclasses.MISSING:
        raise SchemaError("payload has no 'schema_version' field")
    if not is_int(version) or version not in SUPPORTED_SCHEMA_VERSIONS:
        supported = sorted(SUPPORTED_SCHEMA_VERSIONS)
        newer = is_int(version) and version > SCHEMA_VERSION
        hint = " (it is newer: upgrade this process to read it)" if newer else ""
        raise SchemaError(
            f"unsupported schema_version {short(version)}{hint}; supported: {supported}"
        )

    if KIND_KEY not in payload:
        raise SchemaError(f"payload has no {KIND_KEY!r} field")
    raw_kind = payload[KIND_KEY]
    try:
        kind = EventKind(raw_kind)
    except (ValueError, TypeError):
        valid = ", ".join(k.value for k in EventKind)
        raise SchemaError(f"unknown event kind {short(raw_kind)}; valid kinds: {valid}") from None
    cls = EVENT_TYPES[kind]

    topic, _, named = first.partition(_SEP)
    if topic != cls.TOPIC.value.encode():
        raise SchemaError(
            f"topic frame {short(first)} does not match kind {kind.value!r}, "
            f"which is published on topic {cls.TOPIC.value!r}"
        )

    kwargs: dict[str, Any] = {}
    for spec in FIELD_SPECS[kind]:
        if spec.name not in payload:
            if spec.required:
                raise SchemaError(f"{kind.value}: missing required field {spec.name!r}")
            continue
        value = payload[spec.name]
        try:
            kwargs[spec.name] = spec.check(value)
        except TypeError:
            raise SchemaError(
                f"{kind.value}: field {spec.name!r} expected {spec.type_name}, "
                f"got {type(value).__name__} {short(value)}"
            ) from None
    if _SEP in first and named != kwargs["sender"].encode():
        raise SchemaError(
            f"topic frame {short(first)} names another sender than the payload's "
            f"{short(kwargs['sender'])}: a message goes out under its sender's name"
        )
    return cls(**kwargs)
