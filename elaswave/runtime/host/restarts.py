"""Workers started again after a failure on a host that is still up (``--max-restarts``).

A worker that fails while its host lives (a crash, an error, a hang the Core fenced)
leaves its device free. Its host offers the device to the Core again as one joining
worker, as a host that joins offers its slots (:mod:`elaswave.runtime.host.nodes`): a
:class:`~elaswave.bus.schema.ScaleRequest` whose reason says which failure it answers.
The Core's join plan brings the new worker in at a step boundary while the others train
on; where the failure stopped a stage (no rank left in it) the job waits for it with
``--wait-for-nodes``, its state in memory. So it is torchrun's ``--max-restarts``
without stopping the job.

* **Unit.** Under ``--tp N`` the failure unit is the TP group: its N devices are offered
  as one worker once every member has exited (the Core fences the rest of a group one
  of whose members failed).
* **Not offered.** A unit whose members all finished (exit 0); one of a host that was
  lost (it comes back as a joining host, if at all); one the Core asked to leave (a
  joiner of a job that is over: chaos seed 48611, case 7); any once the job is ending;
  any beyond the job's ``max_restarts``.

The bookkeeping is pure: the job host (:class:`~elaswave.runtime.host.launcher.JobHost`)
tells :class:`Restarts` of each exit and publishes what it offers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elaswave.engine.phases.shared import exit_text


@dataclass(frozen=True)
class Offer:
    """One failed unit's devices, offered again as a joining worker."""

    unit: int
    """The plan rank (TP group) that failed."""
    node: int
    """Its host, where the joining worker is to start."""
    count: int
    """This offer's number among the job's (1, 2, ...)."""
    budget: int
    """The job's ``max_restarts``."""
    codes: tuple[int, ...]
    """Its members' exit statuses (``-signal`` for a signal), by member."""

    @property
    def reason(self) -> str:
        """The :class:`~elaswave.bus.schema.ScaleRequest`'s reason."""
        codes = ", ".join(exit_text(c) for c in self.codes)
        return (
            f"restart {self.count} of {self.budget}: rank {self.unit} failed ({codes}) on "
            f"node {self.node}, which is up; its device is offered again"
        )


@dataclass
class Restarts:
    """Which failures the job offers again (see the module docstring)."""

    tp: int
    budget: int
    offered: int = 0
    ending: bool = False
    """Set once the job ends: its workers are stopped, not failing."""
    _exits: dict[int, dict[int, int]] = field(default_factory=dict)
    """unit -> member -> exit status, of units with a member that exited."""
    _sent_away: set[int] = field(default_factory=set)
    """Units the Core asked to leave."""

    def sent_away(self, rank: int) -> None:
        """The Core asked worker process ``rank`` to leave (a late joiner, the job
        over): its unit's exit is no failure."""
        self._sent_away.add(rank // self.tp)

    def exited(self, rank: int, code: int, *, node: int, host_up: bool) -> Offer | None:
        """Worker process ``rank`` (member ``rank % tp`` of unit ``rank // tp``) exited
        with ``code`` on ``node``: the offer its exit completes, if any."""
        unit, member = divmod(rank, self.tp)
        codes = self._exits.setdefault(unit, {})
        if member in codes:
            return None  # told twice
        codes[member] = code
        if len(codes) < self.tp or self.ending or not host_up or unit in self._sent_away:
            return None
        if not any(codes.values()) or self.offered >= self.budget:
            return None
        self.offered += 1
        return Offer(unit, node, self.offered, self.budget, tuple(codes[m] for m in range(self.tp)))
