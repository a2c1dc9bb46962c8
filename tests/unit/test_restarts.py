"""Which failed workers' devices a job offers again (``--max-restarts``): a TP group
once all its members exited, not a finished one, not one of a lost host, not one the
Core sent away, not once the job ends, at most the budget."""

from __future__ import annotations

import pytest

from elaswave.runtime.host.restarts import Restarts
from elaswave.runtime.job.config import JobConfig


def test_a_failed_worker_is_offered_once_within_the_budget():
    restarts = Restarts(tp=1, budget=2)
    first = restarts.exited(3, -9, node=1, host_up=True)
    assert first is not None and (first.unit, first.node, first.count) == (3, 1, 1)
    assert first.reason == (
        "restart 1 of 2: rank 3 failed (signal SIGKILL) on node 1, which is up; its device "
        "is offered again"
    )
    assert restarts.exited(3, -9, node=1, host_up=True) is None  # told twice
    assert restarts.exited(4, 0, node=0, host_up=True) is None  # it finished
    assert restarts.exited(5, 1, node=2, host_up=False) is None  # its host was lost
    assert restarts.exited(6, 1, node=0, host_up=True).count == 2  # type: ignore[union-attr]
    assert restarts.exited(7, 1, node=0, host_up=True) is None  # past the budget
    assert restarts.offered == 2


def test_a_tp_group_is_offered_as_one_worker_once_every_member_exited():
    restarts = Restarts(tp=2, budget=3)
    assert restarts.exited(3, -9, node=0, host_up=True) is None  # member 1 of unit 1
    offer = restarts.exited(2, 1, node=0, host_up=True)  # member 0, failed with its group
    assert offer is not None and offer.unit == 1 and offer.codes == (1, -9)
    assert "rank 1 failed (code 1, signal SIGKILL)" in offer.reason
    restarts.ending = True  # the job stops its workers: no failure
    assert restarts.exited(4, -9, node=0, host_up=True) is None
    assert restarts.exited(5, -9, node=0, host_up=True) is None


def test_a_unit_the_core_sent_away_is_not_offered():
    """A joiner of a job that is over, asked to leave (SIGTERM), is no failure: its
    exit does not start another joiner that no plan would take (chaos seed 48611,
    case 7: it waited 60 s and failed)."""
    restarts = Restarts(tp=2, budget=2)
    restarts.sent_away(5)  # member 1 of unit 2
    assert restarts.exited(4, -15, node=1, host_up=True) is None
    assert restarts.exited(5, -15, node=1, host_up=True) is None
    assert restarts.offered == 0
    assert restarts.exited(6, -9, node=1, host_up=True) is None  # unit 3: one member yet
    assert restarts.exited(7, -9, node=1, host_up=True) is not None  # a failure is


@pytest.mark.parametrize("value", [-1, 1.5, True, 10**7])
def test_max_restarts_is_a_count(value):
    with pytest.raises(ValueError, match=rf"^max_restarts = {value!r}: must be an integer"):
        JobConfig.from_dict({"elastic": {"max_restarts": value}})
