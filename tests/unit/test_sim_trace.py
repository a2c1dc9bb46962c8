"""Simulator traces: the CSV form, its refusals, and generated failures."""

from __future__ import annotations

import pytest

from elaswave.sim.trace import (
    EventKind,
    TraceError,
    TraceEvent,
    format_trace,
    parse_trace,
    periodic_failures,
    poisson_failures,
)

pytestmark = pytest.mark.timeout(60)

GOOD = """time_ms,event,node
# a spot node is reclaimed, comes back, and another runs hot
1000,remove,node3
2500.5,add,node3

4000,slow,node1,1.5
9000,slow,node1,1
"""


def test_a_trace_parses_in_order_with_header_comments_and_blank_lines():
    events = parse_trace(GOOD, num_nodes=4)
    assert events == (
        TraceEvent(1000.0, EventKind.REMOVE, 3),
        TraceEvent(2500.5, EventKind.ADD, 3),
        TraceEvent(4000.0, EventKind.SLOW, 1, 1.5),
        TraceEvent(9000.0, EventKind.SLOW, 1, 1.0),
    )
    assert parse_trace(format_trace(events), num_nodes=4) == events


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "10,remove,node1\n5,add,node1\n",
            "t.csv:2: '5,add,node1': time goes backwards (5 ms after 10 ms)",
        ),
        (
            "10,reboot,node1\n",
            "t.csv:1: '10,reboot,node1': unknown event 'reboot'; valid: add, remove, slow",
        ),
        (
            "10,remove,node9\n",
            "t.csv:1: '10,remove,node9': unknown node 'node9'; valid: node0 .. node3",
        ),
        ("10,remove,n1\n", "unknown node 'n1'"),
        ("10;remove;node1\n", "t.csv:1: '10;remove;node1': expected time_ms,add|remove,nodeN"),
        ("ten,remove,node1\n", "time 'ten' is not a number of ms"),
        ("-1,remove,node1\n", "must be a finite number >= 0"),
        ("10,slow,node1\n", "a slow event needs a factor"),
        ("10,slow,node1,0.5\n", "factor 0.5 must be >= 1"),
        ("10,remove,node1,2\n", "only slow events take a factor"),
        (
            "10,remove,node1\n20,remove,node1\n",
            "t.csv:2: '20,remove,node1': node1 is not in the job",
        ),
        ("10,add,node2\n", "node2 is already in the job"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_line(text, message):
    with pytest.raises(TraceError) as info:
        parse_trace(text, num_nodes=4, source="t.csv")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_poisson_failures_follow_the_mtbf_and_the_seed():
    # 12 nodes x 8 devices, MTBF 100 h per device: one failure per 1.04 h on average.
    kw = {"num_nodes": 12, "devices_per_node": 8, "mtbf_hours": 100.0}
    hours = 1000
    counts = []
    for seed in range(20):
        events = poisson_failures(**kw, duration_ms=hours * 3_600_000, seed=seed, repair_ms=1.0)
        counts.append(sum(e.kind is EventKind.REMOVE for e in events))
        times = [e.time_ms for e in events]
        assert times == sorted(times)
    expected = hours * 96 / 100  # repairs take 1 ms, so almost no failure hits a removed node
    mean = sum(counts) / len(counts)
    assert abs(mean - expected) < 0.05 * expected
    once = poisson_failures(**kw, duration_ms=3_600_000 * 50, seed=3)
    assert once == poisson_failures(**kw, duration_ms=3_600_000 * 50, seed=3)
    assert len({e.node for e in once}) == len(once), "a removed node cannot fail again"
    assert parse_trace(format_trace(once), num_nodes=12) == once


def test_periodic_failures_keep_one_node():
    events = periodic_failures(num_nodes=4, interval_ms=500, count=3)
    assert [(e.time_ms, e.node) for e in events] == [(500, 3), (1000, 2), (1500, 1)]
    with pytest.raises(ValueError, match="one node must survive"):
        periodic_failures(num_nodes=4, interval_ms=500, count=4)
