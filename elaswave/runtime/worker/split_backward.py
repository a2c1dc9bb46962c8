"""The backward of one micro-batch in two halves, for zero-bubble schedules
(:mod:`elaswave.engine.schedule`): ``I`` computes the gradient of the stage's input
(what the previous stage waits for), ``W`` later computes the weight gradients.

``I`` runs autograd from the stage's output to its input only, keeping, at each
autograd node where a weight's gradient path leaves the input's, the gradient that
flows into it (torch's own graph analysis, :mod:`torch.distributed.pipelining.
_backward`, finds those nodes and groups the weights behind them). ``W`` runs autograd
from those nodes, with the kept gradients, to the weights. Together they compute what
one backward does, once each. Any model works (built-in, Hugging Face, megatron-core,
tensor-parallel layers whose collectives lie on the input's path): the split reads
only the autograd graph. A weight whose path to the output never meets the input's is
computed by ``I`` itself; the first stage, whose input is data, has no ``I`` to run and
runs the whole backward as its ``W``.

Weight gradients are accumulated in place into ``.grad`` (the optimizer's gradient
buffer), and ``accumulated`` is called for each weight, as autograd's post-accumulate
hooks would be (:meth:`elaswave.fabric.zero.ZeroAdamW.overlap_reduction`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
)

Accumulated = Callable[[torch.nn.Parameter], None]


@dataclass
class _Group:
    """Weights behind some autograd nodes on the input's path, and the gradients that
    flowed into those nodes during ``I``."""

    weights: list[torch.nn.Parameter]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class HeldWeights:
    """What ``W`` of one micro-batch needs: the weight groups with their gradients (or,
    on the first stage, the output and its gradient for a whole backward)."""

    groups: list[_Group]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None


def backward_input(
    out: torch.Tensor,
    grad: torch.Tensor | None,
    x_in: torch.Tensor | None,
    accumulated: Accumulated,
) -> HeldWeights:
    """``I``: set ``x_in.grad`` (None: the first stage, nothing to compute) from the
    output ``out`` and its gradient ``grad`` (None: ``out`` is the loss), and keep what
    :func:`backward_weight` needs."""
    if x_in is None:
        return HeldWeights(groups=[], whole=(out, grad))
    reverse = construct_reverse_graph([_node(out)])
    # The weights are the leaves the output reaches, whichever layers computed it (a
    # migrating step's shadow layers included), the stage's input aside.
    by_node = {
        n: n.variable
        for n in reverse
        if hasattr(n, "variable") and n.variable is not x_in and n.variable.requires_grad
    }
    raw = get_param_groups([_node(x_in)], list(by_node), reverse)
    groups = [
        _Group(weights=[by_node[n] for n in params], nodes=nodes)
        for params, nodes in _merged((g["params"], g["intermediates"]) for g in raw)
    ]
    covered = {n for g in raw for n in g["params"]}
    # weights the output reaches whose path never meets the input's: computed now
    apart = [w for n, w in by_node.items() if n not in covered]
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            handles.append(node.register_prehook(_keeper(group, i)))
    try:
        grads = torch.autograd.grad(
            [out],
            [x_in, *apart],
            grad_outputs=None if grad is None else [grad],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    x_in.grad = grads[0]
    for w, g in zip(apart, grads[1:], strict=True):
        _accumulate(w, g, accumulated)
    if out._base is None:  # a view cannot be detached in place: its graph goes with it
        out.detach_()  # the output side of the graph is not needed any more
    return HeldWeights(groups=groups)


def _merged(groups: Iterable[tuple[set[Node], set[Node]]]) -> list[tuple[list[Node], list[Node]]]:
    """Weight groups (weights, the nodes their paths meet the input's at) merged where
    they share a weight: torch's grouping puts a weight whose paths meet the input's at
    nodes of two groups into both, and each must be computed once, from every node its
    paths meet."""
    merged: list[tuple[set[Node], set[Node]]] = []
    for params, nodes in groups:
        params, nodes = set(params), set(nodes)
        for other in [m for m in merged if m[0] & params]:
            merged.remove(other)
            params |= other[0]
            nodes |= other[1]
        merged.append((params, nodes))
    return [(list(params), list(nodes)) for params, nodes in merged]


def _keeper(group: _Group, i: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[i] = grad_outputs

    return keep


def backward_weight(held: HeldWeights, accumulated: Accumulated) -> None:
    """``W``: accumulate the weight gradients of the micro-batch ``held`` was kept for:
    one autograd pass a group, from its kept nodes to its weights, which walks only the
    group's own part of the graph. Where a group has several kept nodes, each takes the
    gradient it had during ``I`` (a prehook replaces what flows into it from a kept node
    above it, which would count that gradient twice)."""
    if held.whole is not None:
        out, grad = held.whole
        torch.autograd.backward(out, grad)  # autograd's own hooks report each weight
        return
    for group in held.groups:
        _group_weights(group, accumulated)
    held.groups.clear()


def _group_weights(group: _Group, accumulated: Accumulated) -> None:
    edges, grads, handles = [], [], []
    for node, kept in zip(group.nodes, group.grads, strict=True):
        for j, g in enumerate(kept or ()):
            if g is not None:
                edges.append(GradientEdge(node, j))
                grads.append(g)
        if len(group.nodes) > 1:
            handles.append(node.register_prehook(lambda _, k=kept: k))
    dweights: Sequence[torch.Tensor | None] = [None] * len(group.weights)
    try:
        if edges:
            targets = [GradientEdge(_node(w), 0) for w in group.weights]
            dweights = torch.autograd.grad(
                edges, targets, grad_outputs=grads, retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    for w, g in zip(group.weights, dweights, strict=True):
        _accumulate(w, g, accumulated)


def _node(t: torch.Tensor) -> Node:
    """The autograd node ``t``'s gradient flows into (its grad_fn, or a leaf's
    accumulator)."""
    node = _get_grad_fn_or_grad_acc(t)
    if node is None:
        raise ValueError("a tensor of the stage's backward has no autograd node")
    return node


def _accumulate(w: torch.nn.Parameter, g: torch.Tensor | None, accumulated: Accumulated) -> None:
    if g is not None:
        if w.grad is None:
            w.grad = g
        else:
            w.grad.add_(g)
    accumulated(w)
