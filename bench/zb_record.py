"""Record the zero-bubble authors' automatic scheduler on a grid of cases.

Usage: python bench/zb_record.py PATH_TO_ZB_CHECKOUT > tests/golden/zb/auto_schedule.json
       python bench/zb_record.py --memory split PATH_TO_ZB_CHECKOUT | gzip -9n > tests/golden/zb/split_memory.json.gz

`--memory` picks their memory model (`mem_f`, `mem_b`, `mem_w` per stage, their
`GraphConfig`):

- `whole` (the default, `auto_schedule.json`): `mem_f=1, mem_b=0, mem_w=-1`, an activation
  held from F to W (what their `initial_solution` callers use when the split is unknown);
- `split` (`split_memory.json.gz`): `mem_f=2, mem_b=-1, mem_w=-1`, half freed at B, their
  examples' split model (issue #39). The `wide` grid only, M in 2pp and 4pp, orders where
  pp * M <= 32, to keep the file small; the limit is in their units (`mult * 2 * pp`, 1F1B's
  peak of pp forwards), pipec's `t.act=1, t.act_w=0.5` reads it halved.

PATH_TO_ZB_CHECKOUT is a checkout (or a bare git directory) of
github.com/sail-sg/zero-bubble-pipeline-parallelism. Nothing of theirs is copied into this
repository: the two files the scheduler needs (`scheduler/zb.py`, `scheduler/graph.py`) are
read from the checkout into a temporary directory and imported from there. `zb.py` imports
`torch` (a type annotation) and `pulp` (only in `create_scheduled_nodes`, which is not called
here); where they are not installed an empty module stands in, so the standard library suffices.

Two grids (`grid` in each case):

- `base` (180 cases): pp 2, 4, 8; M in pp, 2pp, 4pp, 8; (f, b, w, comm) in `COSTS`; memory
  none, 1x, 1.5x, 2x 1F1B's peak; every stage costs the same.
- `wide` (1584 cases): pp 4, 6, 8, 16; M in 2pp, 4pp and 8pp (pp <= 8); (f, b, w) in `ORDERINGS`
  (b > f > w, b > f = w, f = b = w, w > b > f); first and last stages as heavy as the others or
  heavier (`HEAVY`: the first stage adds half a layer's costs, the last a whole layer's, as an
  embedding and an output layer do); comm 0, 0.25, 0.5 (times f); memory none and every
  quarter from 1x to 2x 1F1B's peak.

For every case the script calls their `zb.initial_solution` (what `zb.create_schedule`, the
function their runtime calls, runs before turning the times into nodes), which tries their
eight heuristic variants and keeps the one with the smallest `best_time`, and records:

- `reported`: their `best_time` (the longest stage span, each stage's first F start to its last
  W end: the start-up idle of later stages is not counted);
- `makespan`: the end of the last op on any stage with every stage starting at time 0 (their
  completion times `t`, so computed by their code): what pipec's simulator reports;
- `complete`: whether their rules placed every op. Where they leave a forward unplaced (seen
  with a heavy first stage and M = 2pp: the last microbatch's forward on stage 0), its
  completion time stays 0, their `max(t)` times a schedule that cannot run, and their runtime
  (`create_scheduled_nodes` sorts each stage's nodes by completion time) runs that forward
  first; `makespan` is then the makespan of the order their runtime runs, every op as soon
  as its stage is free and its inputs exist (their clock, computed here: `as_run`, checked
  equal to their `max(t)` on every complete variant);
- `variants`: the makespan of each of the eight variants as their runtime runs it
  (`Graph.manual_order` with `allow_bubble_before_first_b`, `prioritize_b`, `no_bubble_greedy`
  in `initial_solution`'s order: True before False, the first flag outermost), to check a
  reimplementation against;
- `peak`: every stage's peak memory under their own memory model, replayed over their order
  (their scheduler only checks the limit at some points);
- `order` (pp * M <= 128, and every incomplete case): each stage's ops in the order their
  runtime runs them, e.g. `F0 F1 B0 W0 ...`;
- `error` instead of the above where their scheduler raises (e.g. "Cannot fit memory").

Per case the costs are `f`, `b`, `w`, `comm` (every stage) and `first`, `last`: what the first
and the last stage add to `f`, `b`, `w` (their `cost_f[0] = first[0] + f`, and so on).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types

SCHED = "megatron/core/pipeline_parallel/zerobubble/scheduler"
PKG = SCHED.replace("/", ".")

COSTS = [
    (1.0, 1.0, 1.0, 0.0),
    (1.0, 2.0, 1.0, 0.0),
    (1.0, 1.5, 0.7, 0.1),
    (2.0, 3.0, 1.0, 0.5),
    (1.0, 1.0, 1.0, 1.0),
]
MEMORY = [None, 1.0, 1.5, 2.0]  # multiples of 1F1B's peak (pp activations); None: no limit

ORDERINGS = [(1.0, 1.5, 0.7), (1.0, 2.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1.25, 1.5)]
HEAVY = [(0.0, 0.0), (0.5, 1.0)]  # what the first and the last stage add, times f, b, w
COMMS = [0.0, 0.25, 0.5]
WIDE_MEMORY = [None, 1.0, 1.25, 1.5, 1.75, 2.0]


def read(checkout, name):
    path = os.path.join(checkout, SCHED, name)
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    git = (
        ["git", f"--git-dir={checkout}"]
        if not os.path.isdir(os.path.join(checkout, ".git"))
        else ["git", "-C", checkout]
    )
    return subprocess.run(
        git + ["show", f"HEAD:{SCHED}/{name}"], check=True, capture_output=True, text=True
    ).stdout


def commit(checkout):
    git = (
        ["git", f"--git-dir={checkout}"]
        if not os.path.isdir(os.path.join(checkout, ".git"))
        else ["git", "-C", checkout]
    )
    return subprocess.run(
        git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def load(checkout):
    """Import their `zb` module from a temporary copy of the two files."""
    tmp = tempfile.mkdtemp(prefix="zb_")
    for stub in ("torch", "pulp"):
        try:
            __import__(stub)
        except ImportError:
            m = types.ModuleType(stub)
            m.Tensor = object
            m.value = lambda x: x
            sys.modules[stub] = m
    parts = PKG.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [tmp] if i == len(parts) else []
            sys.modules[name] = pkg
    mods = {}
    for name in ("graph", "zb"):
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(read(checkout, f"{name}.py"))
        spec = importlib.util.spec_from_file_location(f"{PKG}.{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"{PKG}.{name}"] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["graph"], mods["zb"]


def runtime_orders(graph, t):
    """Each stage's op ids in the order their runtime runs them: `create_scheduled_nodes` sorts
    a stage's F, B, W nodes (microbatch order within each) by completion time. An op their
    rules never placed keeps completion time 0, so it runs first."""
    n, m = graph.nstages, graph.nmb
    out = []
    for s in range(n):
        ids = [graph.get_id(k, s, mb) for k in range(3) for mb in range(m)]
        out.append(sorted(ids, key=lambda i: t[i]))
    return out


def as_run(graph, comm, orders):
    """Makespan of per-stage orders when every op starts as soon as its stage is free and its
    inputs exist (producer's end + comm between stages): the clock of their scheduler, here
    applied to what their runtime runs."""
    n, m = graph.nstages, graph.nmb
    end = {}
    pc = [0] * n
    free = [0.0] * n
    while any(pc[s] < len(orders[s]) for s in range(n)):
        progress = False
        for s in range(n):
            while pc[s] < len(orders[s]):
                i = orders[s][pc[s]]
                k, mb = i // (n * m), i % m
                if k == 0:
                    deps = [(graph.get_id(0, s - 1, mb), comm)] if s > 0 else []
                elif k == 1:
                    deps = [(graph.get_id(0, s, mb), 0.0)]
                    if s + 1 < n:
                        deps.append((graph.get_id(1, s + 1, mb), comm))
                else:
                    deps = [(graph.get_id(1, s, mb), 0.0)]
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[s]] + [end[d] + c for d, c in deps])
                end[i] = start + graph.get_cost(i)
                free[s] = end[i]
                pc[s] += 1
                progress = True
        if not progress:
            raise RuntimeError("orders wait on each other")
    return max(end.values())


def run_variant(graph, config, flags):
    """One variant: its makespan as their runtime would run it, and whether their rules placed
    every op (then it is their own `max(t)`, checked here)."""
    _, t, _ = graph.manual_order(
        allow_bubble_before_first_b=flags[0], prioritize_b=flags[1], no_bubble_greedy=flags[2]
    )
    complete = min(t) > 0
    orders = runtime_orders(graph, t)
    makespan = as_run(graph, config.cost_comm, orders)
    if complete:
        assert abs(makespan - max(t)) <= 1e-9 * max(t), (makespan, max(t))
    return t, orders, makespan, complete


# Their (mem_f, mem_b, mem_w) per memory model, and the largest pp * M whose order is recorded.
MODELS = {"whole": ((1.0, 0.0, -1.0), 128), "split": ((2.0, -1.0, -1.0), 32)}


def run_case(graph_mod, zb, pp, m, cost, first, last, limit, model="whole"):
    f, b, w, c = cost
    costs = [
        [f] * pp,
        [b] * pp,
        [w] * pp,
    ]
    for k in range(3):
        costs[k][0] = first[k] + costs[k][0]
        costs[k][-1] = costs[k][-1] + last[k]
    config = graph_mod.GraphConfig(
        cost_f=costs[0],
        cost_b=costs[1],
        cost_w=costs[2],
        cost_comm=c,
        mem_f=[MODELS[model][0][0]] * pp,
        mem_b=[MODELS[model][0][1]] * pp,
        mem_w=[MODELS[model][0][2]] * pp,
        max_mem=None if limit is None else [limit] * pp,
        n_stages=pp,
        n_micro=m,
    )
    graph = zb.Graph.build_graph(pp, m, config)
    try:
        best_time, _, t = zb.initial_solution(graph, print_result=False)
    except (ValueError, AssertionError) as e:  # "Cannot fit memory", their own checks
        return {"error": str(e) or type(e).__name__}
    variants = []
    for allow_bubble_before_first_b in [True, False]:
        for prioritize_b in [True, False]:
            for no_bubble_greedy in [True, False]:
                flags = (allow_bubble_before_first_b, prioritize_b, no_bubble_greedy)
                variants.append(run_variant(graph, config, flags)[2])
    orders = runtime_orders(graph, t)
    complete = min(t) > 0
    per_stage = []
    peaks = []
    for s in range(pp):
        mem = peak = 0.0
        for i in orders[s]:
            mem += graph.get_mem(i)
            peak = max(peak, mem)
        peaks.append(peak)
        per_stage.append(" ".join("FBW"[i // (pp * m)] + str(i % m) for i in orders[s]))
    out = {
        "reported": best_time,
        "makespan": max(t) if complete else as_run(graph, c, orders),
        "complete": complete,
        "variants": variants,
        "peak": peaks,
    }
    if pp * m <= MODELS[model][1] or not complete:
        out["order"] = per_stage
    return out


def case(graph_mod, zb, grid, pp, m, cost, heavy, mult, model="whole"):
    first = tuple(heavy[0] * x for x in cost[:3])
    last = tuple(heavy[1] * x for x in cost[:3])
    limit = None if mult is None else mult * pp * MODELS[model][0][0]
    out = {
        "grid": grid,
        "pp": pp,
        "microbatches": m,
        "f": cost[0],
        "b": cost[1],
        "w": cost[2],
        "comm": cost[3],
        "first": list(first),
        "last": list(last),
        "limit_x_1f1b": mult,
        "limit": limit,
    }
    out.update(run_case(graph_mod, zb, pp, m, cost, first, last, limit, model))
    return out


def main():
    args = sys.argv[1:]
    model = "whole"
    if len(args) == 3 and args[0] == "--memory" and args[1] in MODELS:
        model = args[1]
        args = args[2:]
    if len(args) != 1:
        sys.exit(__doc__)
    checkout = args[0]
    graph_mod, zb = load(checkout)
    if model != "whole":
        split(graph_mod, zb, checkout, model)
        return
    cases = []
    for pp in (2, 4, 8):
        for m in sorted({pp, 2 * pp, 4 * pp, 8}):
            for cost in COSTS:
                for mult in MEMORY:
                    cases.append(case(graph_mod, zb, "base", pp, m, cost, (0.0, 0.0), mult))
    for pp in (4, 6, 8, 16):
        for m in [2 * pp, 4 * pp] + ([8 * pp] if pp <= 8 else []):
            for fbw in ORDERINGS:
                for heavy in HEAVY:
                    for comm in COMMS:
                        for mult in WIDE_MEMORY:
                            cost = fbw + (comm * fbw[0],)
                            cases.append(case(graph_mod, zb, "wide", pp, m, cost, heavy, mult))
    header = {
        "grids": "base: the first 180 cases; wide: heavy ends, comm, every memory quarter",
        "source": "github.com/sail-sg/zero-bubble-pipeline-parallelism",
        "commit": commit(checkout),
        "function": f"{PKG}.zb.initial_solution (called by zb.create_schedule)",
        "memory": "mem_f=1, mem_b=0, mem_w=-1 per stage; limit in activations",
    }
    write(header, cases)


def split(graph_mod, zb, checkout, model):
    """The `wide` grid, M in 2pp and 4pp, under another memory model."""
    cases = []
    for pp in (4, 6, 8, 16):
        for m in [2 * pp, 4 * pp]:
            for fbw in ORDERINGS:
                for heavy in HEAVY:
                    for comm in COMMS:
                        for mult in WIDE_MEMORY:
                            cost = fbw + (comm * fbw[0],)
                            cases.append(
                                case(graph_mod, zb, "wide", pp, m, cost, heavy, mult, model)
                            )
    f, b, w = MODELS[model][0]
    header = {
        "grids": "wide: heavy ends, comm, every memory quarter; M in 2pp, 4pp",
        "source": "github.com/sail-sg/zero-bubble-pipeline-parallelism",
        "commit": commit(checkout),
        "function": f"{PKG}.zb.initial_solution (called by zb.create_schedule)",
        "memory": f"mem_f={f:g}, mem_b={b:g}, mem_w={w:g} per stage; limit in their units "
        f"(limit_x_1f1b * {f:g} * pp)",
    }
    write(header, cases)


def write(header, cases):
    # One case per line: a reviewable diff, a small file.
    out = sys.stdout
    out.write("{\n")
    for k, v in header.items():
        out.write(f" {json.dumps(k)}: {json.dumps(v)},\n")
    out.write(' "cases": [\n')
    out.write(",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in cases))
    out.write("\n ]\n}\n")


if __name__ == "__main__":
    main()
