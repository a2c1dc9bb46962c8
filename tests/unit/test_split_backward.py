"""The backward split in ``I`` and ``W`` (zero-bubble schedules) computes what one
backward does: input gradients first, weight gradients later, on every stage kind of
the built-in model (first: data in; middle; last: the loss), on stages with a weight
whose path never meets the input's, and under the optimizer's accumulation hooks."""

import pytest
import torch
from torch import nn

from elaswave.model.config import TINY
from elaswave.model.llama import StepContext, build_layer, per_sample_loss
from elaswave.model.rng import CounterRng
from elaswave.runtime.worker.split_backward import (
    HeldWeights,
    _node,
    backward_input,
    backward_weight,
    reverse_edges,
    weight_groups,
)

CUTS = {"first": (0, 3), "middle": (2, 5), "last": (4, TINY.num_layers), "whole": (0, 6)}


def _stage(kind: str) -> list[nn.Module]:
    lo, hi = CUTS[kind]
    return [build_layer(TINY, i, seed=3) for i in range(lo, hi)]


def _inputs(kind: str, rows: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if CUTS[kind][0] == 0:
        return torch.randint(0, TINY.vocab_size, (rows, TINY.seq_len), generator=g)
    return torch.randn(rows, TINY.seq_len, TINY.hidden_size, generator=g, requires_grad=True)


def _forward(layers, x: torch.Tensor, kind: str):
    ctx = StepContext(step=1, sample_ids=(0, 1), rng=CounterRng(0))
    out = x
    for layer in layers:
        out = layer(out, ctx)
    if CUTS[kind][1] == TINY.num_layers:
        g = torch.Generator().manual_seed(8)
        targets = torch.randint(0, TINY.vocab_size, (x.shape[0], TINY.seq_len), generator=g)
        return per_sample_loss(out, targets).sum(), None
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return out, grad


@pytest.mark.parametrize("kind", list(CUTS))
def test_input_then_weight_halves_equal_one_backward(kind: str) -> None:
    torch.manual_seed(0)
    layers = _stage(kind)
    weights = [p for layer in layers for p in layer.parameters()]
    x = _inputs(kind)
    out, grad = _forward(layers, x, kind)
    torch.autograd.backward(out, grad)
    want_x = None if not x.requires_grad else x.grad.clone()
    want_w = [p.grad.clone() for p in weights]
    for p in weights:
        p.grad = torch.zeros_like(p)  # the optimizer's buffer: accumulated in place
    buffers = [p.grad for p in weights]
    x = _inputs(kind)
    out, grad = _forward(layers, x, kind)
    reported: list[nn.Parameter] = []
    held = backward_input(out, grad, x if x.requires_grad else None, reported.append)
    if want_x is not None:
        torch.testing.assert_close(x.grad, want_x, rtol=1e-5, atol=1e-6)
        assert all(float(b.abs().sum()) == 0.0 for b in buffers), "weights before W"
    backward_weight(held, reported.append)
    for p, buf, want in zip(weights, buffers, want_w, strict=True):
        assert p.grad is buf, "the gradient buffer was replaced"
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
    if want_x is not None:
        assert {id(p) for p in reported} == {id(p) for p in weights}


class _Offset(nn.Module):
    """A layer with a weight added inside a function of its input (``pos``), and one
    whose path joins the input's only at the output (``scale`` multiplies a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(4))
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.pos) + self.scale * torch.ones(4)


def _split_matches_one_backward(layer: nn.Module, seed: int) -> HeldWeights:
    """Run ``layer``'s backward whole, then split; the gradients must agree. The halves'
    kept state (after ``I``, before ``W``) is returned."""
    torch.manual_seed(seed)
    weights = list(layer.parameters())
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    layer(x).backward(grad)
    want = [p.grad.clone() for p in weights]
    layer.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    held = backward_input(layer(x2), grad, x2, lambda _: None)
    assert all(p.grad is None for p in weights), "weights before W"
    kept = HeldWeights(groups=list(held.groups))
    backward_weight(held, lambda _: None)
    for p, w in zip(weights, want, strict=True):
        torch.testing.assert_close(p.grad, w)
    torch.testing.assert_close(x2.grad, x.grad)
    return kept


def test_weights_joining_the_input_path_anywhere_get_their_gradients() -> None:
    torch.manual_seed(1)
    _split_matches_one_backward(_Offset(), seed=1)


class _Shared(nn.Module):
    """A weight (``p``) added to two others on their way into the input's path: torch's
    graph analysis puts it (and ``a``) in two weight groups, which are merged."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4, 4))
        self.p = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.a + self.p)) + x @ (self.b + self.p)


def test_a_weight_in_two_groups_is_counted_once() -> None:
    torch.manual_seed(2)
    layer = _Shared()
    kept = _split_matches_one_backward(layer, seed=2)
    grouped = [id(w) for g in kept.groups for w in g.weights]
    assert sorted(grouped) == sorted(id(w) for w in layer.parameters()), "one group each"


class _ViewOut(nn.Module):
    """A stage whose output is a view: megatron's layers return ``[seq, batch, hidden]``
    transposed to ElasWave's order, and ``.contiguous()`` returns the view itself when
    a share is one sample (found by scripts/chaos seed 50505 case 3: megatron, ZB-H1,
    "Can't detach views in-place" after a recovery gave a replica one sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w).unsqueeze(0).transpose(0, 1).contiguous().squeeze(1)


def test_a_stage_whose_output_is_a_view_splits() -> None:
    _split_matches_one_backward(_ViewOut(), seed=3)


def _torch_partition(out: torch.Tensor, x: torch.Tensor) -> set[frozenset]:
    """torch's zero-bubble grouping of the same graph, its groups merged where they
    share a weight: {(weights, nodes)} as frozensets."""
    from torch.distributed.pipelining._backward import (  # 1.6 s of imports: here only
        construct_reverse_graph,
        get_param_groups,
    )

    reverse = construct_reverse_graph([out.grad_fn])
    leaves = [n for n in list(reverse) if hasattr(n, "variable") and n.variable is not x]
    raw = get_param_groups([x.grad_fn or _node(x)], leaves, reverse)
    merged: list[tuple[set, set]] = []
    for g in raw:
        params, nodes = set(g["params"]), set(g["intermediates"])
        for other in [m for m in merged if m[0] & params]:
            merged.remove(other)
            params, nodes = params | other[0], nodes | other[1]
        merged.append((params, nodes))
    return {frozenset([frozenset(p), frozenset(n)]) for p, n in merged if n}


@pytest.mark.parametrize("layer", ["tiny-middle", "shared", "offset"])
def test_the_weight_groups_are_torchs_zero_bubble_groups(layer: str) -> None:
    """:func:`weight_groups` partitions the weights as torch's zero-bubble stage does
    (``torch.distributed.pipelining._backward``, which ElasWave does not import: its
    package costs every job 1.6 s)."""
    torch.manual_seed(4)
    if layer == "tiny-middle":
        layers = _stage("middle")
        x = _inputs("middle")
        out, _ = _forward(layers, x, "middle")
    else:
        module = _Shared() if layer == "shared" else _Offset()
        x = torch.randn(3, 4, requires_grad=True)
        out = module(x)
    reverse = reverse_edges(out.grad_fn)
    leaves = [n for n in reverse if hasattr(n, "variable") and n.variable is not x]
    ours = weight_groups(_node(x), leaves, reverse)
    assert len(ours) >= 1
    assert {frozenset([frozenset(w), frozenset(n)]) for w, n in ours} == _torch_partition(out, x)


class _CustomLinear(torch.autograd.Function):
    """A linear as megatron-core's are: a custom autograd Function."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _CustomLayer(nn.Module):
    """Two custom linears back to back (the second consumes the first), then torch's op."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(4, 4))
        self.second = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = _CustomLinear.apply(torch.tanh(x), self.first)
        return torch.tanh(_CustomLinear.apply(inner, self.second))


def _upstream(roots: list) -> set:
    seen, todo = set(roots), list(roots)
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_weights_behind_custom_functions_keep_their_nodes_until_w() -> None:
    """``W`` starts from nodes of megatron-core's linears, custom autograd Functions,
    whose Python objects torch before 2.13 holds only weakly: once ``I`` let the
    output's graph go, torch 2.11 had freed them ("Attribute '_input_metadata' is
    invalid", every megatron pipeline on a GPU machine). Each is held by torch's own
    nodes that consume it, on any torch."""
    layer = _CustomLayer()
    x = torch.randn(3, 4, requires_grad=True)
    held = backward_input(layer(x), torch.randn(3, 4), x, lambda _: None)
    custom = [
        n
        for g in held.groups
        for n in g.nodes
        if isinstance(n, torch.autograd.function.BackwardCFunction)
    ]
    assert len(custom) == 2, "W starts at both custom linears"
    assert held.anchors and not any(
        isinstance(n, torch.autograd.function.BackwardCFunction) for n in held.anchors
    )
    assert set(custom) <= _upstream(held.anchors)
    _split_matches_one_backward(_CustomLayer(), seed=5)  # and the split is exact
