"""What a rank committed before it applies a plan change, kept until the change is
settled: the state a torn apply rolls back to.

A participant may fail while the others apply a committed plan. The Core then takes
the plan back (:func:`elaswave.engine.phases.applying.roll_back`) and plans again from
the layout before it, with every rank that layout lost: each member goes back to what
it committed under that layout, whether its own apply finished or not. So before it
changes anything, a rank keeps (:func:`keep`):

- its optimizer shard at the change's committed step, by reference, on its device: no
  copy (a change does not write a committed shard; it builds new ones or trains into
  other buffers, and the optimizer recycles no shard anything else refers to,
  :func:`~elaswave.fabric.adamw.recyclable`);
- the host snapshots it holds of other owners: the failed owners' taken at once (the
  change needs them), the others closed as they stand and taken only if a roll-back
  needs them (:meth:`Memento.snapshot`: no update runs for a snapshot never used);
- its layer modules (their parameters are gathered again from the shards).

A change that restores a checkpoint keeps no shard (``state`` None): rolling it back
restores the checkpoint again. The memento is dropped once the Core announces the
change finished (``RecoveryFinished`` of its generation or a later one): no roll-back
can reach it then (:class:`Settled`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from elaswave.engine.plan import Plan
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.snapshot import SnapshotKeeper

if TYPE_CHECKING:  # the trainer carries a memento: only its type is needed here
    from elaswave.runtime.worker.trainer import Trainer


@dataclass
class Memento:
    """What this rank committed under ``plan``, at ``step``."""

    plan: Plan
    step: int
    layers: nn.ModuleList
    layout: InterleavedLayout | None
    """The layout of ``state`` (None with it)."""
    state: ShardState | None
    """This rank's shard after ``step`` (None: the change restores a checkpoint)."""
    keepers: dict[int, SnapshotKeeper] = field(default_factory=dict)
    """Closed keepers of the snapshots this rank holds, by owner, not taken yet."""
    taken: dict[int, ShardState] = field(default_factory=dict)
    """Snapshots taken at ``step``, by owner."""

    def snapshot(self, owner: int, timeout_s: float) -> ShardState:
        """``owner``'s snapshot at ``step``, as this rank holds it (KeyError: none)."""
        if owner not in self.taken:
            self.taken[owner] = self.keepers.pop(owner).take(self.step, timeout_s)
        return self.taken[owner]

    def holds(self) -> set[int]:
        """The owners whose snapshots this rank holds."""
        return set(self.keepers) | set(self.taken)


def keep(trainer: Trainer, step: int, failed: frozenset[int], timeout_s: float) -> Memento:
    """Roll ``trainer`` back to ``step`` and keep what it committed: its shard, the
    snapshots it holds (``failed`` owners' taken now), its layers. Its keepers and
    snapshot sender are closed: the change places snapshots anew."""
    keepers = {k.owner: k for k in trainer.keepers}
    taken = {o: keepers.pop(o).take(step, timeout_s) for o in sorted(failed & set(keepers))}
    trainer.close_snapshots()
    trainer.optimizer.rollback(step)
    opt = trainer.optimizer
    return Memento(
        plan=trainer.plan,
        step=step,
        layers=trainer.layers,
        layout=opt.layout,
        state=opt.state,
        keepers=keepers,
        taken=taken,
    )


def nothing_kept(trainer: Trainer, step: int) -> Memento:
    """What a rank keeps before a change that restores a checkpoint: no state (a
    roll-back restores the checkpoint again)."""
    trainer.close_snapshots()
    trainer.optimizer.abandon()
    return Memento(plan=trainer.plan, step=step, layers=trainer.layers, layout=None, state=None)


class Settled:
    """The newest generation whose change the Core announced finished (set from the
    bus thread, read by the training loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = -1

    def note(self, generation: int) -> None:
        with self._lock:
            self._generation = max(self._generation, generation)

    def covers(self, generation: int) -> bool:
        """Whether the change to ``generation`` is finished: no roll-back reaches it."""
        with self._lock:
            return self._generation >= generation
