"""``pipec._split_backward``: the one zero-bubble split of a stage's backward that
``pipec.megatron`` and ``pipec.deepspeed`` run for ``bwd_D`` / ``bwd_W`` (torch only)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("CI") == "true":
    import torch  # (under CI nothing may be skipped)
else:
    torch = pytest.importorskip("torch")

from pipec._split_backward import split_input, split_weight


def test_split_backward_equals_one_whole_backward_on_a_linear_stage():
    """A Linear-Tanh-Linear stage, as the executors see it (the output's gradient edge, the
    received gradient): the input pass gives the whole backward's input gradient and no weight
    gradient; every weight is in a group (its branch joins the chain), none in ``rest``; the
    weight pass gives the whole backward's weight gradients."""
    from torch.autograd.graph import get_gradient_edge

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, og = torch.randn(2, 4), torch.randn(2, 3)
    x_ref = x.clone().requires_grad_()
    net(x_ref).backward(og)
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)

    inp = x.clone().requires_grad_()
    out = net(inp)
    groups, accs, rest = split_input([get_gradient_edge(out)], [og], [inp], list(net.parameters()))
    torch.testing.assert_close(inp.grad, x_ref.grad)
    assert all(p.grad is None for p in net.parameters())
    assert rest is None and {a for g in groups for a in g["params"]} == set(accs)
    split_weight(groups, accs, rest)
    for p, w in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w)


def test_split_backward_equals_one_whole_backward_on_awkward_graphs():
    """The split on a graph with what a Linear chain lacks: weights that share a node (one group), a weight that joins
    two groups, a weight used twice along the chain (intermediates leading to one another), a
    root of weights only, an unused weight, two inputs and two roots. Input and weight
    gradients must equal one whole backward; the input pass must leave no weight gradient and
    the weight pass no input gradient."""
    g = torch.Generator().manual_seed(5)
    names = ["A", "B", "C", "E", "F", "T", "K", "U"]
    p0 = {n: torch.randn(4, 4, generator=g) * 0.5 for n in names}
    x0, z0 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    g1, g2 = torch.randn(3, 4, generator=g), torch.randn((), generator=g)

    def graph():
        p = {n: t.clone().requires_grad_() for n, t in p0.items()}
        x, z = x0.clone().requires_grad_(), z0.clone().requires_grad_()
        h = torch.tanh(x @ p["A"] + z)
        h = torch.tanh(h @ (p["B"] + p["C"] + p["E"]))  # B, C share a node; E joins ...
        h = torch.tanh(h @ (p["F"] + p["E"]))  # ... this group too
        h = torch.tanh(h @ p["T"]) @ p["T"]  # T twice along the chain
        return p, [x, z], [h, (p["K"] ** 2).sum()]  # a root of a weight only; U unused

    p, leaves, roots = graph()
    torch.autograd.backward(roots, [g1, g2])
    want = {n: t.grad for n, t in p.items()}, [t.grad for t in leaves]

    from torch.autograd.graph import get_gradient_edge

    p, leaves, roots = graph()
    params = list(p.values())
    deferred = split_input([get_gradient_edge(r) for r in roots], [g1, g2], leaves, params)
    assert all(t.grad is None for t in params), "no weight gradient in the input pass"
    got_inputs = [t.grad.clone() for t in leaves]
    groups, _, rest = deferred
    assert sorted(len(gr["params"]) for gr in groups) == [1, 1, 4]  # A | B C E F | T
    assert rest is not None and rest[2] == [p["K"]]
    del roots
    split_weight(*deferred)
    for a, b in zip(got_inputs, want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(t.grad, a) for t, a in zip(leaves, got_inputs, strict=True))
    for n, t in p.items():
        if want[0][n] is None:
            assert t.grad is None, n
        else:
            torch.testing.assert_close(t.grad, want[0][n], rtol=1e-6, atol=1e-7, msg=n)
