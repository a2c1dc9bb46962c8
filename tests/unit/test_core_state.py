"""The Core's persisted state (core_state.json): every state the dataclasses can hold
reads back equal after a JSON round trip, and a state of another version is refused
with one clear message.

States are generated from the dataclasses' own type hints (every phase of a change,
records, maps keyed by rank and by (generation, rank), optionals), so a field added to
a state type is covered by being declared.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from elaswave.engine import change as ch
from elaswave.engine.codec import from_json, to_json
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.record import record_to_json
from elaswave.runtime.core.supervisor import JobFailed, load_state
from tests.unit.test_record import sample_record

PLANS = [
    initial_plan(num_layers=6, dp=dp, pp=pp, global_batch=4 * dp, micro_batch=1)
    for dp, pp in [(1, 2), (2, 2), (3, 1)]
]


@typing.no_type_check
def values(tp) -> st.SearchStrategy:
    """Any value of declared type ``tp`` (the codec's vocabulary)."""
    if tp is Plan:
        return st.sampled_from(PLANS)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(values(a) for a in args))
    if origin is tuple:
        if args[-1] is Ellipsis:
            return st.lists(values(args[0]), max_size=3).map(tuple)
        return st.tuples(*(values(a) for a in args))
    if origin is frozenset:
        return st.frozensets(values(args[0]), max_size=3)
    if origin is Mapping:
        return st.dictionaries(values(args[0]), values(args[1]), max_size=3)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: values(hints[f.name]) for f in dataclasses.fields(tp) if f.init}
        return st.builds(tp, **fields)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    return {
        int: st.integers(-3, 2**40),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(max_size=6),
        bool: st.booleans(),
        type(None): st.none(),
    }[tp]


@settings(max_examples=300, deadline=None)
@given(values(ch.State))
def test_every_state_reads_back_equal_after_a_json_round_trip(state: ch.State) -> None:
    doc = json.loads(json.dumps(ch.state_to_json(state)))
    assert ch.state_from_json(doc) == state


def test_the_log_position_a_state_has_taken_in_reads_back_beside_it(tmp_path: Path) -> None:
    state = ch.initial_state(PLANS[1])
    path = tmp_path / "core_state.json"
    path.write_text(json.dumps(ch.state_to_json(state, log_position=123456)))
    assert load_state(path) == (state, 123456)
    for bad in (-1, 1.5, "12", None):
        doc = {**ch.state_to_json(state), "log_position": bad}
        with pytest.raises(ValueError, match=f"log_position = {bad!r}: must be an int >= 0"):
            ch.log_position(doc)


@settings(max_examples=100, deadline=None)
@given(values(ch.Change))
def test_every_phase_of_a_change_reads_back_equal(change: ch.Change) -> None:
    doc = json.loads(json.dumps(to_json(change, ch.Change)))
    assert doc["phase"]["type"] == change.phase.TAG  # the phase, tagged with its name
    assert from_json(doc, ch.Change) == change


def test_the_plan_and_the_records_keep_the_forms_the_job_host_reads() -> None:
    """The job host summarises a run from core_state.json when the Core is lost: the
    plan's stages and summary.json's records, as before."""
    record = sample_record()
    state = dataclasses.replace(ch.initial_state(PLANS[1]), recoveries=(record,))
    doc = json.loads(json.dumps(ch.state_to_json(state)))
    assert doc["version"] == ch.CORE_STATE_VERSION
    assert [s["ranks"] for s in doc["plan"]["stages"]] == [[0, 1], [2, 3]]
    assert doc["recoveries"] == [json.loads(json.dumps(record_to_json(record)))]


def test_a_state_of_another_version_is_refused_naming_the_file_and_the_versions(
    tmp_path: Path,
) -> None:
    path = tmp_path / "core_state.json"
    doc = ch.state_to_json(ch.initial_state(PLANS[0]))
    path.write_text(json.dumps(doc))
    assert load_state(path) == (ch.initial_state(PLANS[0]), 0)
    for old in ({**doc, "version": 1}, {k: v for k, v in doc.items() if k != "version"}):
        path.write_text(json.dumps(old))
        with pytest.raises(JobFailed) as caught:
            load_state(path)
        message = str(caught.value)
        assert str(path) in message
        assert (
            f"version 1 (records of schema 1), and this Core reads version {ch.CORE_STATE_VERSION}"
            in message
        )


def test_a_malformed_state_names_the_field() -> None:
    doc = json.loads(json.dumps(ch.state_to_json(ch.initial_state(PLANS[0]))))
    with pytest.raises(ValueError, match=r"\$\.next_rank: expected int"):
        ch.state_from_json({**doc, "next_rank": "two"})
    with pytest.raises(ValueError, match=r"unknown fields \['spare'\] of State"):
        ch.state_from_json({**doc, "spare": 1})
