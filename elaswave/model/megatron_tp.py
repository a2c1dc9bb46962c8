"""megatron-core's tensor-parallel group, carried by ElasWave's TP group.

megatron's tensor-parallel layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, attention over a member's heads) read the group they were
built with (``size()``, ``rank()``) and call torch's collective functions on it
(``dist.all_reduce``, ``dist.all_gather_into_tensor``), which call the group's own
methods. :class:`MegatronTpGroup` is the group megatron is given: its methods run on
the member's ElasWave TP group (``TpShard.group``: a
:class:`~elaswave.runtime.worker.tpgroup.TpLink` in a worker), so megatron's
collectives have ElasWave's bounded, abortable waits, follow the link when a recovery
rebuilds it, and a lost member surfaces as ElasWave's own error, as in any other layer.

torch logs a collective that raised by asking its group maps for the group's backend
and ranks (``c10d_logger._get_msg_dict``); for a group torch did not create, that lookup
raises and would replace the error. Each group is therefore entered in those maps
(:func:`_enter`) under the backend name :data:`BACKEND`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elaswave.model.tensor_parallel import TpShard

BACKEND = "elaswave-tp"
"""The backend name torch's group maps give a :class:`MegatronTpGroup`."""


class _Done:
    """The work of a collective that already ran (megatron waits on async ones)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class MegatronTpGroup:
    """Member ``tp.rank`` of ``tp.size`` as torch's collective functions address it."""

    def __init__(self, tp: TpShard) -> None:
        self.tp = tp

    def size(self) -> int:
        return self.tp.size

    def rank(self) -> int:
        return self.tp.rank

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
            raise ValueError(
                f"megatron asked its TP group for an all-reduce by {opts.reduceOp}: ElasWave's "
                "TP group sums (the only reduction megatron's dense TP layers ask for)"
            )
        for tensor in tensors:
            self.tp.collectives().all_reduce(tensor)
        return _Done()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None):
        self.tp.collectives().all_gather(output, input)
        return _Done()

    _allgather_base = all_gather_single  # what torch before all_gather_single calls

    def __getattr__(self, name: str) -> Any:
        # only the collectives of megatron's dense TP layers are carried (no sequence
        # parallelism, no experts): anything else is named, not silently wrong
        raise AttributeError(
            f"megatron asked its TP group for {name!r}; ElasWave's carries all_reduce and "
            "all_gather only (dense layers, no sequence parallelism)"
        )

    def __repr__(self) -> str:
        return f"MegatronTpGroup(member {self.tp.rank} of {self.tp.size})"


_GROUPS: dict[tuple[int, int, int], tuple[Any, MegatronTpGroup]] = {}
"""One group per member and TP group object (held, so its id is not reused)."""


def megatron_tp_group(tp: TpShard) -> MegatronTpGroup:
    """The group megatron's layers of member ``tp`` are built with, one per member (a
    torch world must exist: megatron reads sizes only once ``dist.is_initialized()``)."""
    key = (id(tp.group), tp.rank, tp.size)
    if key not in _GROUPS:
        group = MegatronTpGroup(tp)
        _enter(group)
        _GROUPS[key] = (tp.group, group)
    return _GROUPS[key][1]


def _enter(group: MegatronTpGroup) -> None:
    from torch.distributed import distributed_c10d as c10d

    world: Any = c10d._world  # torch's private maps, typed for its own groups only
    world.pg_map[group] = (BACKEND, None)
    world.pg_group_ranks[group] = {dist.get_rank(): group.rank()}
