"""What a job fixes for its whole run: the change protocol's constants (pure data).

:func:`elaswave.runtime.job.inputs.rules_of` reads them from the job's configuration;
:func:`elaswave.engine.protocol.step` takes them with every input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elaswave.engine.recovery import Rebalancing

RESTART_WAIT_S = 60.0
"""How long a job that starts failed workers again and lost every member waits for them
to restore its checkpoint, where it waits for no nodes otherwise."""


@dataclass(frozen=True, kw_only=True)
class Rules:
    """What the job fixes for the whole run: the protocol's constants."""

    steps: int
    recovery: bool = True
    """False: the first failure stops the job."""
    ranks_per_node: int = 1
    snapshots: bool = True
    snapshot_copies: int = 1
    """Copies of each optimizer shard's host snapshot, each on another rank."""
    restore: bool = False
    """Whether lost state is restored from the newest disk checkpoint inside the job
    (the job writes checkpoints its ranks can load)."""
    rebalancing: Rebalancing = field(default_factory=Rebalancing)
    """The throughput planner's inputs without the measured slowdowns (the state's)."""
    migration: str = "nonblocking"
    migration_early: int | None = None
    stop_timeout_s: float = 30.0
    """How long members may take to stop at a step boundary, or to apply a plan."""
    ack_timeout_s: float = 10.0
    """How long a participant may take to acknowledge a plan before it is fenced."""
    join_steps: tuple[int, ...] = ()
    """Steps at which the job starts a joiner (``join@STEP`` faults), sorted."""
    can_spawn: bool = True
    """Whether the job can start workers (joiners)."""
    resume_hint: str = ""
    """How to resume after the job stops (names a checkpoint, or says there is none)."""
    first_step: int = -1
    """The step a resumed job starts after (its checkpoint's; -1: a new job): no rank
    can roll back before it."""
    grace_s: float = 0.02
    """Exits this close together are one failure."""
    exit_grace_s: float = 0.5
    """How long a participant that exited while applying a plan is given for its
    report to arrive before its exit stops the job."""
    migrated_wait_s: float = 2.0
    """How long a finished non-blocking migration's reports are waited for."""
    wait_for_nodes_s: float = 0.0
    """How long a job with too few ranks left for its stages waits for joiners, its
    state in memory (0: it shortens its pipeline at once, or stops)."""
    restarts: bool = False
    """Whether the job starts failed workers again (``--max-restarts``): a job that lost
    every member waits for them to restore its checkpoint (:attr:`restore_wait_s`)."""
    shorten_after_wait: bool = True
    """Whether a wait that runs out goes on with fewer stages (if they fit in memory)
    rather than writing a checkpoint and stopping."""
    resume_command: str = ""
    """The flag that resumes this job from a checkpoint it writes (``--resume RUN``)."""

    @property
    def restore_wait_s(self) -> float:
        """How long a job that lost every member waits for joiners to restore its
        checkpoint: its wait for nodes, else the time restarted workers take to come
        (:data:`RESTART_WAIT_S`) if it starts them, else none (it stops)."""
        return self.wait_for_nodes_s or (RESTART_WAIT_S if self.restarts else 0.0)
