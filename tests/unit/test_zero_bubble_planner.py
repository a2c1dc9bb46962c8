"""The zero-bubble list scheduler decides as the rule in the schedule module's docstring
says, read literally: at every action, every stage's every possible action is listed
again and the one that can start first runs. The planner itself keeps four counters per
stage and re-examines only the stages an action touches; both must agree exactly."""

from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.engine.schedule import Op, OpCosts, zero_bubble


def _rescanned(m, costs, cap, limits, holds):
    """The rule, rescanning everything at every action (pending ``W`` as a queue)."""
    p = len(costs)
    free, lists = [0.0] * p, [[] for _ in range(p)]
    fwd_end, input_end = {}, {}
    forwards, inputs, weights = [0] * p, [0] * p, [0] * p
    pending = [[] for _ in range(p)]
    for _ in range(3 * p * m):
        best = None
        for s in range(p):
            options = []
            if pending[s]:
                urgent = len(pending[s]) >= cap
                options.append((free[s], 0 if urgent else 3, Op.WEIGHT, pending[s][0]))
            if inputs[s] < forwards[s]:
                mb = inputs[s]
                if s == p - 1:
                    options.append((max(free[s], fwd_end[(s, mb)]), 1, Op.INPUT, mb))
                elif (s + 1, mb) in input_end:
                    ready = input_end[(s + 1, mb)] + costs[s + 1].send_bwd_s
                    options.append((max(free[s], ready), 1, Op.INPUT, mb))
            room = forwards[s] - inputs[s] < limits[s] and forwards[s] - weights[s] < holds[s]
            if forwards[s] < m and room:
                mb = forwards[s]
                if s == 0:
                    options.append((free[s], 2, Op.FORWARD, mb))
                elif (s - 1, mb) in fwd_end:
                    ready = fwd_end[(s - 1, mb)] + costs[s - 1].send_fwd_s
                    options.append((max(free[s], ready), 2, Op.FORWARD, mb))
            for option in options:
                if best is None or (option[0], s, option[1]) < (best[0], best[4], best[1]):
                    best = (*option, s)
        assert best is not None, "no stage can act"
        start, _, op, mb, s = best
        c = costs[s]
        free[s] = start + {Op.FORWARD: c.fwd_s, Op.INPUT: c.input_s, Op.WEIGHT: c.weight_s}[op]
        lists[s].append((op, mb))
        if op is Op.FORWARD:
            fwd_end[(s, mb)], forwards[s] = free[s], forwards[s] + 1
        elif op is Op.INPUT:
            input_end[(s, mb)], inputs[s] = free[s], inputs[s] + 1
            pending[s].append(mb)
        else:
            pending[s].pop(0)
            weights[s] += 1
    return lists


_TIMES = st.sampled_from([0.0, 0.5, 1.0, 2.0, 0.3, 1.7])


@st.composite
def _problems(draw):
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 12))
    costs = [
        OpCosts(draw(_TIMES), draw(_TIMES), draw(_TIMES), draw(_TIMES), draw(_TIMES))
        for _ in range(p)
    ]
    cap = draw(st.integers(1, 8))
    limits = draw(st.lists(st.integers(1, 6), min_size=p, max_size=p))
    holds = draw(st.lists(st.integers(1, 8), min_size=p, max_size=p))
    return m, costs, cap, limits, holds


@settings(max_examples=300, deadline=None)
@given(_problems())
def test_the_planner_decides_as_a_full_rescan_does(problem) -> None:
    m, costs, cap, limits, holds = problem
    planned = zero_bubble(
        num_micro_batches=m, costs=costs, pending_w=cap, in_flight=limits, held=holds
    )
    assert planned == _rescanned(m, costs, cap, limits, holds)
