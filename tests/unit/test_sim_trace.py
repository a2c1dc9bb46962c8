"""Simulator traces: the published CSV form, its refusals, the mapping onto node slots,
and generated traces."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.sim.trace import (
    EventKind,
    NodeEvent,
    TraceError,
    TraceEvent,
    format_trace,
    full_start,
    parse_trace,
    periodic_failures,
    poisson_failures,
    slot_trace,
    spot_trace,
    to_slots,
)

pytestmark = pytest.mark.timeout(60)

ADD, REMOVE, SLOW = EventKind.ADD, EventKind.REMOVE, EventKind.SLOW

PUBLISHED = """time_ms,event,node
# two nodes at the start, a third arrives, then a spot node is reclaimed
0,add,node1
0,add,i-0abc

60000,add,node4
90000,slow,node4,1.5
120000,remove,node1
"""


def test_a_published_trace_parses_in_order_with_header_comments_and_blank_lines():
    events = parse_trace(PUBLISHED)
    assert events == (
        NodeEvent(0.0, ADD, "node1"),
        NodeEvent(0.0, ADD, "i-0abc"),
        NodeEvent(60000.0, ADD, "node4"),
        NodeEvent(90000.0, SLOW, "node4", 1.5),
        NodeEvent(120000.0, REMOVE, "node1"),
    )
    assert parse_trace(format_trace(events)) == events
    assert format_trace(events).splitlines()[:2] == ["time_ms,event,node", "0,add,node1"]


def test_a_spare_takes_the_slot_of_a_removed_node_with_its_deferred_slowdown():
    trace = slot_trace(PUBLISHED, num_slots=2)
    assert (trace.start_ms, trace.end_ms) == (0.0, 120000.0)
    assert trace.events == (
        TraceEvent(120000.0, REMOVE, 0),
        TraceEvent(120000.0, ADD, 0),
        TraceEvent(120000.0, SLOW, 0, 1.5),
    )
    assert trace.spares == ((0.0, 0), (60000.0, 1), (120000.0, 0))
    assert trace.of_slot(1) == ()
    assert trace.filled_fraction(240.0) == 1.0


def test_the_job_starts_when_every_slot_is_full_and_events_before_are_consumed():
    text = "\n".join([
        "0,add,a", "10,add,b", "15,slow,b,2", "20,remove,a", "30,add,c",
        "40,add,d",  # every slot full: the job's time 0 (c in 0, b in 1, d in 2)
        "40,add,e",  # a spare, even at the very start
        "45,add,f",
        "50,remove,e",  # a spare leaves: the job sees nothing
        "60,remove,b",  # f (e has left) takes slot 1, not slow: the slot's factor resets
        "70,remove,d",  # no spare left: slot 2 stays empty
        "80,add,a",  # an id that left earlier arrives again, into the empty slot
        "90,slow,a,3",
    ])  # fmt: skip
    trace = slot_trace(text, num_slots=3)
    assert trace.start_ms == 40.0 and trace.end_ms == 90.0
    assert trace.events == (
        TraceEvent(0.0, SLOW, 1, 2.0),
        TraceEvent(20.0, REMOVE, 1),
        TraceEvent(20.0, ADD, 1),
        TraceEvent(20.0, SLOW, 1, 1.0),
        TraceEvent(30.0, REMOVE, 2),
        TraceEvent(40.0, ADD, 2),
        TraceEvent(50.0, SLOW, 2, 3.0),
    )
    assert trace.spares == ((0.0, 0), (0.0, 1), (5.0, 2), (10.0, 1), (20.0, 0))
    assert [e.kind for e in trace.of_slot(2)] == [REMOVE, ADD, SLOW]
    # Slot 2 is empty for 10 of the first 100 ms: 3 slots, 290 slot-ms of 300.
    assert trace.filled_fraction(0.1) == pytest.approx(290 / 300)


def test_spares_take_slots_first_come_first_seated():
    text = format_trace(full_start(2)) + "5,add,x\n6,add,y\n7,remove,node1\n8,remove,node0\n"
    trace = slot_trace(text, num_slots=2)
    assert trace.events == (
        TraceEvent(7.0, REMOVE, 1),
        TraceEvent(7.0, ADD, 1),  # x, the first spare
        TraceEvent(8.0, REMOVE, 0),
        TraceEvent(8.0, ADD, 0),  # y
    )


@pytest.mark.parametrize(
    ("text", "slots", "message"),
    [
        (
            "0,add,n1\n0,add,n2\n120000,add,n3\n130000,remove,n1\n",
            4,
            "t.csv: the trace never has 4 nodes at once for the job's 4 node slots "
            "(at most 3, first at 120000 ms): use a smaller job (--dp/--pp/--tp) or a "
            "longer trace",
        ),
        ("# nothing\n", 2, "(it adds no node)"),
    ],
)
def test_a_trace_that_never_fills_the_job_is_refused(text, slots, message):
    with pytest.raises(TraceError) as info:
        slot_trace(text, num_slots=slots, source="t.csv")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "0,add,node1\n10,remove,node1\n5,add,node1\n",
            "t.csv:3: '5,add,node1': time goes backwards (5 ms after 10 ms)",
        ),
        (
            "0,add,node1\n10,reboot,node1\n",
            "t.csv:2: '10,reboot,node1': unknown event 'reboot'; valid: add, remove, slow",
        ),
        (
            "10,remove,node3\n",
            "t.csv:1: '10,remove,node3': node3 is not in the cluster: traces start from an "
            "empty cluster; add every node first (0,add,node3)",
        ),
        ("0,add,a\n10,slow,b,2\n", "t.csv:2: '10,slow,b,2': b is not in the cluster"),
        (
            "0,add,a\n10,remove,a\n20,remove,a\n",
            "t.csv:3: '20,remove,a': a is not in the cluster (it was removed earlier)",
        ),
        ("0,add,a\n\n# c\n5,add,a\n", "t.csv:4: '5,add,a': a is already in the cluster"),
        ("10,add,node 1\n", "node id 'node 1': use letters, digits and _.:-"),
        ("10,add,n/1\n", "t.csv:1: '10,add,n/1': node id 'n/1'"),
        ("10;add;node1\n", "t.csv:1: '10;add;node1': expected time_ms,add|remove,NODE"),
        ("ten,add,node1\n", "time 'ten' is not a number of ms"),
        ("-1,add,node1\n", "must be a finite number >= 0"),
        ("inf,add,node1\n", "must be a finite number >= 0"),
        ("0,add,a\n10,slow,a\n", "t.csv:2: '10,slow,a': a slow event needs a factor"),
        ("0,add,a\n10,slow,a,0.5\n", "factor 0.5 must be >= 1"),
        ("0,add,a\n10,slow,a,x\n", "factor 'x' is not a number"),
        ("10,add,node1,2\n", "only slow events take a factor"),
        ("0,add,a\ntime_ms,event,node\n", "t.csv:2: 'time_ms,event,node': time 'time_ms'"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_line(text, message):
    with pytest.raises(TraceError) as info:
        parse_trace(text, source="t.csv")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_to_slots_refuses_events_that_are_not_a_published_trace():
    with pytest.raises(TraceError, match=r"gen: event 2 '5,add,a': a is already in the cluster"):
        to_slots((NodeEvent(0, ADD, "a"), NodeEvent(5, ADD, "a")), 1, source="gen")
    with pytest.raises(TraceError, match="event 2 '1,add,b': time goes backwards"):
        to_slots((NodeEvent(5, ADD, "a"), NodeEvent(1, ADD, "b")), 1)
    with pytest.raises(ValueError, match="num_slots = 0"):
        to_slots((), 0)


def test_poisson_failures_follow_the_mtbf_and_the_seed():
    # 12 nodes x 8 devices, MTBF 100 h per device: one failure per 1.04 h on average.
    kw = {"num_nodes": 12, "devices_per_node": 8, "mtbf_hours": 100.0}
    hours = 1000
    counts = []
    for seed in range(20):
        events = poisson_failures(**kw, duration_ms=hours * 3_600_000, seed=seed, repair_ms=1.0)
        assert events[:12] == full_start(12), "every node arrives first"
        counts.append(sum(e.kind is REMOVE for e in events))
        times = [e.time_ms for e in events]
        assert times == sorted(times)
    expected = hours * 96 / 100  # repairs take 1 ms, so almost no failure hits a removed node
    mean = sum(counts) / len(counts)
    assert abs(mean - expected) < 0.05 * expected
    once = poisson_failures(**kw, duration_ms=3_600_000 * 50, seed=3)
    assert once == poisson_failures(**kw, duration_ms=3_600_000 * 50, seed=3)
    removed = [e.node for e in once if e.kind is REMOVE]
    assert len(set(removed)) == len(removed), "a removed node cannot fail again"
    assert parse_trace(format_trace(once)) == once
    slots = to_slots(once, 12)
    assert slots.start_ms == 0 and [f"node{e.node}" for e in slots.events] == removed


def test_periodic_failures_keep_one_node_and_map_onto_their_own_slots():
    events = periodic_failures(num_nodes=4, interval_ms=500, count=3)
    assert parse_trace(format_trace(events)) == events
    slots = to_slots(events, 4).events
    assert [(e.time_ms, e.kind, e.node) for e in slots] == [
        (500, REMOVE, 3), (1000, REMOVE, 2), (1500, REMOVE, 1)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="one node must survive"):
        periodic_failures(num_nodes=4, interval_ms=500, count=4)


def _counts_over_time(events):
    present, out = 0, []
    for e in events:
        present += {ADD: 1, REMOVE: -1}.get(e.kind, 0)
        out.append((e.time_ms, present))
    return out


def _mean_nodes(counts, from_h, to_h):
    """Time-averaged nodes present over [from_h, to_h] hours."""
    area, now, held = 0.0, 0.0, 0
    for t_ms, n in [*counts, (math.inf, 0)]:
        t = min(max(t_ms / 3_600_000, from_h), to_h)
        area += held * (t - max(now, from_h)) if t > max(now, from_h) else 0.0
        now, held = max(now, t), n
    return area / (to_h - from_h)


def test_spot_trace_is_a_published_trace_deterministic_per_seed():
    kw = {"capacity": 120, "hours": 24.0, "bursts_per_hour": 1.0}
    trace = spot_trace(**kw, seed=7)
    assert trace == spot_trace(**kw, seed=7) and trace != spot_trace(**kw, seed=8)
    assert parse_trace(format_trace(trace)) == trace, "well-formed: every remove is of a node there"
    adds = Counter(e.node for e in trace if e.kind is ADD)
    assert set(adds.values()) == {1}, "ids are never reused"
    assert all(e.kind is not SLOW for e in trace)
    first = [e for e in trace if e.time_ms <= 300_000]
    assert len(first) == 120 and all(e.kind is ADD for e in first), "120 nodes in 5 minutes"
    counts = _counts_over_time(trace)
    assert max(n for _, n in counts) == 120 and trace[-1].time_ms <= 24 * 3_600_000
    # Bursts: several removals within 30 s of one another.
    removals = [e.time_ms for e in trace if e.kind is REMOVE]
    assert len(removals) > 24
    assert any(b - a <= 30_000 for a, b in itertools.pairwise(removals))
    # The afternoon dip (dip 0.2: 96 grantable at 14:00, 120 at 02:00), hour-averaged.
    assert _mean_nodes(counts, 12, 16) < 100 < 115 < _mean_nodes(counts, 1, 5)


def test_spot_trace_maps_onto_a_job_with_spares():
    trace = to_slots(spot_trace(capacity=44, hours=6.0, seed=1), 40)
    assert 0 < trace.start_ms <= 300_000
    assert any(n > 0 for _, n in trace.spares)
    assert any(e.kind is REMOVE for e in trace.events)
    assert 0.8 < trace.filled_fraction(6 * 3600 - trace.start_ms / 1000) <= 1.0


def test_a_quiet_spot_trace_is_its_arrivals_only():
    trace = spot_trace(capacity=5, hours=1.0, bursts_per_hour=0.0, dip=0.0, arrive_s=0.0)
    assert trace == tuple(NodeEvent(0.0, ADD, f"node{n}") for n in range(5))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"capacity": 0}, "capacity = 0: must be at least 1 node"),
        ({"hours": 0.0}, "hours = 0.0: must be in (0, 1e+06]"),
        ({"hours": math.nan}, "hours = nan"),
        ({"dip": 1.0}, "dip = 1.0: must be in [0, 0.99]"),
        ({"bursts_per_hour": -1.0}, "bursts_per_hour = -1.0"),
        ({"burst_mean": 0.5}, "burst_mean = 0.5: must be in [1, 10]"),
        ({"replace_s": math.inf}, "replace_s = inf"),
        ({"trough_hour": 25.0}, "trough_hour = 25.0: must be in [0, 24]"),
    ],
)
def test_spot_trace_refuses_bad_parameters_naming_them(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spot_trace(**{"capacity": 10, "hours": 1.0, **kw})


@st.composite
def published_traces(draw):
    """A random valid published trace: arrivals (new or returning ids), removals and
    slowdowns of present nodes, times never going backwards."""
    present: list[str] = []
    left: list[str] = []
    events: list[NodeEvent] = []
    t, fresh = 0.0, 0
    for _ in range(draw(st.integers(0, 40))):
        t += draw(st.sampled_from([0.0, 0.0, 1.0, 2.5]))
        action = draw(st.sampled_from(["add", "add", "remove", "slow"]))
        if action == "add" or not present:
            if left and draw(st.booleans()):
                node = left.pop(draw(st.integers(0, len(left) - 1)))
            else:
                node, fresh = f"n{fresh}", fresh + 1
            present.append(node)
            events.append(NodeEvent(t, ADD, node))
        elif action == "remove":
            node = present.pop(draw(st.integers(0, len(present) - 1)))
            left.append(node)
            events.append(NodeEvent(t, REMOVE, node))
        else:
            node = present[draw(st.integers(0, len(present) - 1))]
            events.append(NodeEvent(t, SLOW, node, draw(st.sampled_from([1.0, 1.5, 3.0]))))
    return tuple(events)


@settings(max_examples=200, deadline=None)
@given(published_traces(), st.integers(1, 5))
def test_slot_events_of_any_published_trace_are_consistent(events, num_slots):
    assert parse_trace(format_trace(events)) == events
    most, present = 0, 0
    for e in events:
        present += {ADD: 1, REMOVE: -1}.get(e.kind, 0)
        most = max(most, present)
    if most < num_slots:
        with pytest.raises(TraceError, match="never has"):
            to_slots(events, num_slots)
        return
    trace = to_slots(events, num_slots)
    assert trace.start_ms == next(t for t, n in _counts_over_time(events) if n == num_slots), (
        "the job starts the first moment every slot is full"
    )
    full = set(range(num_slots))  # every slot is full at time 0
    last = 0.0
    for e in trace.events:
        assert e.time_ms >= last and 0 <= e.node < num_slots
        last = e.time_ms
        if e.kind is ADD:
            assert e.node not in full, "an ADD never lands on a full slot"
            full.add(e.node)
        elif e.kind is REMOVE:
            assert e.node in full, "a REMOVE never empties an empty slot"
            full.discard(e.node)
    # Spares fill slots as soon as they empty: slots filled = min(slots, nodes there).
    assert len(full) == min(num_slots, present)
    assert trace.spares[-1][1] == max(0, present - num_slots)
    assert trace.spares[0] == (0.0, 0)
