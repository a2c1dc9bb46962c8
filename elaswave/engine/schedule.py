"""Pipeline schedules as data: a pure list of actions per stage.

An action is an operation on one micro-batch (notation of torch's pipelining):

* ``F`` forward;
* ``B`` the whole backward: input and weight gradients (1F1B);
* ``I`` the input-gradient half of the backward: what the previous stage needs, sent
  to it at once;
* ``W`` the weight-gradient half, computed later from what ``I`` kept.

**1F1B** (:func:`one_f_one_b`): stage ``s`` of ``P`` runs ``min(P - s - 1, M)`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining
backwards. At most ``P - s`` micro-batches are in flight on stage ``s``, which bounds
its activation memory.

**Zero bubble**: the backward split in ``I`` and ``W``, the ``W`` work placed where
1F1B's bubbles would be: with forward, input- and weight-gradient passes of equal time,
the bubble falls from 1F1B's ``(P - 1)/M`` of the step to ``(P - 1)/3M`` (arXiv
2401.10241). Two constructions:

* :func:`deferred_weights`: 1F1B with every backward split and stage ``s``'s weight
  halves run ``s`` micro-batches late (the paper's handcrafted ZB-H1; torch's
  ``ScheduleInterleavedZeroBubble`` builds the same lists at one stage per rank). At
  equal costs its step is ``3M + P - 1`` units whenever ``M >= P``, and no stage holds
  more than ``P`` micro-batches (1F1B's peak, on its first stage).
* :func:`zero_bubble`, list scheduling over the whole pipeline: each stage runs the
  first of ``I`` (its gradient arrived), ``F`` (its input arrived, fewer than ``P - s``
  micro-batches between ``F`` and ``I``, 1F1B's bound) and ``W`` (the oldest pending
  one) that can start when it is free, and a ``W`` first once ``P - 1`` are pending.
  Given each stage's own costs (a stage that carries a larger share of a micro-batch
  after a loss), it places that stage's extra ``W`` work where its neighbours' waits
  would idle it. It also takes a cap on pending ``W`` and per-stage caps on the
  forwards in flight (``F`` to ``I``) and held (``F`` to ``W``: what memory holds).

**ZB-H1** (:func:`zb_h1`) is whichever of the two gives the shorter step at equal
costs (:func:`span`): the deferred lists for ``M >= P`` (one unit shorter than the list
scheduler's there), the list scheduler's for some pipelines of fewer micro-batches
than stages.

**zb-cost** (:attr:`Schedule.ZB_COST`): the zero-bubble lists chosen for the plan at
hand, by the replica-by-replica simulation, among :func:`zero_bubble`'s at several of
those caps (:func:`elaswave.engine.steptime.plan_lists`); where memory holds them it
lets more than ``P - s`` micro-batches be in flight.

:func:`check` says whether a list is one the runtime can execute and names what is
wrong when it is not.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Op(enum.StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward (input and weight gradients)."""
    INPUT = "I"
    """The input-gradient half of the backward."""
    WEIGHT = "W"
    """The weight-gradient half of the backward."""


class Schedule(enum.StrEnum):
    """The schedules the runtime runs (``--schedule``)."""

    ONE_F_ONE_B = "1f1b"
    ZB_H1 = "zb-h1"
    ZB_COST = "zb-cost"
    """Zero bubble planned for the plan at hand: the :func:`zero_bubble` lists, at
    ZB-H1's and at the plan's own per-stage costs, with more ``W`` pending and more
    forwards in flight where the stage's memory holds them, whose replica-by-replica
    simulated step is shortest (:func:`elaswave.engine.steptime.plan_lists`). Its
    lists depend on the plan and the cost model, not only on the pipeline's shape."""

    @property
    def priced(self) -> bool:
        """Whether the lists depend on the plan and its costs
        (:func:`elaswave.engine.steptime.plan_lists`, not :func:`stage_actions`)."""
        return self is Schedule.ZB_COST


class ScheduleSetting(enum.StrEnum):
    """What a job asks for (``--schedule``): one schedule, or ``auto``: the planner
    chooses, for the initial plan and for every change, the one whose simulated step
    is shortest."""

    AUTO = "auto"
    ONE_F_ONE_B = "1f1b"
    ZB_H1 = "zb-h1"
    ZB_COST = "zb-cost"

    @property
    def choices(self) -> tuple[Schedule, ...]:
        """The schedules the planner may choose from."""
        return tuple(Schedule) if self is ScheduleSetting.AUTO else (Schedule(self.value),)


Action = tuple[Op, int]

ENDS_ACTIVATIONS = (Op.BACKWARD, Op.INPUT)
"""The operations after which a micro-batch no longer holds the stage's activations
(what ``W`` needs is kept until it runs)."""
GRADIENT_OPS = (Op.BACKWARD, Op.WEIGHT)
"""The operations that add to the weight gradients."""


def one_f_one_b(*, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    _check_stage(num_stages, stage, num_micro_batches)
    warmup = min(num_stages - stage - 1, num_micro_batches)
    actions: list[Action] = [(Op.FORWARD, mb) for mb in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < num_micro_batches:
        actions.append((Op.FORWARD, fwd))
        fwd += 1
        actions.append((Op.BACKWARD, bwd))
        bwd += 1
    actions += [(Op.BACKWARD, mb) for mb in range(bwd, num_micro_batches)]
    return actions


@dataclass(frozen=True)
class OpCosts:
    """Seconds one stage spends on one micro-batch in each operation, and sending its
    result (activations forward, input gradients back)."""

    fwd_s: float = 1.0
    input_s: float = 1.0
    weight_s: float = 1.0
    send_fwd_s: float = 0.0
    send_bwd_s: float = 0.0


def zero_bubble(
    *,
    num_micro_batches: int,
    costs: Sequence[OpCosts],
    pending_w: int | None = None,
    in_flight: Sequence[int] | None = None,
    held: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Every stage's zero-bubble list (the module docstring), planned by simulating the
    pipeline with ``costs`` (one per stage). ``pending_w``: at most that many ``W``
    pending on a stage (default ``P - 1``). ``in_flight``: per stage, at most that many
    micro-batches between ``F`` and ``I`` (default ``P - s``, 1F1B's bound). ``held``:
    per stage, at most that many between ``F`` and ``W`` (:func:`max_held`: what its
    memory holds; default no limit but those two)."""
    p, m = len(costs), num_micro_batches
    _check_stage(p, 0, m)
    cap = max(1, p - 1) if pending_w is None else pending_w
    limits = [p - s for s in range(p)] if in_flight is None else list(in_flight)
    if len(limits) != p or min(limits) < 1:
        raise ValueError(f"in_flight {limits}: one limit of at least 1 per stage")
    holds = [m] * p if held is None else list(held)
    if len(holds) != p or min(holds) < 1:
        raise ValueError(f"held {holds}: one limit of at least 1 per stage")
    return [list(x) for x in _planned(m, tuple(costs), cap, tuple(limits), tuple(holds))]


@functools.lru_cache(maxsize=512)  # a change prices many plans of one pipeline: their lists recur
def _planned(
    m: int,
    costs: tuple[OpCosts, ...],
    cap: int,
    limits: tuple[int, ...],
    holds: tuple[int, ...],
) -> tuple[tuple[Action, ...], ...]:
    run = _ListRun(len(costs), m, costs, cap, limits, holds)
    while run.left:
        run.next_action()
    return tuple(tuple(x) for x in run.lists)


def equal_costs(num_stages: int) -> list[OpCosts]:
    """Forward, input- and weight-gradient halves of equal time (ZB-H1's premise); on
    the first stage, whose input is data, the whole backward is its weight half."""
    return [OpCosts(1.0, 0.0, 2.0), *[OpCosts()] * (num_stages - 1)]


def deferred_weights(*, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """Stage ``stage``'s 1F1B list with every backward split and its weight halves
    deferred by the stage's index: 1F1B's ``P - s - 1`` warm-up forwards, then for each
    micro-batch ``k`` the next forward, ``I`` of ``k`` and ``W`` of ``k - s``, then the
    ``W`` left (the module docstring)."""
    _check_stage(num_stages, stage, num_micro_batches)
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    actions: list[Action] = [(Op.FORWARD, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            actions.append((Op.FORWARD, warmup + mb))
        actions.append((Op.INPUT, mb))
        if mb >= stage:
            actions.append((Op.WEIGHT, mb - stage))
    actions += [(Op.WEIGHT, mb) for mb in range(max(0, m - stage), m)]
    return actions


def span(lists: Sequence[Sequence[Action]], costs: Sequence[OpCosts]) -> float:
    """The step of a pipeline running these lists at these per-stage costs (the last
    stage to finish: :func:`finish_times`)."""
    return max(finish_times(lists, costs))


def finish_times(lists: Sequence[Sequence[Action]], costs: Sequence[OpCosts]) -> list[float]:
    """When each stage ends its list, every action run as soon as its stage is free and
    its input is there (a forward's from the stage before, an input gradient's from the
    stage after, each after its send)."""
    p = len(lists)
    free = [0.0] * p
    ends: dict[tuple[bool, int, int], float] = {}  # (gradient?, stage, mb): F's or I's end
    nxt = [0] * p
    left = sum(len(x) for x in lists)
    while left:
        moved = False
        for s in range(p):
            while nxt[s] < len(lists[s]):
                op, mb = lists[s][nxt[s]]
                ready = _input_ready(op, s, mb, costs, ends)
                if ready is None:
                    break
                free[s] = max(free[s], ready) + _seconds(op, costs[s])
                if op is not Op.WEIGHT:
                    ends[(op is not Op.FORWARD, s, mb)] = free[s]
                nxt[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError("the lists wait on each other: no action can start")
    return free


def _input_ready(
    op: Op, s: int, mb: int, costs: Sequence[OpCosts], ends: dict[tuple[bool, int, int], float]
) -> float | None:
    """When ``op`` of micro-batch ``mb`` on stage ``s`` has its input (None: not yet)."""
    if op is Op.WEIGHT or (op is Op.FORWARD and s == 0):
        return 0.0
    if op is Op.FORWARD:
        end = ends.get((False, s - 1, mb))
        return None if end is None else end + costs[s - 1].send_fwd_s
    if s == len(costs) - 1:  # the loss: after the stage's own forward
        return ends.get((False, s, mb))
    end = ends.get((True, s + 1, mb))
    return None if end is None else end + costs[s + 1].send_bwd_s


def _seconds(op: Op, cost: OpCosts) -> float:
    if op is Op.FORWARD:
        return cost.fwd_s
    if op is Op.INPUT:
        return cost.input_s
    if op is Op.WEIGHT:
        return cost.weight_s
    return cost.input_s + cost.weight_s


@functools.lru_cache(maxsize=64)
def _zb_h1_lists(num_stages: int, num_micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    p, m = num_stages, num_micro_batches
    costs = equal_costs(p)
    deferred = tuple(
        tuple(deferred_weights(num_stages=p, stage=s, num_micro_batches=m)) for s in range(p)
    )
    planned = tuple(tuple(x) for x in zero_bubble(num_micro_batches=m, costs=costs))
    return min((deferred, planned), key=lambda lists: span(lists, costs))  # ties: deferred


def zb_h1(*, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """Stage ``stage``'s ZB-H1 list: of :func:`deferred_weights` and :func:`zero_bubble`
    at :func:`equal_costs`, the lists with the shorter :func:`span`."""
    _check_stage(num_stages, stage, num_micro_batches)
    return list(_zb_h1_lists(num_stages, num_micro_batches)[stage])


def stage_actions(
    schedule: Schedule, *, num_stages: int, stage: int, num_micro_batches: int
) -> list[Action]:
    """Stage ``stage``'s list under ``schedule``; ValueError for a
    :attr:`~Schedule.priced` one, whose lists are planned for a plan and its cost model
    (:func:`elaswave.engine.steptime.plan_lists`)."""
    if schedule.priced:
        raise ValueError(
            f"schedule {schedule} plans its lists for a plan: use "
            "elaswave.engine.steptime.plan_lists"
        )
    make = one_f_one_b if schedule is Schedule.ONE_F_ONE_B else zb_h1
    return make(num_stages=num_stages, stage=stage, num_micro_batches=num_micro_batches)


class _ListRun:
    """The list scheduler of :func:`zero_bubble`: one action at a time, on the stage
    whose next action can start first (ties: the lower stage).

    A stage's pending ``W`` are always its oldest input-gradient halves, so its state
    is four counters (forwards, inputs, weights) and when it is free; an action changes
    only its own stage's next choice and its neighbours' (a forward readies the next
    stage's, an input gradient the previous stage's), so only those are re-examined."""

    def __init__(
        self,
        p: int,
        m: int,
        costs: Sequence[OpCosts],
        cap: int,
        limits: Sequence[int],
        holds: Sequence[int],
    ) -> None:
        self.p, self.m, self.costs, self.cap = p, m, costs, cap
        self.limits, self.holds = list(limits), list(holds)
        self.free = [0.0] * p
        self.lists: list[list[Action]] = [[] for _ in range(p)]
        self.fwd_end = [[0.0] * m for _ in range(p)]
        self.input_end = [[0.0] * m for _ in range(p)]
        self.forwards = [0] * p
        self.inputs = [0] * p
        self.weights = [0] * p
        self.left = 3 * p * m
        self.best: list[tuple[float, Op, int] | None] = [self._choice(s) for s in range(p)]

    def _choice(self, s: int) -> tuple[float, Op, int] | None:
        """(start, op, micro-batch) of what stage ``s`` runs next if chosen: of the
        actions it may run, those that can start first, and of those a ``W`` once
        :attr:`cap` are pending, then ``I``, then ``F``, then any ``W``."""
        free = self.free[s]
        fwd, inp, wgt = self.forwards[s], self.inputs[s], self.weights[s]
        best: tuple[float, int, Op, int] | None = None
        if inp > wgt:
            best = (free, 0 if inp - wgt >= self.cap else 3, Op.WEIGHT, wgt)
        if inp < fwd:
            if s == self.p - 1:
                ready: float | None = self.fwd_end[s][inp]
            elif self.inputs[s + 1] > inp:
                ready = self.input_end[s + 1][inp] + self.costs[s + 1].send_bwd_s
            else:
                ready = None
            if ready is not None:
                cand = (ready if ready > free else free, 1, Op.INPUT, inp)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if fwd < self.m and fwd - inp < self.limits[s] and fwd - wgt < self.holds[s]:
            if s == 0:
                ready = 0.0
            elif self.forwards[s - 1] > fwd:
                ready = self.fwd_end[s - 1][fwd] + self.costs[s - 1].send_fwd_s
            else:
                ready = None
            if ready is not None:
                cand = (ready if ready > free else free, 2, Op.FORWARD, fwd)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[0], best[2], best[3])

    def next_action(self) -> None:
        s, chosen = -1, None
        for t, c in enumerate(self.best):
            if c is not None and (chosen is None or c[0] < chosen[0]):
                s, chosen = t, c
        if chosen is None:
            raise RuntimeError("the zero-bubble planner made no progress")
        start, op, mb = chosen
        cost = self.costs[s]
        self.lists[s].append((op, mb))
        self.left -= 1
        if op is Op.FORWARD:
            end = self.free[s] = start + cost.fwd_s
            self.fwd_end[s][mb] = end
            self.forwards[s] += 1
        elif op is Op.INPUT:
            end = self.free[s] = start + cost.input_s
            self.input_end[s][mb] = end
            self.inputs[s] += 1
        else:
            self.free[s] = start + cost.weight_s
            self.weights[s] += 1
        for t in (s - 1, s, s + 1):
            if 0 <= t < self.p:
                self.best[t] = self._choice(t)


def check(
    actions: Sequence[tuple[str, int]],
    *,
    num_stages: int,
    stage: int,
    num_micro_batches: int,
    in_flight: int | None = None,
) -> None:
    """ValueError naming what is wrong unless ``actions`` is a list stage ``stage`` can
    run: every micro-batch forwarded once, then either backwarded whole (``B``) or in
    two halves (``I`` then ``W``), each once; at most ``in_flight`` (default
    ``num_stages - stage``, 1F1B's bound) micro-batches between their forward and the
    end of their activations."""
    _check_stage(num_stages, stage, num_micro_batches)
    bound = num_stages - stage if in_flight is None else in_flight
    seen: dict[int, list[Op]] = {}
    live: set[int] = set()
    for index, (raw, mb) in enumerate(actions):
        try:
            op = Op(raw)
        except ValueError:
            raise ValueError(f"action {index}: unknown operation {raw!r} (F, B, I or W)") from None
        if not 0 <= mb < num_micro_batches:
            raise ValueError(
                f"action {index} ({op}{mb}): micro-batch out of 0..{num_micro_batches - 1}"
            )
        done = seen.setdefault(mb, [])
        need = {Op.FORWARD: [], Op.BACKWARD: [Op.FORWARD], Op.INPUT: [Op.FORWARD]}.get(
            op, [Op.FORWARD, Op.INPUT]
        )
        if done != need:
            raise ValueError(
                f"action {index} ({op}{mb}): comes after {''.join(done) or 'nothing'} of "
                f"micro-batch {mb}; it must come after {''.join(need) or 'nothing'}"
            )
        done.append(op)
        if op is Op.FORWARD:
            live.add(mb)
            if len(live) > bound:
                raise ValueError(
                    f"action {index} ({op}{mb}): {len(live)} micro-batches in flight on stage "
                    f"{stage}; at most {bound}"
                )
        elif op in ENDS_ACTIVATIONS:
            live.discard(mb)
    unfinished = sorted(mb for mb in range(num_micro_batches) if seen.get(mb) not in _WHOLE)
    if unfinished:
        raise ValueError(f"micro-batches {unfinished} are not forwarded and backwarded whole")


_WHOLE = ([Op.FORWARD, Op.BACKWARD], [Op.FORWARD, Op.INPUT, Op.WEIGHT])


def max_in_flight(actions: Iterable[tuple[str, int]]) -> int:
    """Largest number of micro-batches forwarded whose activations are still held (not
    yet through ``B`` or ``I``)."""
    return _peak_live(actions, ENDS_ACTIVATIONS)


def max_held(actions: Iterable[tuple[str, int]]) -> int:
    """Largest number of micro-batches forwarded whose weight gradients are not computed
    yet (not through ``B`` or ``W``): what a split schedule holds for its deferred
    weight halves, priced as whole activations (an upper bound)."""
    return _peak_live(actions, GRADIENT_OPS)


def _peak_live(actions: Iterable[tuple[str, int]], ends: tuple[Op, ...]) -> int:
    """Largest number of micro-batches between their forward and an op of ``ends``."""
    live: set[int] = set()
    peak = 0
    for op, mb in actions:
        if op == Op.FORWARD:
            live.add(mb)
            peak = max(peak, len(live))
        elif op in ends:
            live.discard(mb)
    return peak


def _check_stage(num_stages: int, stage: int, num_micro_batches: int) -> None:
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(
            f"{num_stages} stages, {num_micro_batches} micro-batches: need at least 1 of each"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
