"""The strict device's communicator offers torch's backend API exactly as NCCL's does.

``StrictProcessGroup`` stands in for ``ProcessGroupNCCL`` on CPU, and both are reached
through :class:`elaswave.comm.group.Group` as *backends* (``torch._C._distributed_c10d.
Backend``), whose methods differ from the ``ProcessGroup`` ones of the same name (a
backend's ``_start_coalescing`` takes no device). A stand-in that accepted what NCCL
refuses would hide the mismatch until the first GPU run, so each method Group calls is
held to the arguments torch's own Backend declares for it.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch.distributed as dist

from elaswave.comm.strict import StrictProcessGroup

CALLED = (
    "allreduce",
    "_reduce_scatter_base",
    "_allgather_base",
    "send",
    "recv",
    "_start_coalescing",
    "_end_coalescing",
    "abort",
)
"""What :class:`elaswave.comm.group.Group` calls on a device-plane backend."""


def torch_arguments(name: str) -> tuple[list[str], list[str]]:
    """(required, optional) argument names of ``Backend.name``, from its pybind signature."""
    doc = getattr(dist.ProcessGroupGloo, name).__doc__
    overloads = re.findall(rf"{name}\(self: [^,)]+(?:, )?(.*?)\) ->", doc)
    assert overloads, f"torch's Backend.{name} has no readable signature: {doc!r}"
    # With several overloads (allreduce), the one taking a list of tensors and options.
    text = next((o for o in overloads if o.startswith("tensors")), overloads[0])
    args = [a.split(":")[0].strip() for a in re.split(r", (?![^\[]*\])", text) if a]
    return [a for a in args if "=" not in text.split(a, 1)[1].split(",")[0]], args


@pytest.mark.parametrize("name", CALLED)
def test_each_method_takes_the_arguments_torchs_backend_takes(name):
    required, every = torch_arguments(name)
    params = list(inspect.signature(getattr(StrictProcessGroup, name)).parameters.values())[1:]
    ours_required = [p.name for p in params if p.default is inspect.Parameter.empty]
    assert len(ours_required) == len(required), (name, ours_required, required)
    assert len(params) <= len(every), (name, [p.name for p in params], every)
