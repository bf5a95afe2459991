#!/usr/bin/env python3
"""Record megatron-core's CUDA-graph capture order (Transformer Engine's ``_order``) as golden data.

``TECudaGraphHelper._get_cuda_graph_input_data`` (megatron/core/transformer/cuda_graphs.py) hands
``te.make_graphed_callables(..., _order=order)`` the order in which one pipeline rank captures its
per-chunk graphs. It computes it with three megatron-core functions, which this script calls
UNCHANGED, exactly as that method does, for every configuration of the grid and every rank:

    _, _, warmup, _ = schedules.get_pp_rank_microbatches(
        M, vpp, g, forward_only=False, p2p_communicator=<pp rank r of pp, virtual size vpp|None>)
    table = schedules.get_schedule_table(M, vpp, g)
    order = cuda_graphs.convert_schedule_table_to_order(warmup, vpp, table)

and, with ``config.overlap_moe_expert_parallel_comm`` (expert-parallel overlap, the combined 1F1B
schedule), ``order, _ = cuda_graphs.get_overlap_moe_expert_parallel_comm_order(order, [1] * vpp,
capture_wgrad_graph)`` (one graphable layer per chunk, so layer ids are chunk ids;
``capture_wgrad_graph`` is ``delay_wgrad_compute`` with the weight gradient in the graphed scope:
a W is the half step ``-(chunk + 0.5)``).

The encoding (Megatron's and TE's): the forward of model chunk c (0-based) is ``c + 1``, its
backward ``-(c + 1)``; the k-th forward of a chunk captures microbatch k's graph, and the k-th
backward of that chunk is paired with it.

Only ``p2p_communicator`` is a stand-in: an object with ``pp_group.size()``, ``pp_group.rank()``
and ``virtual_pipeline_model_parallel_size`` (``None`` for the non-interleaved schedule, as
megatron-core's parallel state has it), the three attributes ``get_pp_rank_microbatches`` reads.

Which configurations Megatron runs is decided by Megatron itself: each configuration is also run
through the real ``forward_backward_pipelining_with_interleaving`` / ``..._without_interleaving``
with ``record.py``'s fakes and patches (P2P mode ``overlap`` for the interleaved schedule: the
refusals do not depend on the mode; ``batched`` for 1F1B). A configuration the schedule refuses
is written with its exception; for the others the script asserts that each rank's capture order
is the schedule's own compute order (``F<c>.<m>`` -> ``c+1``, ``B<c>.<m>`` -> ``-(c+1)``; with
expert-parallel overlap the combined schedule's ``X<f>/<b>`` -> ``f+1, -(b+1)``), and exits 1
otherwise: Megatron captures in the order it runs.

Output (gzip, UTF-8, one config per line, deterministic):
  line 1: "# megatron-core <v> torch <v> command: <cmd>"
  <fn> pp=<pp> vpp=<vpp> m=<M> g=<g> ep_overlap=<0|1> wgrad=<0|1> | <rank0> | <rank1> ...
  or   <same fields> ! <ExceptionType>: <message>
  fn is 1f1b or interleaved; rank: the order's numbers separated by spaces (W as e.g. -1.5).
  ep_overlap=1 lines exist for the interleaved schedule only (Megatron's combined 1F1B).

The grid: 1F1B at pp 1-8, every M in 1..3pp (g = pp, ModelParallelConfig's default; the table of
one chunk does not depend on it); interleaved at pp 2-8, vpp 2-4, every M in 1..3pp, every g in
pp..M (g = pp when M < pp, which Megatron refuses), each with ep_overlap 0, and 1 with wgrad 0
and 1.

Usage:
  python record_capture_order.py [--out capture_order.txt.gz] [--only REGEX]
"""

import argparse
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron.core
import record  # tests/golden/megatron/record.py: its fakes, patches and schedule runner
import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import cuda_graphs


def communicator(pp, rank, vpp):
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)


def capture_order(pp, rank, vpp, M, g, interleaved, ep_overlap, wgrad):
    """TECudaGraphHelper._get_cuda_graph_input_data's order, by Megatron's own functions."""
    _, _, warmup, _ = schedules.get_pp_rank_microbatches(
        M,
        vpp,
        g,
        forward_only=False,
        p2p_communicator=communicator(pp, rank, vpp if interleaved else None),
    )
    table = schedules.get_schedule_table(M, vpp, g)
    order = cuda_graphs.convert_schedule_table_to_order(warmup, vpp, table)
    if ep_overlap:
        order, _ = cuda_graphs.get_overlap_moe_expert_parallel_comm_order(order, [1] * vpp, wgrad)
    return order


def executed(tokens):
    """The capture order a rank's recorded compute calls stand for."""
    out = []
    for t in tokens.split():
        if t[0] == "F":
            out.append(int(t[1:].split(".")[0]) + 1)
        elif t[0] == "B":
            out.append(-(int(t[1:].split(".")[0]) + 1))
        elif t[0] == "X":
            f, b = t[1:].split("/")
            out += [int(f.split(".")[0]) + 1, -(int(b.split(".")[0]) + 1)]
    return out


def number(x):
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def grid():
    """Yields (fn, pp, vpp, M, g) in output order."""
    for pp in range(1, 9):
        for M in range(1, 3 * pp + 1):
            yield ("1f1b", pp, 1, M, pp)
    for pp in range(2, 9):
        for vpp in range(2, 5):
            for M in range(1, 3 * pp + 1):
                for g in range(pp, M + 1) if M >= pp else [pp]:
                    yield ("interleaved", pp, vpp, M, g)


def record_all(out_path, only):
    record.install_patches()
    cmd = "python tests/golden/megatron/record_capture_order.py" + (
        f" --only '{only}'" if only else ""
    )
    version = megatron.core.__version__.split("+")[0]
    lines = [f"# megatron-core {version} torch {torch.__version__} command: {cmd}"]
    rx = re.compile(only) if only else None
    n_cfg = n_err = 0
    mismatches = []
    for fn, pp, vpp, M, g in grid():
        interleaved = fn == "interleaved"
        variants = [(0, 0), (1, 0), (1, 1)] if interleaved else [(0, 0)]
        for ep, wg in variants:
            h = f"{fn} pp={pp} vpp={vpp} m={M} g={g} ep_overlap={ep} wgrad={wg}"
            if rx and not rx.search(h):
                continue
            n_cfg += 1
            mode = "overlap" if interleaved else "batched"
            ranks, err, _ = record.run_config(fn, pp, vpp, M, g, 0, ep, mode)
            if err is not None:
                n_err += 1
                lines.append(f"{h} ! {err}")
                continue
            orders = [capture_order(pp, r, vpp, M, g, interleaved, ep, wg) for r in range(pp)]
            if not wg:
                for r, (o, toks) in enumerate(zip(orders, ranks, strict=True)):
                    if o != executed(toks):
                        mismatches.append(f"{h}: rank {r} captures {o}, runs {executed(toks)}")
            lines.append(h + "".join(" | " + " ".join(map(number, o)) for o in orders))
    size = record.write_lines_gz(out_path, lines)
    print(f"{n_cfg} configs ({n_err} refused), {size} bytes -> {out_path}")
    for m in mismatches[:20]:
        print("  capture order is not the executed order:", m)
    return 1 if mismatches else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "capture_order.txt.gz"))
    ap.add_argument("--only", default=None, help="regex on the config header")
    a = ap.parse_args()
    sys.exit(record_all(a.out, a.only))


if __name__ == "__main__":
    main()
