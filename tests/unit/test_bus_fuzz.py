"""The bus decoder against hostile input: whatever arrives, :func:`decode` returns an
event or raises one :class:`SchemaError` (which the bus logs and skips), never anything
else: event-shaped maps (real and random kinds, versions, field names and values of
every msgpack type, nested), mutations of valid messages, and the size limits.

CI runs 1,000 maps and 200 mutations (about 10 s); ``scripts/fuzz_bus`` runs 10,000 and
2,000 (about 100 s on 2 cores) through ``ELASWAVE_FUZZ_EXAMPLES``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elaswave.bus.codec import MAX_PAYLOAD_BYTES, MAX_TOPIC_BYTES, decode, encode
from elaswave.bus.schema import (
    EVENT_TYPES,
    KIND_KEY,
    Event,
    RecoveryStarted,
    SchemaError,
    StepCompleted,
    Topic,
)

EXAMPLES = int(os.environ.get("ELASWAVE_FUZZ_EXAMPLES", "500"))  # scripts/fuzz_bus: more
"""Event-shaped maps per run; a fifth as many mutations of valid messages."""


def _fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip


_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_scalars = (
    st.none() | st.booleans() | _ints
    | st.floats() | st.text(max_size=16) | st.binary(max_size=16)
)  # fmt: skip
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | _ints, inner, max_size=4)
    ),
    max_leaves=12,
)
_field_names = sorted({f.name for cls in EVENT_TYPES.values() for f in dataclasses.fields(cls)})
_kinds = st.sampled_from([k.value for k in EVENT_TYPES]) | _scalars
_versions = st.sampled_from([1, 0, 2, -1, 2**40, "1", 1.0, None, True])


@st.composite
def _event_shaped(draw: st.DrawFn) -> dict:
    """A map with event fields (most of them real names) holding arbitrary values."""
    payload = draw(
        st.dictionaries(st.sampled_from(_field_names) | st.text(max_size=8), _values, max_size=10)
    )
    if draw(st.booleans()):
        payload[KIND_KEY] = draw(_kinds)
    if draw(st.booleans()):
        payload["schema_version"] = draw(_versions)
    return payload


_topics = st.sampled_from([t.value.encode() for t in Topic]) | st.binary(max_size=40)


@_fuzz(EXAMPLES)
@given(topic=_topics, payload=_event_shaped())
def test_event_shaped_maps_are_events_or_one_schema_error(topic, payload):
    with contextlib.suppress(SchemaError):
        assert isinstance(decode([topic, msgpack.packb(payload, use_bin_type=True)]), Event)


_VALID = [
    encode(StepCompleted(sender="rank0", rank=0, step=3, loss=2.5, step_time_s=0.1, samples=8)),
    encode(RecoveryStarted(sender="core", step=4, kind="fail-stop", ranks=[1, 2], reason="x")),
]


@_fuzz(EXAMPLES // 5)
@given(
    which=st.sampled_from(range(len(_VALID))),
    cut=st.integers(min_value=0, max_value=200),
    flips=st.lists(st.tuples(st.integers(0, 199), st.integers(0, 255)), max_size=6),
)
def test_mutated_valid_messages_are_events_or_one_schema_error(which, cut, flips):
    topic, body = _VALID[which]
    data = bytearray(body[: cut or None])
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    with contextlib.suppress(SchemaError):
        assert isinstance(decode([topic, bytes(data)]), Event)


def test_oversized_frames_are_refused_before_unpacking():
    huge = msgpack.packb({KIND_KEY: "step_completed", "pad": b"x" * MAX_PAYLOAD_BYTES})
    with pytest.raises(SchemaError, match=f"exceeds the bus limit of {MAX_PAYLOAD_BYTES}"):
        decode([b"metrics", huge])
    with pytest.raises(SchemaError, match=f"topics are at most {MAX_TOPIC_BYTES}"):
        decode([b"m" * (MAX_TOPIC_BYTES + 1), _VALID[0][1]])


def test_an_event_too_large_for_the_bus_is_refused_where_it_is_made():
    big = RecoveryStarted(sender="core", step=1, kind="fail-stop", ranks=[0],
                          reason="r" * MAX_PAYLOAD_BYTES)  # fmt: skip
    with pytest.raises(SchemaError, match=r"recovery_started encodes to \d+ bytes, over the bus"):
        encode(big)
