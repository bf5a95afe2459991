"""The zero-bubble split of a stage's backward, one implementation for every adapter that
runs ``bwd_D`` and ``bwd_W`` itself (:mod:`pipec.megatron`, :mod:`pipec.deepspeed`).

It is torch's split (``torch.distributed.pipelining._backward``, ``stage_backward_input`` /
``stage_backward_weight``) written on public autograd API only (``Node.next_functions``,
``Node.register_prehook``, ``GradientEdge``): no private import to break, and
``torch.distributed.pipelining``, which pulls in ``torch._dynamo`` (~1.4 s a process), stays
unloaded. Together the two halves do the work of one whole backward: :func:`split_input`
computes the input gradient only and records the gradients reaching the nodes where the
weights' branches join the input-gradient chain; :func:`split_weight` computes the weight
gradients from those, through the weights' AccumulateGrad nodes (so ``.grad`` and its hooks,
Megatron's DDP hooks among them, see them). Nothing above those nodes runs twice (Megatron's
fused cross entropy overwrites its saved tensors in its backward, so "retain the graph and run
it again" fails there), except for the weights whose branch meets no chain node (a term of
weights only), which :func:`split_input` returns as ``rest`` for a backward of their own.
"""

from __future__ import annotations

import torch


def grad_node(t: torch.Tensor):
    """A tensor's grad_fn, or a leaf's AccumulateGrad node (what the weights are keyed on)."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_edges(roots) -> dict:
    """Every node reachable from ``roots`` -> the nodes that feed it a gradient."""
    rev: dict = {r: [] for r in roots}
    todo = list(roots)
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in rev:
                rev[nxt] = []
                todo.append(nxt)
            rev[nxt].append(node)
    return rev


def _towards_roots(starts, stop: set, rev: dict) -> tuple[set, set]:
    """The nodes reached from ``starts`` against the gradient's flow, not going past nodes in
    ``stop``; returns (the nodes, the ``stop`` nodes met)."""
    seen, met = set(starts), set()
    todo = list(starts)
    while todo:
        for n in rev.get(todo.pop(), ()):
            if n in stop:
                met.add(n)
            elif n not in seen:
                seen.add(n)
                todo.append(n)
    return seen, met


def split_input(edges, grads, leaves, params) -> tuple:
    """``bwd_D``: one backward from ``edges`` (with ``grads``) to ``leaves`` only, which stores
    the leaves' ``.grad`` and records the gradient entering each node where a weight's branch
    joins the input-gradient chain. Returns what :func:`split_weight` needs.

    As torch's ``stage_backward_input``: the chain is the nodes on a path from the roots to the
    leaves; following each weight from its AccumulateGrad node towards the roots, the first
    chain nodes met are its "intermediates". Weights that share an intermediate form one group
    (a union of such sets, so no weight is in two groups). Weights whose branch meets no chain
    node (a term of weights only) get their own backward from the roots in :func:`split_weight`.
    """
    rev = _reverse_edges([e.node for e in edges])
    chain, _ = _towards_roots([grad_node(t) for t in leaves], set(), rev)
    accs = {grad_node(p): p for p in params}
    group_of: dict = {}  # chain node or weight node -> group (dict with params, intermediates)
    rest = []
    for acc, p in accs.items():
        if acc not in rev:
            continue  # not used by this microbatch's graph: no gradient, as in a whole backward
        _, met = _towards_roots([acc], chain, rev)
        if not met:
            rest.append(p)
            continue
        group = {"params": {acc}, "intermediates": set(met)}
        for other in {id(g): g for g in (group_of.get(n) for n in met) if g}.values():
            group["params"] |= other["params"]
            group["intermediates"] |= other["intermediates"]
        for n in group["intermediates"]:
            group_of[n] = group
    groups = list({id(g): g for g in group_of.values()}.values())
    handles = []
    for g in groups:
        g["intermediates"] = list(g["intermediates"])
        g["grads"] = [None] * len(g["intermediates"])
        for i, node in enumerate(g["intermediates"]):

            def record(grad_outputs, g=g, i=i):
                g["grads"][i] = grad_outputs

            handles.append(node.register_prehook(record))
    try:
        got = torch.autograd.grad(edges, leaves, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, gr in zip(leaves, got, strict=True):
        if gr is not None:
            t.grad = gr if t.grad is None else t.grad + gr
    return groups, accs, (edges, grads, rest) if rest else None


def split_weight(groups, accs, rest) -> None:
    """``bwd_W``: each group's weight gradients from the gradients :func:`split_input`
    recorded, through the weights' AccumulateGrad nodes (so ``.grad`` and its hooks see them,
    as a whole backward leaves them), running no node of the input-gradient chain beyond the
    group's own intermediates."""
    from torch.autograd.graph import GradientEdge

    for g in groups:
        edges, gouts = [], []
        for saved, node in zip(g["grads"], g["intermediates"], strict=True):
            for i, gr in enumerate(saved or ()):
                if gr is not None:
                    edges.append(GradientEdge(node, i))
                    gouts.append(gr)
        if not edges:
            continue  # no gradient reached the group
        handles = []
        if len(g["intermediates"]) > 1:
            # One intermediate may lead to another: pin each to the gradient it got in the
            # input pass, so nothing is counted twice (as torch's stage_backward_weight).
            for saved, node in zip(g["grads"], g["intermediates"], strict=True):
                handles.append(node.register_prehook(lambda _g, sg=saved: sg))
        try:
            torch.autograd.backward(edges, gouts, inputs=[accs[a] for a in g["params"]])
        finally:
            for h in handles:
                h.remove()
    if rest is not None:
        edges, grads, params = rest
        torch.autograd.backward(edges, grads, inputs=params)
