"""What each policy's recovery costs, from the data it moves (pure).

Each change stops training for a recovery overhead: fixed control-plane times, which
are assumptions of :class:`RecoveryCosts` and are reported with every result, plus the
time to move the bytes the change needs over the device's links or from storage, which
follows from the plans and the model:

* **ElasWave** (remove): detect, edit the communicator (only the touched groups), and
  restore the failed ranks' ZeRO-1 optimizer shards from the host-memory snapshots on
  their peers; the surviving ranks of a stage each receive their share of the lost
  shards. Layers that the new plan moves stream during the redone step (non-blocking
  migration): only the part of the stream longer than that step is exposed. Joins and
  fail-slow re-plans pay the communicator edit and the moves; a joiner also receives its
  stage's parameters and optimizer shard.
* **ReCycle** (remove): detect and edit the communicator; nothing moves (the peers hold
  the same parameters). A returning rank joins a new quorum and receives its state.
* **TorchFT** (remove): detect and form a new quorum. A rejoining replica forms a new
  quorum and receives a live copy of a replica's parameters and optimizer state.
* Every policy but checkpoint-restart starts a returning node's processes while the
  job trains (the timeline delays the join by the restart time).
* **Restart**: detect, restart every process, rendezvous, and load the checkpoint from
  storage (every device reads its parameters and optimizer shard through its node's
  share of the storage bandwidth); the timeline adds the steps since the last
  checkpoint, which are redone.

Parameters are held in fp32 with an fp32 gradient and a 12-byte Adam state per
parameter sharded over the stage's replicas, as in the cost model's memory figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from elaswave.engine.cost import DeviceSpec, LayerCost
from elaswave.engine.migration import layer_moves
from elaswave.engine.plan import Plan
from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS

PARAM_BYTES = float(FP32_BYTES)
OPTIMIZER_BYTES = float(STATE_TENSORS * FP32_BYTES)


@dataclass(frozen=True)
class RecoveryCosts:
    """Fixed seconds of each recovery step (assumptions, not measurements)."""

    detect_s: float = 3.0
    """A fail-stop is noticed: the runtime's default heartbeat timeout."""
    comm_edit_s: float = 0.5
    """Dynamic Communicator edit at scale (docs/communicator_bench: 8 to 23 ms for 8 ranks
    on gloo; 0.5 s leaves room for link set-up across a large job)."""
    quorum_s: float = 5.0
    """TorchFT: a new quorum and process-group reconfiguration."""
    process_restart_s: float = 60.0
    """Relaunching a worker process: scheduler, container, interpreter, framework and
    device initialisation."""
    rendezvous_s: float = 30.0
    """Checkpoint-restart: rendezvous of every worker and communicator initialisation."""
    storage_bytes_per_s: float = 2e9
    """Checkpoint read bandwidth of one node, shared by its devices."""
    checkpoint_every: int = 100
    """Checkpoint-restart: steps between checkpoints."""

    def __post_init__(self) -> None:
        for name in (
            "detect_s", "comm_edit_s", "quorum_s", "process_restart_s", "rendezvous_s",
        ):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} = {getattr(self, name)!r}: must be >= 0")
        if not self.storage_bytes_per_s > 0:
            raise ValueError(f"storage_bytes_per_s = {self.storage_bytes_per_s!r}: must be > 0")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every = {self.checkpoint_every}: must be >= 1")


@dataclass(frozen=True)
class Overhead:
    """Seconds one change stops training, and what they are made of."""

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    moved_bytes: float = 0.0
    """Largest number of bytes one device receives."""

    @staticmethod
    def of(parts: dict[str, float], moved_bytes: float = 0.0) -> Overhead:
        return Overhead(sum(parts.values()), parts, moved_bytes)


def _stage_params(plan: Plan, layers: Sequence[LayerCost]) -> list[int]:
    cost = {c.index: c for c in layers}
    return [sum(cost[i].params for i in s.layers) for s in plan.stages]


def rank_state_bytes(plan: Plan, layers: Sequence[LayerCost]) -> float:
    """Largest parameters plus optimizer shard one rank of ``plan`` holds."""
    return max(
        p * (PARAM_BYTES + OPTIMIZER_BYTES / s.dp)
        for p, s in zip(_stage_params(plan, layers), plan.stages, strict=True)
    )


def shard_restore_bytes(old: Plan, failed: set[int], layers: Sequence[LayerCost]) -> float:
    """Most bytes one survivor receives to rebuild the failed ranks' optimizer shards."""
    most = 0.0
    for s, params in zip(old.stages, _stage_params(old, layers), strict=True):
        lost = sum(r in failed for r in s.ranks)
        if lost and lost < s.dp:
            most = max(most, lost * params * OPTIMIZER_BYTES / s.dp / (s.dp - lost))
    return most


def migration_bytes(old: Plan, new: Plan, layers: Sequence[LayerCost]) -> float:
    """Most bytes one rank of ``new`` receives for the layers it takes over: their
    parameters and its optimizer shard of them."""
    if old.pp != new.pp:
        return 0.0
    cost = {c.index: c for c in layers}
    into: dict[int, float] = {}
    for move in layer_moves(old, new):
        stage = new.stages[move.dst]
        per_rank = cost[move.layer].params * (PARAM_BYTES + OPTIMIZER_BYTES / stage.dp)
        into[move.dst] = into.get(move.dst, 0.0) + per_rank
    return max(into.values(), default=0.0)


def elaswave_removal(
    old: Plan,
    new: Plan,
    failed: set[int],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    costs: RecoveryCosts,
    *,
    redo_step_s: float,
) -> Overhead:
    restore = shard_restore_bytes(old, failed, layers)
    stream = migration_bytes(old, new, layers)
    return Overhead.of(
        {
            "detect": costs.detect_s,
            "communicator edit": costs.comm_edit_s,
            "shard restore": restore / device.p2p_bytes_per_s,
            "migration exposed": max(0.0, stream / device.p2p_bytes_per_s - redo_step_s),
        },
        max(restore, stream),
    )


def elaswave_reshape(
    old: Plan,
    new: Plan,
    failed: set[int],
    move_bytes: float,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    costs: RecoveryCosts,
) -> Overhead:
    """Ranks change stage (:func:`elaswave.engine.reshape.reshape`): detect, edit the
    communicator, and move, blocking, the layers each rank takes over (parameters and
    its optimizer shard, from the surviving owners or the host snapshots placed on
    other stages); the failed ranks' own shards come back as in any removal."""
    restore = shard_restore_bytes(old, failed, layers)
    parts = {"detect": costs.detect_s} if failed else {}
    parts |= {
        "communicator edit": costs.comm_edit_s,
        "shard restore": restore / device.p2p_bytes_per_s,
        "stage change": move_bytes / device.p2p_bytes_per_s,
    }
    return Overhead.of(parts, max(restore, move_bytes))


def elaswave_replan(
    old: Plan,
    new: Plan,
    joined: Sequence[int],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    costs: RecoveryCosts,
    *,
    redo_step_s: float,
) -> Overhead:
    """A join or a fail-slow re-plan at a step boundary."""
    stream = migration_bytes(old, new, layers)
    parts = {
        "communicator edit": costs.comm_edit_s,
        "migration exposed": max(0.0, stream / device.p2p_bytes_per_s - redo_step_s),
    }
    join = rank_state_bytes(new, layers) if joined else 0.0
    if joined:
        parts["joiner state"] = join / device.p2p_bytes_per_s
    return Overhead.of(parts, max(stream, join))


def recycle_removal(costs: RecoveryCosts) -> Overhead:
    return Overhead.of({"detect": costs.detect_s, "communicator edit": costs.comm_edit_s})


def torchft_removal(costs: RecoveryCosts) -> Overhead:
    return Overhead.of({"detect": costs.detect_s, "quorum": costs.quorum_s})


def rejoin(
    plan: Plan, layers: Sequence[LayerCost], device: DeviceSpec, costs: RecoveryCosts
) -> Overhead:
    """TorchFT or ReCycle: returning ranks (restarted in the background) join a new
    quorum and receive a live copy of their state."""
    state = rank_state_bytes(plan, layers)
    return Overhead.of(
        {"quorum": costs.quorum_s, "state transfer": state / device.p2p_bytes_per_s}, state
    )


def restart(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    costs: RecoveryCosts,
    *,
    devices_per_node: int,
    detect: bool,
) -> Overhead:
    """Checkpoint-restart onto ``plan`` (``detect``: after a failure, not a planned scale)."""
    state = rank_state_bytes(plan, layers)
    parts = {"detect": costs.detect_s} if detect else {}
    parts |= {
        "process restart": costs.process_restart_s,
        "rendezvous": costs.rendezvous_s,
        "checkpoint load": state * devices_per_node / costs.storage_bytes_per_s,
    }
    return Overhead.of(parts, state)
