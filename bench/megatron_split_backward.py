"""What split backward costs on Megatron's linear layers (issue #40 point 8), measured on CPU.

pipec's Megatron adapter runs ``bwd_D`` / ``bwd_W`` with ``python/pipec/_split_backward.py``
(torch's zero-bubble split on public autograd API). Megatron's linear layers compute the input
gradient and the weight gradient in one autograd function
(``LinearWithGradAccumulationAndAsyncCommunication``), so ``bwd_D`` runs that function's
whole backward and ``bwd_W`` runs it once more for the weights: the linear layers' backward is
done twice (docs/megatron.md, "Split backward"). This script times, with megatron-core's own
function (tp=1, no gradient-accumulation fusion, as on CPU):

- one linear layer: its fused backward, and ``bwd_D`` + ``bwd_W`` as the adapter runs them;
- a GPT layer built on it (LayerNorm, QKV, attention core, projection, LayerNorm, fc1, GeLU,
  fc2, residuals): the same, which is what the cost key describes (a layer's ``b`` and ``w``).

Prints the median times and ``extra = (bwd_D + bwd_W) / fused - 1`` for each; the layer's is
the default of the cost key ``split_extra`` under ``--target megatron`` (docs/costs.md). Run:
``python bench/megatron_split_backward.py [--hidden 1024 --seq 512 --repeats 15]`` with torch
and megatron-core installed. CPU figures: a GPU's ratio of matmul to elementwise time differs,
so measure there for a GPU job (or give ``split_extra`` from ``pipec calibrate``-style runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.autograd.graph import get_gradient_edge

warnings.filterwarnings("ignore")
from megatron.core.tensor_parallel.layers import (
    linear_with_grad_accumulation_and_async_allreduce as megatron_linear,
)

# pipec's split, from this checkout's file (it imports torch only; no wheel needed).
_spec = importlib.util.spec_from_file_location(
    "pipec_split_backward",
    Path(__file__).resolve().parent.parent / "python" / "pipec" / "_split_backward.py",
)
_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_split)
split_input, split_weight = _split.split_input, _split.split_weight


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Megatron's linear layer at tp=1: its autograd function computes both gradients."""
    return megatron_linear(
        x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False
    )


class Linear(torch.nn.Module):
    def __init__(self, inp: int, out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out, inp) / inp**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(out))

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Layer(torch.nn.Module):
    """A GPT decoder layer on Megatron's linear function, [seq, batch, hidden] as Megatron."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = Linear(hidden, 3 * hidden)
        self.proj = Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = Linear(hidden, 4 * hidden)
        self.fc2 = Linear(4 * hidden, hidden)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)

        def heads(t):
            return t.reshape(s, b, self.heads, h // self.heads).permute(1, 2, 0, 3)

        a = torch.nn.functional.scaled_dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True
        )
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def timed(module, make_input, repeats: int) -> tuple[float, float, float]:
    """Median seconds of the fused backward, of ``bwd_D`` and of ``bwd_W`` (a fresh forward
    before each, not timed)."""
    params = list(module.parameters())
    fused, bwd_d, bwd_w = [], [], []
    for _ in range(repeats + 2):  # two warm-up rounds
        for p in params:
            p.grad = None
        x = make_input()
        y = module(x)
        g = torch.randn_like(y)
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        fused.append(time.perf_counter() - t0)

        for p in params:
            p.grad = None
        x = make_input()
        y = module(x)
        t0 = time.perf_counter()
        # As pipec.megatron's bwd_d: through the output's gradient edge.
        split = split_input([get_gradient_edge(y)], [g], [x], params)
        x.grad = None
        t1 = time.perf_counter()
        split_weight(*split)
        t2 = time.perf_counter()
        bwd_d.append(t1 - t0)
        bwd_w.append(t2 - t1)
    med = [statistics.median(v[2:]) for v in (fused, bwd_d, bwd_w)]
    return med[0], med[1], med[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    h = a.hidden

    def make_input():
        return torch.randn(a.seq, 1, h, requires_grad=True)

    print(
        f"torch {torch.__version__}, CPU, {a.threads} thread(s), hidden {h}, seq {a.seq}, "
        f"heads {a.heads}, fp32, median of {a.repeats}"
    )
    for name, module in [("linear h->4h", Linear(h, 4 * h)), ("GPT layer", Layer(h, a.heads))]:
        f, d, w = timed(module, make_input, a.repeats)
        print(
            f"{name:>12}: fused backward {f * 1e3:.2f} ms; bwd_D {d * 1e3:.2f} ms + bwd_W "
            f"{w * 1e3:.2f} ms = {(d + w) * 1e3:.2f} ms; extra {(d + w) / f - 1:+.3f}"
        )


if __name__ == "__main__":
    main()
