"""Which snapshot versions a holder keeps (fabric.snapshot): the step a stage lost whole
is rolled back to must still be held when that stage ran a step ahead of its holder.

Regression: scripts/chaos --seed 14 --case 121 (dp3 x pp2; the whole of stage 1 killed in
step 4 after it had shipped that step's gradients; the survivors had committed step 3 and
rolled back to step 2, which the holders had already dropped: every survivor stopped)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elaswave.comm.idle import IdleWork
from elaswave.comm.spec import CommError
from elaswave.engine.plan import initial_plan
from elaswave.engine.recovery import Rebalancing
from elaswave.engine.replan import plan_fail_stop
from elaswave.fabric import snapshot
from elaswave.fabric.adamw import PIECE, OptimizerConfig, ShardState, adamw_update, decay_runs
from elaswave.fabric.snapshot import SnapshotKeeper, kept_versions, state_digest
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig


def test_a_holder_keeps_the_two_newest_and_every_version_from_the_step_before_its_own():
    assert kept_versions([], 5) == []
    assert kept_versions([3], 5) == [3]
    assert kept_versions([2, 3, 4], 3) == [2, 3, 4]  # the owner is a step ahead
    assert kept_versions([2, 3, 4], 5) == [3, 4]
    assert kept_versions([1, 2, 3, 4], 3) == [2, 3, 4]
    assert kept_versions([-1, 0], None) == [-1, 0]
    assert kept_versions([1, 2, 3, 4], None) == [3, 4]  # the holder's step unknown


@given(
    holder=st.integers(min_value=0, max_value=20),
    behind=st.booleans(),
    ahead=st.integers(min_value=-1, max_value=1),
)
def test_the_step_a_lost_stage_rolls_back_to_is_still_held(holder, behind, ahead):
    """Survivors are at most one step apart (the holder is one of them, at ``holder``);
    the lost owner's newest version is at most one step from the holder's. Whatever
    step plan_fail_stop picks for a stage lost whole is among the versions kept."""
    other = holder - 1 if behind else holder  # another survivor's committed step
    newest = holder + ahead
    versions = [-1]  # the initial state
    for step in range(newest + 1):  # the keeper applies the owner's steps in order
        versions = kept_versions([*versions, step], min(holder, step + 1))
    pick = max(max(holder, other) - 1, min(-1, min(holder, other)))
    assert pick in versions, (pick, versions)


class _Owner:
    """The owner's end of a snapshot link: gradients for the keeper (each sent as its
    frame), then its death (None) or the end of its stream (``END``)."""

    name = "snap.3-0"

    def __init__(self) -> None:
        self.sent: queue.Queue[torch.Tensor | float | None] = queue.Queue()

    def recv_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        grad = self.sent.get(timeout=10)
        if grad is None:
            raise CommError(self.name, "recv", "connection closed by peer")
        if isinstance(grad, float):
            tensor.copy_(snapshot.end_frame(tensor.numel() - 1, tensor.dtype))
            return
        tensor[:-1].copy_(grad)
        tensor[-1] = snapshot.GRADIENT


def _started(
    initial: ShardState,
    cfg: OptimizerConfig,
    holder_step: Callable[[], int],
    *,
    record_digests: bool = False,
) -> tuple[SnapshotKeeper, _Owner]:
    """A started keeper of owner 3's shard, and the owner's end of its link."""
    owner = _Owner()
    keeper = SnapshotKeeper(owner=3, link=owner, cfg=cfg, initial=initial,  # type: ignore[arg-type]
                            record_digests=record_digests, holder_step=holder_step)  # fmt: skip
    keeper.start()
    return keeper, owner


def _ship(
    owner: _Owner,
    grad: torch.Tensor,
    step: int,
    expected: ShardState,
    cfg: OptimizerConfig,
    versions: dict[int, ShardState],
    digests: list[str],
) -> None:
    """The owner ships ``step``'s gradient and updates its own shard, whole: the version
    and digest a keeper must give for that step."""
    owner.sent.put(grad)
    adamw_update(expected, grad, step=step, cfg=cfg)
    versions[step] = expected.clone_to("cpu")
    digests.append(state_digest(expected))


def test_a_keeper_whose_owner_ran_a_step_ahead_still_returns_the_step_rolled_back_to():
    cfg = OptimizerConfig()
    n = 8
    initial = ShardState(torch.ones(n), torch.zeros(n), torch.zeros(n), torch.ones(n))
    owner = _Owner()
    holder_step = [-1]
    keeper = SnapshotKeeper(
        owner=3,
        link=owner,  # type: ignore[arg-type]
        cfg=cfg,
        initial=initial,
        holder_step=lambda: holder_step[0],
    )
    keeper.start()
    grads = [torch.full((n,), 0.1 * (k + 1)) for k in range(5)]
    expected = initial.clone_to("cpu")
    at_step_2 = None
    for step, grad in enumerate(grads):
        owner.sent.put(grad)
        keeper.wait(step, timeout_s=10)
        adamw_update(expected, grad, step=step, cfg=cfg)
        if step == 2:
            at_step_2 = expected.clone_to("cpu")
        holder_step[0] = step if step < 3 else 3  # the holder commits up to step 3 only
    owner.sent.put(None)  # the owner dies posting step 5
    with pytest.raises(CommError, match="connection closed"):
        keeper.wait(5, timeout_s=10)
    # Step 2 (one before the holder's step 3), although the owner reached step 4:
    state = keeper.wait(2, timeout_s=10)
    assert at_step_2 is not None and torch.equal(state.master, at_step_2.master)
    assert torch.equal(state.exp_avg_sq, at_step_2.exp_avg_sq)
    # and the versions before it are dropped (once the updates have run)
    assert _eventually(lambda: keeper.catch_up(slack=0) or keeper.steps() == [2, 3, 4])
    keeper.close()


def test_the_rule_for_a_stage_lost_whole_rolls_back_to_the_step_kept():
    """The planner's side of case 121: survivors at step 3, no earlier change."""
    cfg = JobConfig(
        layout=LayoutConfig(dp=3, pp=2), schedule=ScheduleConfig(global_batch=12, micro_batch=2)
    )
    plan = initial_plan(num_layers=6, dp=3, pp=2, global_batch=12, micro_batch=2)
    reb = Rebalancing(layers=cfg.layer_costs, device=cfg.cost_device)
    decision = plan_fail_stop(plan, [3, 4, 5], {0: 3, 1: 3, 2: 3}, ranks_per_node=3,
                              snapshots=True, rebalancing=reb)  # fmt: skip
    assert decision.committed_step == 2
    assert decision.committed_step in kept_versions([2, 3, 4], 3)
    assert decision.committed_step not in kept_versions([2, 3, 4], None)  # as before


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_keeper_gives_every_kept_step_as_sequential_updates_would_and_holds_few_gradients():
    """The keeper applies a gradient only once the version before it is no longer kept:
    a version it gives (a copy, by wait; the state itself, by take) and the digests it
    records equal the owner's in-order updates, bit for bit."""
    cfg = OptimizerConfig()
    n = 64
    gen = torch.Generator().manual_seed(3)
    mask = (torch.arange(n) % 5 != 0).float()  # runs of decayed and plain elements
    initial = ShardState(torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), mask)
    holder_step = [-1]
    keeper, owner = _started(initial, cfg, lambda: holder_step[0], record_digests=True)
    expected = initial.clone_to("cpu")
    versions, digests = {}, []
    for step in range(8):
        _ship(owner, torch.randn(n, generator=gen), step, expected, cfg, versions, digests)
        got = keeper.wait(step, timeout_s=10)
        assert torch.equal(got.master, expected.master)
        assert torch.equal(got.exp_avg_sq, expected.exp_avg_sq)
        # Gradients wait only while their version is kept: applied in waits for
        # communication (none here), or by the training thread's catch-up.
        assert _eventually(lambda: keeper.catch_up(slack=0) or len(keeper._grads) <= 2)
        holder_step[0] = step
    assert keeper.steps() == [5, 6, 7]  # from the step before the holder's (6), on
    early = keeper.wait(6, timeout_s=10)
    assert torch.equal(early.master, versions[6].master)  # a copy: later steps leave it
    assert keeper.digests() == digests
    with pytest.raises(CommError, match="no longer kept"):
        keeper.wait(4, timeout_s=1)
    state = keeper.take(6, timeout_s=10)
    assert torch.equal(state.master, versions[6].master)
    assert keeper.steps() == [6]  # taken: the keeper stopped, the later step dropped
    owner.sent.put(torch.randn(n, generator=gen))  # a gradient after the take: ignored
    assert torch.equal(keeper.take(6, timeout_s=10).master, versions[6].master)


def test_the_fused_update_with_the_decay_folded_in_matches_the_masked_arithmetic():
    """adamw_update's fused path (decayed runs with the decay in the kernel, plain runs
    without) against the tensor-operation path, over masks of every shape of run."""
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for mask in (
        torch.ones(40),
        torch.zeros(40),
        (torch.arange(40) % 7 < 3).float(),
        torch.tensor([0.0] * 5 + [1.0] * 30 + [0.0] * 5),
    ):
        ones, zeros = decay_runs(mask)
        assert sorted(ones + zeros) == [r for r in sorted(ones + zeros) if r[1] > r[0]]
        assert sum(hi - lo for lo, hi in ones) == int(mask.sum())
        assert all(bool(mask[lo:hi].all()) for lo, hi in ones)
        assert not any(bool(mask[lo:hi].any()) for lo, hi in zeros)
        w = torch.randn(40, generator=gen)
        fused = ShardState(w.clone(), torch.zeros(40), torch.zeros(40), mask)
        ref_m, ref_a, ref_s = w.clone(), torch.zeros(40), torch.zeros(40)
        for step in range(4):
            g = torch.randn(40, generator=gen)
            adamw_update(fused, g, step=step, cfg=cfg)
            t, lr = step + 1, cfg.lr_at(step)
            ref_m.mul_(1 - lr * cfg.weight_decay * mask)
            ref_a.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
            ref_s.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
            denom = (ref_s.sqrt() / (1 - cfg.beta2**t) ** 0.5).add_(cfg.eps)
            ref_m.addcdiv_(ref_a, denom, value=-lr / (1 - cfg.beta1**t))
        torch.testing.assert_close(fused.master, ref_m, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fused.exp_avg_sq, ref_s, rtol=1e-6, atol=1e-9)


def test_a_keeper_whose_idle_work_no_wait_runs_is_caught_up_by_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
):
    """A process whose training thread never waits for communication never runs the
    keeper's idle work: catch_up() (called at every step boundary) then applies the due
    updates itself, so gradients never pile up; the versions it gives are the same."""
    idle = IdleWork()
    monkeypatch.setattr(snapshot, "IDLE", idle)
    cfg = OptimizerConfig()
    n = 16
    initial = ShardState(torch.ones(n), torch.zeros(n), torch.zeros(n), torch.ones(n))
    holder_step = [-1]
    keeper, owner = _started(initial, cfg, lambda: holder_step[0])
    expected = initial.clone_to("cpu")
    for step in range(6):
        grad = torch.full((n,), 0.1 * (step + 1))
        owner.sent.put(grad)
        adamw_update(expected, grad, step=step, cfg=cfg)
        keeper.wait(step, timeout_s=10)  # received (a copy is computed to give it)
        holder_step[0] = step
        keeper.catch_up()
        assert len(keeper._grads) <= 3, keeper.steps()
    assert idle.pieces_run == 0 and idle.pending() == 1  # one task per keeper, never run
    assert torch.equal(keeper.take(5, timeout_s=10).master, expected.master)


def test_a_keeper_updated_piece_by_piece_in_waits_gives_the_same_versions(
    monkeypatch: pytest.MonkeyPatch,
):
    """A shard of several pieces: the waits run the keeper's updates a piece at a time
    (a wait may end between two pieces of one step's update, leaving the shard
    part-updated); wait(), digests() and take() finish such an update on the calling
    thread, and every version is bit-identical to the owner's whole updates."""
    idle = IdleWork()
    monkeypatch.setattr(snapshot, "IDLE", idle)
    cfg = OptimizerConfig()
    n = 2 * PIECE + 1000  # three pieces, the last short
    gen = torch.Generator().manual_seed(5)
    mask = (torch.arange(n) % 3000 < 2900).float()
    initial = ShardState(torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), mask)
    holder_step = [-1]
    keeper, owner = _started(initial, cfg, lambda: holder_step[0], record_digests=True)
    expected = initial.clone_to("cpu")
    versions, digests = {}, []
    never = threading.Event()
    for step in range(5):
        _ship(owner, torch.randn(n, generator=gen), step, expected, cfg, versions, digests)
        assert _eventually(lambda: keeper.newest == step)  # noqa: B023
        holder_step[0] = step
        idle.help(never, max_pieces=1)  # a short wait: one piece of a due update
    assert keeper._partial is not None  # a step's update is part-done
    assert keeper.digests() == digests  # finished first, then the versions since
    assert keeper._partial is None
    idle.help(never, max_pieces=1)
    got = keeper.wait(4, timeout_s=10)
    assert torch.equal(got.master, versions[4].master)
    assert torch.equal(got.exp_avg_sq, versions[4].exp_avg_sq)
    idle.help(never, max_pieces=2)
    state = keeper.take(4, timeout_s=10)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(state, name), getattr(versions[4], name)), name
    assert idle.help(never) <= 1 and idle.pending() == 0  # a closed keeper's task ends


def test_a_keeper_whose_update_fails_halfway_gives_no_version(monkeypatch: pytest.MonkeyPatch):
    """A part-updated shard is no step's version: after an update raised, the keeper
    refuses every version instead of giving it."""
    idle = IdleWork()
    monkeypatch.setattr(snapshot, "IDLE", idle)

    def failing(*args: object, **kwargs: object) -> Generator[None, None, None]:
        yield
        raise RuntimeError("out of memory")

    monkeypatch.setattr(snapshot, "adamw_pieces", failing)
    n = 8
    initial = ShardState(torch.ones(n), torch.zeros(n), torch.zeros(n), torch.ones(n))
    keeper, owner = _started(initial, OptimizerConfig(), lambda: 5)
    for _ in range(3):
        owner.sent.put(torch.ones(n))
    assert _eventually(lambda: keeper.newest == 2)
    with pytest.raises(RuntimeError, match="out of memory"):
        keeper.catch_up(slack=0)  # the training thread's catch-up hits the failure
    for ask in (keeper.digests, lambda: keeper.wait(2, timeout_s=1)):
        with pytest.raises(CommError, match="an update failed"):
            ask()
