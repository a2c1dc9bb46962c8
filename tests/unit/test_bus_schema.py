"""Event schemas: every class round-trips, and every kind of bad input is named clearly."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.bus import envelope
from elaswave.bus.codec import MAX_SENDER_BYTES, check_sender, decode, encode, with_seq
from elaswave.bus.schema import (
    EVENT_TYPES,
    KIND_KEY,
    SCHEMA_VERSION,
    Event,
    EventKind,
    Heartbeat,
    RecoveryFinished,
    RecoveryStarted,
    SchemaError,
    StepCompleted,
    Topic,
    WorkerFinished,
)

pytestmark = pytest.mark.timeout(60)

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_SCALARS: dict[object, st.SearchStrategy[object]] = {
    int: _INT64,
    float: st.floats(allow_nan=False),
    bool: st.booleans(),
    str: st.text(max_size=40),
}


def _strategy(tp: object) -> st.SearchStrategy[object]:
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return st.lists(_SCALARS[item], max_size=8)
    return _SCALARS[tp]


def events_of(cls: type[Event]) -> st.SearchStrategy[Event]:
    """Instances of ``cls`` with every field (defaults included) drawn at random."""
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: _strategy(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.name != "schema_version"
    }
    fields["sender"] = st.text(max_size=MAX_SENDER_BYTES // 4)  # up to 4 bytes a character
    return st.builds(cls, **fields)


def _payload(event: Event) -> dict[str, object]:
    return msgpack.unpackb(encode(event)[1])


def _frames(topic: str | bytes, payload: object) -> list[bytes]:
    topic_frame = topic.encode() if isinstance(topic, str) else topic
    return [topic_frame, msgpack.packb(payload)]


def _step_payload(**overrides: object) -> dict[str, object]:
    event = StepCompleted(sender="rank0", rank=0, step=7, loss=1.5, step_time_s=0.2, samples=8)
    return {**_payload(event), **overrides}


# --------------------------------------------------------------------------- registry


def test_one_kind_per_class_with_snake_case_values() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    for kind, cls in EVENT_TYPES.items():
        assert cls.KIND is kind
        assert isinstance(cls.TOPIC, Topic)
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        assert kind.value == snake


def test_events_are_frozen_and_keyword_only() -> None:
    event = Heartbeat(sender="rank1", rank=1, step=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.step = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Heartbeat("rank1", 0, 0, 0.0, 1, 1, 3)  # type: ignore[misc]
    assert event.schema_version == SCHEMA_VERSION


def test_with_seq_replaces_only_seq() -> None:
    event = Heartbeat(sender="rank1", rank=1, step=3, generation=2)
    assert with_seq(event, 9) == dataclasses.replace(event, seq=9)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("cls", list(EVENT_TYPES.values()), ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_event_class_round_trips(cls: type[Event], data: st.DataObject) -> None:
    event = data.draw(events_of(cls))
    frames = encode(event)
    assert frames[0] == f"{cls.TOPIC.value}/{event.sender}".encode()
    decoded = decode(frames)
    assert type(decoded) is cls
    assert decoded == event
    for field in dataclasses.fields(cls):
        assert type(getattr(decoded, field.name)) is type(getattr(event, field.name))


def test_lists_come_back_as_lists() -> None:
    event = RecoveryStarted(sender="core", step=4, kind="fail", ranks=[2, 3], reason="killed")
    decoded = decode(encode(event))
    assert isinstance(decoded, RecoveryStarted)
    assert decoded.ranks == [2, 3]
    assert type(decoded.ranks) is list


def test_unknown_extra_fields_are_ignored() -> None:
    frames = _frames("metrics", _step_payload(new_field_from_v1_1=[1, 2], another="x"))
    decoded = decode(frames)
    assert isinstance(decoded, StepCompleted)
    assert decoded.step == 7


def test_absent_fields_with_defaults_take_the_default() -> None:
    payload = _payload(WorkerFinished(sender="rank2", rank=2, ok=False, reason="oom"))
    del payload["reason"], payload["generation"]
    decoded = decode(_frames("lifecycle", payload))
    assert decoded == WorkerFinished(sender="rank2", rank=2, ok=False, seq=0)


def test_int_is_accepted_for_float_fields() -> None:
    decoded = decode(_frames("recovery", {**_payload(_recovery_finished()), "mttr_s": 2}))
    assert isinstance(decoded, RecoveryFinished)
    assert decoded.mttr_s == 2.0
    assert type(decoded.mttr_s) is float


def _recovery_finished() -> RecoveryFinished:
    return RecoveryFinished(sender="core", step=5, kind="fail", ranks=[1], mttr_s=0.25)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        pytest.param([b"metrics"], "expected 2 frames.*got 1", id="one-frame"),
        pytest.param([b"metrics", b"x", b"y"], "expected 2 frames.*got 3", id="three-frames"),
        pytest.param([], "got 0", id="no-frames"),
        pytest.param([b"metrics", b"\xc1\xff\x00"], r"undecodable msgpack.*\\xc1", id="garbage"),
        pytest.param([b"metrics", b"\x93\x01"], "undecodable msgpack", id="truncated"),
        pytest.param(_frames("metrics", [1, 2]), r"must be a map, got list \[1, 2\]", id="list"),
        pytest.param(
            _frames("metrics", {k: v for k, v in _step_payload().items() if k != KIND_KEY}),
            "no 'event_kind' field",
            id="no-kind",
        ),
        pytest.param(
            _frames("metrics", _step_payload(event_kind="step_exploded")),
            "unknown event kind 'step_exploded'; valid kinds: .*step_completed",
            id="unknown-kind",
        ),
        pytest.param(
            _frames("metrics", _step_payload(schema_version=SCHEMA_VERSION + 1)),
            f"unsupported schema_version {SCHEMA_VERSION + 1} .*newer.*supported: \\[1\\]",
            id="newer-version",
        ),
        pytest.param(
            _frames("metrics", _step_payload(schema_version=0)),
            "unsupported schema_version 0",
            id="older-version",
        ),
        pytest.param(
            _frames("metrics", _step_payload(schema_version="1")),
            "unsupported schema_version '1'",
            id="string-version",
        ),
        pytest.param(
            _frames("health", _step_payload()),
            "topic frame b'health' does not match kind 'step_completed'.*'metrics'",
            id="wrong-topic",
        ),
        pytest.param(
            _frames("metrics", {k: v for k, v in _step_payload().items() if k != "loss"}),
            "step_completed: missing required field 'loss'",
            id="missing-field",
        ),
        pytest.param(
            _frames("metrics", _step_payload(step="7")),
            "field 'step' expected int, got str '7'",
            id="str-for-int",
        ),
        pytest.param(
            _frames("metrics", _step_payload(rank=True)),
            "field 'rank' expected int, got bool True",
            id="bool-for-int",
        ),
        pytest.param(
            _frames("metrics", _step_payload(loss=None)),
            "field 'loss' expected float, got NoneType None",
            id="none-for-float",
        ),
        pytest.param(
            _frames("recovery", {**_payload(_recovery_finished()), "ranks": [1, "2"]}),
            r"field 'ranks' expected list\[int\], got list \[1, '2'\]",
            id="bad-list-item",
        ),
        pytest.param(
            _frames("recovery", {**_payload(_recovery_finished()), "ranks": 3}),
            r"field 'ranks' expected list\[int\], got int 3",
            id="scalar-for-list",
        ),
    ],
)
def test_bad_messages_raise_one_clear_schema_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        decode(frames)


def test_schema_error_is_a_value_error() -> None:
    assert issubclass(SchemaError, ValueError)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_bytes_never_raise_anything_but_schema_error(frames: list[bytes]) -> None:
    with contextlib.suppress(SchemaError):
        decode(frames)


# --------------------------------------------------------------------------- first frame


def test_the_first_frame_names_the_topic_and_the_sender() -> None:
    frames = encode(_recovery_finished())
    assert frames[0] == b"recovery/core"
    assert decode(frames) == _recovery_finished()


def test_a_log_written_with_the_topic_alone_still_decodes() -> None:
    """Event logs written before the sender was on the frame: ``[b"recovery", payload]``."""
    assert decode([b"recovery", encode(_recovery_finished())[1]]) == _recovery_finished()


def test_a_frame_naming_another_sender_is_refused() -> None:
    """A worker's message under the Core's name would reach every worker as the Core's."""
    payload = encode(dataclasses.replace(_recovery_finished(), sender="rank3"))[1]
    with pytest.raises(SchemaError, match="names another sender than the payload's 'rank3'"):
        decode([b"recovery/core", payload])


@pytest.mark.parametrize("name", ["", "a/b", "x" * (MAX_SENDER_BYTES + 1), "\u00e9" * 51])
def test_a_sender_name_the_bus_cannot_carry_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not valid: give a non-empty name without '/'"):
        check_sender(name)
    assert check_sender("x" * MAX_SENDER_BYTES) == "x" * MAX_SENDER_BYTES


def test_encode_refuses_an_overlong_sender() -> None:
    event = dataclasses.replace(_recovery_finished(), sender="x" * (MAX_SENDER_BYTES + 1))
    with pytest.raises(SchemaError, match=f"sender name of {MAX_SENDER_BYTES + 1} bytes, over"):
        encode(event)


def test_encode_refuses_unregistered_classes() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Rogue(Event):
        KIND = EventKind.HEARTBEAT
        TOPIC = Topic.HEALTH

    with pytest.raises(TypeError, match="not a registered event class"):
        encode(Rogue(sender="x"))


def test_registering_a_field_named_like_the_discriminator_fails() -> None:
    with pytest.raises(TypeError, match="event_kind"):

        @envelope.register
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Clash(Event):
            KIND = EventKind.HEARTBEAT
            TOPIC = Topic.HEALTH
            event_kind: str


def test_registering_a_kind_twice_fails() -> None:
    with pytest.raises(TypeError, match="'heartbeat' registered twice"):

        @envelope.register
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class SecondHeartbeat(Event):
            KIND = EventKind.HEARTBEAT
            TOPIC = Topic.HEALTH
