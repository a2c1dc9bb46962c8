"""The backward of one micro-batch in two halves, for zero-bubble schedules
(:mod:`elaswave.engine.schedule`): ``I`` computes the gradient of the stage's input
(what the previous stage waits for), ``W`` later computes the weight gradients.

``I`` runs autograd from the stage's output to its input only, keeping, at each autograd
node where a weight's gradient path leaves the input's, the gradient that flows into it
(:func:`weight_groups` finds those nodes and groups the weights behind them: the
grouping of torch's zero-bubble stage, :mod:`torch.distributed.pipelining._backward`,
whose package would cost every job's process starter 1.6 s of imports, torch's compiler
among them). ``W`` runs autograd from those nodes, with the kept gradients, to the
weights. Together they compute what one backward does, once each. Any model works
(built-in, Hugging Face, megatron-core, tensor-parallel layers whose collectives lie on
the input's path): the split reads only the autograd graph. A weight whose path to the
output never meets the input's is computed by ``I`` itself; the first stage, whose input
is data, has no ``I`` to run and runs the whole backward as its ``W``.

Weight gradients are accumulated in place into ``.grad`` (the optimizer's gradient
buffer), and ``accumulated`` is called for each weight, as autograd's post-accumulate
hooks would be (:meth:`elaswave.fabric.zero.ZeroAdamW.overlap_reduction`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

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
    anchors: list[Node] = field(default_factory=list)
    """torch's own nodes that keep the groups' custom-Function nodes alive once the
    output's graph is let go (:func:`anchors`)."""


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
    reverse = reverse_edges(_node(out))
    # The weights are the leaves the output reaches, whichever layers computed it (a
    # migrating step's shadow layers included), the stage's input aside.
    by_node = {
        n: n.variable
        for n in reverse
        if hasattr(n, "variable") and n.variable is not x_in and n.variable.requires_grad
    }
    found = weight_groups(_node(x_in), list(by_node), reverse)
    groups = [_Group(weights=[by_node[n] for n in ws], nodes=nodes) for ws, nodes in found]
    covered = {n for ws, _ in found for n in ws}
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
    held, whole = anchors([n for g in groups for n in g.nodes], reverse)
    if out._base is None and not whole:  # a view cannot be detached in place
        out.detach_()  # the output side of the graph is not needed any more
    return HeldWeights(groups=groups, anchors=held)


def anchors(nodes: Iterable[Node], reverse: Mapping[Node, list[Node]]) -> tuple[list[Node], bool]:
    """What keeps ``nodes`` alive for ``W`` once the output's graph is let go. A node is
    owned by the nodes that consume it; a Python reference to torch's own node owns it
    too, but torch before 2.13 holds a custom ``autograd.Function``'s node only weakly
    from Python (megatron-core's linears: on torch 2.11 ``W`` found them freed). So each
    custom node is anchored by its nearest consumers that are torch's own nodes. Returns
    those, and whether some custom node has only custom nodes down to the output (then
    the output's graph must be kept whole)."""
    held: dict[Node, None] = {}
    todo = [n for n in nodes if isinstance(n, BackwardCFunction)]
    seen, whole = set(todo), False
    while todo:
        users = reverse.get(todo.pop(), [])
        whole |= not users
        for user in users:
            if isinstance(user, BackwardCFunction):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
            else:
                held[user] = None
    return list(held), whole


def reverse_edges(root: Node) -> dict[Node, list[Node]]:
    """Every autograd node ``root``'s graph reaches, with the nodes it passes gradient
    back to (its consumers: the edges of the graph reversed)."""
    reverse: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in reverse:
                reverse[nxt] = []
                queue.append(nxt)
            reverse[nxt].append(node)
    return reverse


def _reach(
    start: Node, reverse: Mapping[Node, list[Node]], stop: Collection[Node] = ()
) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``start`` towards the output without passing a node of
    ``stop``, and the nodes of ``stop`` met on the way."""
    seen, met, queue = {start}, set(), deque([start])
    while queue:
        for up in reverse.get(queue.popleft(), ()):
            if up in seen:
                continue
            if up in stop:
                met.add(up)
                continue
            seen.add(up)
            queue.append(up)
    return seen, met


def weight_groups(
    x_node: Node, weights: Iterable[Node], reverse: Mapping[Node, list[Node]]
) -> list[tuple[list[Node], list[Node]]]:
    """The weights (their accumulator nodes) in groups, each with the nodes where its
    weights' gradient paths meet the input's (those ``I`` reaches): weights that meet
    it at a shared node, or through a shared weight, are one group, whose gradients
    ``W`` computes in one pass from those nodes. A weight whose path never meets the
    input's is in no group. The partition torch's zero-bubble stage computes (its
    groups merged where they share a weight, as each weight must be computed once)."""
    on_path, _ = _reach(x_node, reverse)
    groups: list[tuple[set[Node], set[Node]]] = []
    for weight in weights:
        _, met = _reach(weight, reverse, stop=on_path)
        if not met:
            continue
        members, nodes = {weight}, met
        for other in [g for g in groups if g[1] & nodes]:
            groups.remove(other)
            members |= other[0]
            nodes |= other[1]
        groups.append((members, nodes))
    return [(list(members), list(nodes)) for members, nodes in groups]


def _keeper(group: _Group, i: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[i] = grad_outputs

    return keep


def backward_weight(held: HeldWeights, accumulated: Accumulated) -> None:
    """``W``: accumulate the weight gradients of the micro-batch ``held`` was kept for:
    one autograd pass a group, from its kept nodes to its weights, which walks only the
    group's own part of the graph. Where a group has several kept nodes, each takes the
    gradient it had during ``I`` (a prehook replaces what flows into it from a kept node
    above it, which would count that gradient twice). Each pass frees the saved tensors
    it used, as torch's own weight pass does: no two groups share a node below their
    kept nodes (a shared node would have merged them), and nothing runs after ``W``.
    Retaining them cost 6% of ``W`` (2.5 ms of 42.5 on the last stage of
    ``scripts/bench_steady_state.py``'s pp2, a micro-batch of 4)."""
    if held.whole is not None:
        out, grad = held.whole
        torch.autograd.backward(out, grad)  # autograd's own hooks report each weight
        return
    for group in held.groups:
        _group_weights(group, accumulated)
    held.groups.clear()
    held.anchors.clear()


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
                edges, targets, grad_outputs=grads, retain_graph=False, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    for w, g in zip(group.weights, dweights, strict=True):
        _accumulate(w, g, accumulated)


def _node(t: torch.Tensor) -> Node:
    """The autograd node ``t``'s gradient flows into (its grad_fn, or a leaf's
    accumulator)."""
    node = t.grad_fn
    if node is None and t.requires_grad:  # a leaf: its accumulator, through a view
        node = t.view_as(t).grad_fn
        node = None if node is None else node.next_functions[0][0]
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
