"""How much of a stage's saved activations pipec's split backward keeps from bwd_D to bwd_W.

Usage: python bench/split_keep.py

Runs one forward of a small transformer block (torch's ``nn.TransformerEncoderLayer``, CPU,
dropout on) as a pipeline stage (input requiring grad), then ``pipec._split_backward``'s
``split_input`` (bwd_D) and ``split_weight`` (bwd_W), the split ``pipec.megatron`` and
``pipec.deepspeed`` run (torch's ``stage_backward_input`` / ``stage_backward_weight``, which
``pipec.torch`` runs, retain the graph the same way). Every tensor autograd saves is wrapped
by a ``saved_tensors_hooks`` pack hook; a weak reference to the wrapper says whether the graph
still holds it. Printed: the bytes of saved activations (parameters' storages left out, one
count per storage) after the forward, still held between the two halves, and the bytes of the
gradients ``split_input`` records for ``split_weight``. Issue #39: pipec's ``K.act_w`` is the
part kept between the halves.
"""

import importlib.util
import pathlib
import weakref

import torch

HERE = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "split_backward", HERE / "python" / "pipec" / "_split_backward.py"
)
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)


class Box:
    def __init__(self, t):
        self.t = t


def main():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=256, dropout=0.1, batch_first=True
    )
    layer.train()
    params = list(layer.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    x = torch.randn(2, 32, 64, requires_grad=True)
    boxes = []

    def pack(t):
        b = Box(t)
        boxes.append((weakref.ref(b), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return b

    def unpack(b):
        return b.t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = layer(x)

    def held():
        seen = {}
        for ref, ptr, n in boxes:
            if ref() is not None and ptr not in param_ptrs:
                seen[ptr] = n
        return sum(seen.values())

    after_fwd = held()
    edges = [torch.autograd.graph.get_gradient_edge(y)]
    grads = [torch.ones_like(y)]
    groups, accs, rest = sb.split_input(edges, grads, [x], params)
    between = held()
    recorded = sum(
        gr.untyped_storage().nbytes()
        for g in groups
        for saved in g["grads"]
        for gr in (saved or ())
        if gr is not None
    )
    sb.split_weight(groups, accs, rest)
    print(f"saved activations after fwd:  {after_fwd} bytes")
    print(f"held from bwd_D to bwd_W:     {between} bytes ({between / after_fwd:.0%})")
    print(f"gradients recorded for bwd_W: {recorded} bytes")


if __name__ == "__main__":
    main()
