"""The 1F1B pipeline schedule, as a pure list of actions per stage.

Stage ``s`` of ``P`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. At most ``P - s``
micro-batches are in flight on stage ``s``, which bounds its activation memory.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Op(enum.StrEnum):
    FORWARD = "F"
    BACKWARD = "B"


Action = tuple[Op, int]


def one_f_one_b(*, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
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


def max_in_flight(actions: Iterable[tuple[str, int]]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded."""
    live: set[int] = set()
    peak = 0
    for op, mb in actions:
        if op == Op.FORWARD:
            live.add(mb)
            peak = max(peak, len(live))
        else:
            live.discard(mb)
    return peak
