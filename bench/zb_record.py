"""Record the zero-bubble authors' automatic scheduler on a grid of cases.

Usage: python bench/zb_record.py PATH_TO_ZB_CHECKOUT > tests/golden/zb/auto_schedule.json

PATH_TO_ZB_CHECKOUT is a checkout (or a bare git directory) of
github.com/sail-sg/zero-bubble-pipeline-parallelism. Nothing of theirs is copied into this
repository: the two files the scheduler needs (`scheduler/zb.py`, `scheduler/graph.py`) are
read from the checkout into a temporary directory and imported from there. `zb.py` imports
`torch` (a type annotation) and `pulp` (only in `create_scheduled_nodes`, which is not called
here); where they are not installed an empty module stands in, so the standard library suffices.

For every case the script calls their `zb.initial_solution` (what `zb.create_schedule`, the
function their runtime calls, runs before turning the times into nodes), which tries their
eight heuristic variants and keeps the one with the smallest `best_time`, and records:

- `reported`: their `best_time` (the longest stage span, each stage's first F start to its last
  W end: the start-up idle of later stages is not counted);
- `makespan`: the end of the last op on any stage with every stage starting at time 0 (their
  completion times `t`, so computed by their code): what pipec's simulator reports;
- `peak`: every stage's peak memory under their own memory model, replayed over their order
  (their scheduler only checks the limit at some points);
- `order` (pp * M <= 64): each stage's ops, e.g. `F0 F1 B0 W0 ...`.

Memory: `mem_f = 1, mem_b = 0, mem_w = -1` (an activation lives from its F to its W, pipec's
rule with a split backward) and `max_mem` in activations; `limit: null` is their default
(`3 * M * mem_f`: no limit).
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


def run_case(graph_mod, zb, pp, m, cost, limit):
    f, b, w, c = cost
    config = graph_mod.GraphConfig(
        cost_f=[f] * pp,
        cost_b=[b] * pp,
        cost_w=[w] * pp,
        cost_comm=c,
        mem_f=[1.0] * pp,
        mem_b=[0.0] * pp,
        mem_w=[-1.0] * pp,
        max_mem=None if limit is None else [limit] * pp,
        n_stages=pp,
        n_micro=m,
    )
    graph = zb.Graph.build_graph(pp, m, config)
    try:
        best_time, order, t = zb.initial_solution(graph, print_result=False)
    except ValueError as e:  # "Cannot fit memory"
        return {"error": str(e)}
    per_stage = []
    peaks = []
    for s in range(pp):
        ids = [graph.get_id(k, s, mb) for k in range(3) for mb in range(m)]
        ids.sort(key=lambda i: order[i])
        mem = peak = 0.0
        for i in ids:
            mem += graph.get_mem(i)
            peak = max(peak, mem)
        peaks.append(peak)
        per_stage.append(" ".join("FBW"[i // (pp * m)] + str(i % m) for i in ids))
    out = {
        "reported": best_time,
        "makespan": max(t),
        "peak": peaks,
    }
    if pp * m <= 64:
        out["order"] = per_stage
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    checkout = sys.argv[1]
    graph_mod, zb = load(checkout)
    cases = []
    for pp in (2, 4, 8):
        for m in sorted({pp, 2 * pp, 4 * pp, 8}):
            for cost in COSTS:
                for mult in MEMORY:
                    limit = None if mult is None else mult * pp
                    case = {
                        "pp": pp,
                        "microbatches": m,
                        "f": cost[0],
                        "b": cost[1],
                        "w": cost[2],
                        "comm": cost[3],
                        "limit_x_1f1b": mult,
                        "limit": limit,
                    }
                    case.update(run_case(graph_mod, zb, pp, m, cost, limit))
                    cases.append(case)
    json.dump(
        {
            "source": "github.com/sail-sg/zero-bubble-pipeline-parallelism",
            "commit": commit(checkout),
            "function": f"{PKG}.zb.initial_solution (called by zb.create_schedule)",
            "memory": "mem_f=1, mem_b=0, mem_w=-1 per stage; limit in activations",
            "cases": cases,
        },
        sys.stdout,
        indent=1,
    )
    print()


if __name__ == "__main__":
    main()
