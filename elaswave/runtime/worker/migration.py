"""The data-plane half of a non-blocking layer migration, on one rank.

:func:`elaswave.engine.migration.plan_transition` decides, identically on every rank,
which layers move, how many early micro-batches of the transition step keep the old
layer placement, and the parameter streams and gradient paybacks between replicas.
:class:`ShadowStep` carries it out during that step:

* :meth:`ShadowStep.start` (at the step boundary, right after the communicator edit)
  posts each outgoing layer's parameter stream and each incoming layer's receive;
* :meth:`ShadowStep.layers_for` gives the modules a micro-batch runs: the old stage's
  (kept layers plus the shadows of outgoing ones) before ``early``, the new stage's
  after it, waiting for the incoming parameters the first time they are needed;
* :meth:`ShadowStep.after_backward` ships each shadow's accumulated gradient (the
  payback) to its target as soon as the last early micro-batch's backward is done, and
  :meth:`ShadowStep.finish` (after the last backward) adds the paybacks this rank
  receives to its own gradients.

On the emulated device each stream and payback is delivered after its modelled transfer
time (:class:`~elaswave.runtime.worker.emulation.DelayedSend`), so the overlap with compute is
the modelled device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from elaswave.comm.communicator import Communicator
from elaswave.comm.group import P2PGroup
from elaswave.comm.spec import TagSpace, p2p_tag
from elaswave.engine.migration import Transfer, Transition
from elaswave.engine.plan import Plan
from elaswave.fabric.hostplane import as_host, host_empty
from elaswave.fabric.remap_exec import remap_link_name
from elaswave.runtime.worker.emulation import DelayedSend, Pacer

log = structlog.get_logger(__name__)


def migration_pairs(transition: Transition) -> set[tuple[int, int]]:
    """Rank pairs (lower first) a transition's streams and paybacks use."""
    return {
        (min(t.src, t.dst), max(t.src, t.dst))
        for t in (*transition.streams, *transition.paybacks)
        if t.src != t.dst
    }


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return parameters_to_vector(tensors).contiguous()


def _pieces(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped like ``like``."""
    return [
        piece.view_as(t)
        for piece, t in zip(flat.split([t.numel() for t in like]), like, strict=True)
    ]


class ShadowStep:
    """One rank's part in the transition step ``step`` of a non-blocking migration."""

    def __init__(
        self,
        *,
        transition: Transition,
        rank: int,
        step: int,
        old_plan: Plan,
        new_plan: Plan,
        modules: Mapping[int, nn.Module],
        shadows: Mapping[int, nn.Module],
        comm: Communicator,
        pacer: Pacer,
        timeout_s: float,
        on_ready: Callable[[], None] = lambda: None,
    ) -> None:
        """``modules``: this rank's layers under the new plan, by layer index;
        ``shadows``: its outgoing layers' modules (parameters at the committed step);
        ``on_ready`` runs once every incoming layer's parameters have arrived."""
        self.transition = transition
        self.rank = rank
        self.step = step
        self.comm = comm
        self.pacer = pacer
        self.timeout_s = timeout_s
        self.on_ready = on_ready
        stage, _ = new_plan.locate(rank)
        self.modules = dict(modules)
        self.shadows = dict(shadows)
        self.old_ids = list(old_plan.stages[stage].layers)
        self.new_ids = list(new_plan.stages[stage].layers)
        self.generation = new_plan.generation
        missing = [i for i in self.old_ids if i not in self.modules and i not in self.shadows]
        if missing:
            raise ValueError(f"rank {rank}: no module for old layers {missing}")
        for layer in self.shadows.values():
            for p in layer.parameters():
                p.grad = None
        self._sends: list[tuple[P2PGroup, dist.Work | DelayedSend[dist.Work], torch.Tensor]] = []
        self._recvs: list[tuple[Transfer, dist.Work, torch.Tensor]] = []
        self._ready = False
        self._paid = False
        self.bytes_streamed = 0
        self.waited_s = 0.0
        """Seconds the transition step waited for incoming parameters."""

    def _link(self, t: Transfer) -> P2PGroup:
        return self.comm.p2p(remap_link_name(t.src, t.dst))

    def _tag(self, space: TagSpace, index: int) -> int:
        return p2p_tag(self.generation, self.step, space + index)

    def _post_send(self, t: Transfer, payload: torch.Tensor, tag: int, computed: bool) -> None:
        """``computed``: the payload is what the device's queued compute produces (a
        payback), not parameters it already holds."""
        group = self._link(t)
        nbytes = payload.numel() * payload.element_size()
        self.bytes_streamed += nbytes
        if self.pacer.emulated:
            post = lambda: group.isend(payload, t.dst, tag)  # noqa: E731
            pacer = self.pacer
            delay = pacer.send_delay(nbytes) if computed else pacer.p2p_delay(nbytes)
            self._sends.append((group, DelayedSend(post, delay), payload))
        else:
            self._sends.append((group, group.isend(payload, t.dst, tag), payload))

    def start(self) -> None:
        """Post this rank's parameter streams and incoming receives."""
        for index, t in enumerate(self.transition.streams):
            if t.src == self.rank:
                params = list(self.shadows[t.layer].parameters())
                payload = as_host(_flat(params))
                self._post_send(t, payload, self._tag(TagSpace.STREAM, index), False)
        for index, t in enumerate(self.transition.streams):
            if t.dst == self.rank:
                params = list(self.modules[t.layer].parameters())
                buf = host_empty(sum(p.numel() for p in params), params[0].dtype)
                work = self._link(t).irecv(buf, t.src, self._tag(TagSpace.STREAM, index))
                self._recvs.append((t, work, buf))
        if not self._recvs:
            self._ready = True

    @property
    def waiting(self) -> bool:
        """Whether incoming parameters are still on their way."""
        return not self._ready

    def ready(self) -> None:
        """Wait for every incoming layer's parameters (once) and load them."""
        if self._ready:
            return
        started = time.perf_counter()
        for t, work, buf in self._recvs:
            self._link(t).wait_recv(work)
            params = list(self.modules[t.layer].parameters())
            with torch.no_grad():
                for p, piece in zip(params, _pieces(buf, params), strict=True):
                    p.copy_(piece)
        self.waited_s = time.perf_counter() - started
        self.pacer.received(started)
        self._ready = True
        self.on_ready()

    def layers_for(self, mb: int) -> tuple[list[nn.Module], list[int]]:
        """The modules (and layer indexes) micro-batch ``mb`` runs through here."""
        if mb < self.transition.early:
            modules = [
                self.modules[i] if i in self.modules else self.shadows[i] for i in self.old_ids
            ]
            return modules, self.old_ids
        self.ready()
        return [self.modules[i] for i in self.new_ids], self.new_ids

    def after_backward(self, mb: int) -> None:
        """Backward of micro-batch ``mb`` is done here: once the last early one is, the
        shadows' gradients are complete and the paybacks leave, overlapping the rest of
        the step."""
        if mb == self.transition.early - 1:
            self._send_paybacks()

    def _send_paybacks(self) -> None:
        if self._paid:
            return
        self._paid = True
        for index, t in enumerate(self.transition.paybacks):
            if t.src == self.rank:
                params = list(self.shadows[t.layer].parameters())
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                tag = self._tag(TagSpace.PAYBACK, index)
                self._post_send(t, as_host(_flat(grads)), tag, True)

    def finish(self) -> None:
        """After the last backward: add the paybacks this rank receives to its gradients
        and wait for its own streams and paybacks to be delivered."""
        self.ready()  # the next step needs the parameters even if no micro-batch did
        self._send_paybacks()  # if no early micro-batch ran here (an empty share)
        for index, t in enumerate(self.transition.paybacks):
            if t.dst != self.rank:
                continue
            params = list(self.modules[t.layer].parameters())
            buf = host_empty(sum(p.numel() for p in params), params[0].dtype)
            self._link(t).recv(buf, t.src, self._tag(TagSpace.PAYBACK, index))
            for p, piece in zip(params, _pieces(buf, params), strict=True):
                grad = piece.to(p.device)  # the host-plane buffer stays out of training
                p.grad = grad.clone() if p.grad is None else p.grad.add_(grad)
        for group, work, _ in self._sends:
            if isinstance(work, DelayedSend):
                work = work.work(self.timeout_s)
            group.wait_send(work)
        self._sends.clear()
        log.info(
            "migration.transition_done",
            step=self.step,
            early=self.transition.early,
            bytes_streamed=self.bytes_streamed,
            waited_s=round(self.waited_s, 4),
        )
