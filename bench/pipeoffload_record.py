"""Record PipeOffload's scheduler (the sail-sg authors' grouped interleaved 1F1B with activation
offload) on a grid of cases, as golden data for pipec's offload-aware tuner.

Usage:
    python bench/pipeoffload_record.py UPSTREAM > tests/golden/pipeoffload/pipeoffload.json
    python bench/pipeoffload_record.py UPSTREAM --cases pp4-m8-uniform-c1 ...   (a subset)

UPSTREAM is a checkout (or a bare git directory) of
github.com/sail-sg/zero-bubble-pipeline-parallelism at commit `EXPECTED_COMMIT`, or the vendored
copy `tests/golden/pipeoffload/upstream/` (the eight scheduler files of that commit, unchanged,
with their LICENSE and a COMMIT file). Their files are imported unchanged from a temporary copy;
nothing of theirs is patched. What stands in for their environment:

- `megatron.training` (imported at module level by `communication.py`, which `passes.py`
  imports) is an empty module whose `get_args()` returns `offload_overlap_sr=False` (their
  default); nothing on the path run here reads it.
- The packages `megatron`, `megatron.core`, ... are empty module objects so that their absolute
  imports (`megatron.core.pipeline_parallel.zerobubble.scheduler.graph`) resolve to the copy.
- Their functions print progress to stdout; it is swallowed.
- `offloading.adjust_warmup` is wrapped (called, its result returned unchanged) to read the copy
  passes it returns: their code keeps the copy start/end times only in those objects, the
  schedule nodes carry the start times alone.

What is run, per configuration, is exactly what their runtime does for `--cpu-offload` with an
interleaved pipeline (`runtime.py`, the "Interleaved pipeline" branch): `GraphConfig.
basic_config`, `group_interleaved_1f1b.create_schedule(config, cpu_offload, recompute_*,
interleave_group_size, offload_chunk_num)`, then `passes.run_schedule_passes` up to and including
`add_offload` (`add_send_recv_peer_stage`, `add_time`, `add_offload`; the P2P nodes added after
that do not change times). Per-stage costs are passed to `GraphConfig` directly (their
`basic_config` takes one value; their runtime measures per stage and takes the median; here the
heavy first/last ranks keep their own cost, which their code supports).

The README beside the golden file describes the grid, the units, the configurations and their
execution model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

EXPECTED_COMMIT = "39f2c186a27580b7051eb51e0f651e1efd0a8170"
SCHED = "megatron/core/pipeline_parallel/zerobubble/scheduler"
PKG = SCHED.replace("/", ".")
FILES = [
    "graph",
    "offloading",
    "communication",
    "passes",
    "group_interleaved_1f1b",
    "basic1f1b",
    "zbv",
    "zbv_greedy",
]

PPS = (4, 8)
COSTS = {"uniform": 1.0, "heavy": 1.5}  # what ranks 0 and pp-1 cost, times the others
COPIES = (0.25, 0.5, 1.0, 2.0, 3.0)  # one-way copy of a chunk's activations, in its forwards
VPPS = (2, 3, 4)
LIMITS = {"half": 1 / 2, "third": 1 / 3}  # of 1F1B's activation peak
EPS = 1e-9
ND = 4  # decimals kept


def r(x):
    return round(float(x) + 0.0, ND)


# ---------------------------------------------------------------------------------------------
# Loading their code


def _git(upstream):
    if os.path.isdir(os.path.join(upstream, ".git")):
        return ["git", "-C", upstream]
    return ["git", f"--git-dir={upstream}"]


def read_upstream(upstream):
    """(commit, {name: source}) from a checkout, a bare git dir or the vendored flat copy."""
    if os.path.exists(os.path.join(upstream, "COMMIT")):
        with open(os.path.join(upstream, "COMMIT")) as f:
            commit = f.read().split()[0]
        srcs = {}
        for n in FILES:
            with open(os.path.join(upstream, f"{n}.py")) as f:
                srcs[n] = f.read()
        return commit, srcs
    git = _git(upstream)
    commit = subprocess.run(
        git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    srcs = {}
    for n in FILES:
        path = os.path.join(upstream, SCHED, f"{n}.py")
        if os.path.exists(path):
            with open(path) as f:
                srcs[n] = f.read()
        else:
            srcs[n] = subprocess.run(
                git + ["show", f"HEAD:{SCHED}/{n}.py"], check=True, capture_output=True, text=True
            ).stdout
    return commit, srcs


class Upstream:
    """Their scheduler modules, imported from a temporary copy."""

    def __init__(self, upstream):
        self.commit, srcs = read_upstream(upstream)
        tmp = tempfile.mkdtemp(prefix="pipeoffload_")
        try:
            parts = PKG.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                pkg = types.ModuleType(name)
                pkg.__path__ = [tmp] if i == len(parts) else []
                sys.modules[name] = pkg
            training = types.ModuleType("megatron.training")
            training.get_args = lambda: types.SimpleNamespace(offload_overlap_sr=False)
            sys.modules["megatron.training"] = training
            for n in FILES:
                path = os.path.join(tmp, f"{n}.py")
                with open(path, "w") as f:
                    f.write(srcs[n])
                spec = importlib.util.spec_from_file_location(f"{PKG}.{n}", path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[f"{PKG}.{n}"] = mod
                with contextlib.redirect_stdout(io.StringIO()):
                    spec.loader.exec_module(mod)
                setattr(self, n, mod)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # Read the copy passes `add_offload_passes` computes for each pair of ranks.
        self.passes_seen = []
        original = self.offloading.adjust_warmup

        def adjust_warmup(send_recv_0, send_recv_1, solo_d2h):
            out = original(send_recv_0, send_recv_1, solo_d2h)
            self.passes_seen.append(out)
            return out

        self.offloading.adjust_warmup = adjust_warmup
        g = self.graph
        self.COMPUTE = {g.F: "F", g.B: "B", g.W: "W", g.R: "R", g.BW: "BW"}


# ---------------------------------------------------------------------------------------------
# Running their scheduler


def config(up, pp, m, vpp, heavy, bw_fix=False):
    """Their GraphConfig: every chunk of a uniform rank costs f = b = w = 1 (their clock's unit
    is one chunk's forward); ranks 0 and pp-1 cost `heavy` times that."""
    cost = [1.0] * pp
    cost[0] = cost[-1] = heavy
    cost_b = [2 * c for c in cost] if bw_fix else list(cost)
    return up.graph.GraphConfig(
        mem_f=[],
        mem_b=[],
        mem_w=[],
        cost_f=list(cost),
        cost_b=cost_b,
        cost_w=list(cost),
        max_chunks=vpp,
        n_stages=pp,
        n_micro=m,
    )


def peak_raw(up, local_order):
    """Their memory model (`offloading.get_peak_memory`), extended by the recompute rule of
    `GroupBuildingBlockScheduler.calculate_peak_memory`: +1 chunk activation at an F that keeps
    its activations, at an R (recompute pass) and at OFFLOAD_RECV_PREP (reload buffer), -1 at
    W / BW and at OFFLOAD_SEND_END. A checkpointed F (`need_recompute`) counts 0. Per rank."""
    g, ft = up.graph, up.graph.FuncType
    out = []
    for nodes in local_order:
        mem = peak = 0
        for n in nodes:
            if (n.type == g.F and not n.need_recompute) or n.type in (g.R, ft.OFFLOAD_RECV_PREP):
                mem += 1
            elif n.type in (g.W, g.BW, ft.OFFLOAD_SEND_END):
                mem -= 1
            peak = max(peak, mem)
        out.append(peak)
    return out


def makespan_raw(up, local_order):
    return max(n.completion_time for nodes in local_order for n in nodes if n.type in up.COMPUTE)


def as_run_raw(up, cfg, local_order):
    """Their `add_time` (list schedule: every op as soon as its rank is free and its input
    exists) on their op order with the times removed: what the order takes with nothing idle."""
    bare = [
        [
            dataclasses.replace(n, start_time=None, completion_time=None)
            for n in nodes
            if n.type in up.COMPUTE
        ]
        for nodes in local_order
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        timed = up.passes.add_time(cfg, bare)
    return makespan_raw(up, timed)


def run_group(up, pp, m, vpp, heavy, group_size, offload_chunks, recompute_chunks, copy):
    """One configuration of their grouped interleaved scheduler; raw units (chunk forward = 1,
    chunk activation = 1). Returns (record, local_order, copy passes per rank) or raises."""
    cfg = config(up, pp, m, vpp, heavy)
    up.passes_seen.clear()
    with contextlib.redirect_stdout(io.StringIO()):
        if recompute_chunks:
            lo = up.group_interleaved_1f1b.create_schedule(
                cfg,
                cpu_offload=False,
                recompute_granularity="full",
                recompute_method="chunk",
                recompute_num_layers=recompute_chunks,
                interleave_group_size=group_size,
                offload_chunk_num=0,
            )
        else:
            lo = up.group_interleaved_1f1b.create_schedule(
                cfg,
                cpu_offload=offload_chunks > 0,
                recompute_granularity=None,
                recompute_method=None,
                recompute_num_layers=None,
                interleave_group_size=group_size,
                offload_chunk_num=offload_chunks,
            )
        lo = up.passes.add_send_recv_peer_stage(cfg, lo)
        lo = up.passes.add_time(cfg, lo)
        if offload_chunks:
            # Their `--offload-time` is the one-way copy time over a chunk's f + b + w of the
            # most expensive rank (`parallel_offload_time = max(f+b+w) * offload_time`): ask
            # for `copy` chunk forwards of a uniform rank.
            fbw = max(f + b + w for f, b, w in zip(cfg.cost_f, cfg.cost_b, cfg.cost_w))
            lo = up.offloading.add_offload(cfg, lo, copy / fbw)
    copies = [[] for _ in range(pp)]
    for k, (p0, p1) in enumerate(up.passes_seen):
        copies[2 * k], copies[2 * k + 1] = list(p0), list(p1)
    rec = {
        "makespan_raw": r(makespan_raw(up, lo)),
        "as_run_raw": r(as_run_raw(up, cfg, lo)),
        "peak_raw": peak_raw(up, lo),
    }
    return rec, lo, copies


def check_copies(up, lo, copies):
    """Consistency of their copy plan with their own timeline: each offload starts after its F
    ends, each reload after its offload ends and before its B starts, copies on one rank never
    overlap, and a pair never has two copies in one direction at once. Returns a list of
    violations (empty when consistent)."""
    g = up.graph
    bad = []
    spans = []
    for rank, (nodes, passes) in enumerate(zip(lo, copies)):
        fend = {
            (n.layer_group_idx, n.microbatch): n.completion_time for n in nodes if n.type == g.F
        }
        bstart = {
            (n.layer_group_idx, n.microbatch): n.start_time for n in nodes if n.type in (g.B, g.BW)
        }
        sent = {}
        last = None
        for p in sorted(passes, key=lambda p: (p.start_time, p.index)):
            key = (p.node.layer_group_idx, p.node.microbatch)
            d = p.index % 2 == 0  # even index: D2H (offload), odd: H2D (reload)
            end = p.completion_time
            if last is not None and p.start_time < last - EPS:
                bad.append(f"rank {rank}: copies overlap at {p.start_time}")
            last = end
            if d:
                sent[key] = end
                if p.start_time < fend[key] - EPS:
                    bad.append(f"rank {rank}: offload {key} before its F ends")
            else:
                if key not in sent or p.start_time < sent[key] - EPS:
                    bad.append(f"rank {rank}: reload {key} before its offload ends")
                if end > bstart[key] + EPS:
                    bad.append(f"rank {rank}: reload {key} ends after its B starts")
            spans.append((rank // 2, d, p.start_time, end))
    for pair in {s[0] for s in spans}:
        for d in (True, False):
            iv = sorted((s, e) for q, dd, s, e in spans if q == pair and dd == d)
            for (_, e0), (s1, _) in itertools.pairwise(iv):
                if s1 < e0 - EPS:
                    bad.append(f"pair {pair}: two {'D2H' if d else 'H2D'} copies at {s1}")
    return bad


def plan(up, lo, copies):
    """Per rank: their compute ops in program order and their copy stream, times on their
    clock (raw: chunk forward = 1; divide by vpp for rank forwards). Token `F5.3@24-25`: type
    (F, B, W, R; offload = D2H, reload = H2D), global (virtual) stage, microbatch, start-end."""
    out = []
    for nodes, passes in zip(lo, copies):
        comp = [
            f"{up.COMPUTE[n.type]}{n.layer_group_idx}.{n.microbatch}"
            f"@{r(n.start_time):g}-{r(n.completion_time):g}"
            for n in nodes
            if n.type in up.COMPUTE
        ]
        cp = [
            f"{'offload' if p.index % 2 == 0 else 'reload'}{p.node.layer_group_idx}."
            f"{p.node.microbatch}@{r(p.start_time):g}-{r(p.completion_time):g}"
            for p in sorted(passes, key=lambda p: (p.start_time, p.index))
        ]
        out.append({"compute": comp, "copy": cp})
    return out


def group_configs(pp, offload=True):
    """Every configuration their interleaved branch exposes: `--virtual-pipeline-model-parallel-
    size` (chunks per rank), `--interleave-group-size` (1..pp; their README recommends
    ceil(pp/2)..pp; larger values are reset to pp), `--offload-chunk-num` (the first k chunks of
    every rank are offloaded: `should_offload = chunk < k`) with `--cpu-offload`, or
    `--recompute-granularity full --recompute-method chunk --recompute-num-layers k` (the first
    k chunks recomputed; their code then uses group size 1 whatever is asked)."""
    out = []
    for vpp in VPPS:
        for gs in range(1, pp + 1):
            for k in range(vpp + 1 if offload else 1):
                out.append((vpp, gs, k, 0))
        for k in range(1, vpp + 1):
            out.append((vpp, 1, 0, k))
    return out


def config_name(vpp, gs, off, rc):
    if rc:
        return f"vpp{vpp}-recompute{rc}"
    return f"vpp{vpp}-g{gs}-offload{off}"


def other_schedules(up, pp, m, heavy):
    """Their schedules without offload, for reference: 1F1B (`basic1f1b`), ZB-V (`zbv`),
    V-Half and V-Min (`zbv_greedy`). The V orders are built from uniform costs (their runtime
    gives these schedulers one median cost), then timed by their `add_time` under the per-rank
    costs. Times in rank forwards, memory in rank activations."""
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        # 1F1B fuses B and W into BW; their `add_time` prices BW as `cost_b + cost_w`, which
        # on their per-stage lists is a concatenation (a BW costs b). The config passed to
        # `add_time` here carries b + w in cost_b instead, so BW costs b + w.
        cfg = config(up, pp, m, 1, heavy, bw_fix=True)
        lo = up.passes.add_time(cfg, up.basic1f1b.create_schedule(cfg))
        out["1f1b"] = {
            "makespan": r(makespan_raw(up, lo)),
            "peak": max(peak_raw(up, lo)),
            "order": [
                " ".join(f"{up.COMPUTE[n.type]}{n.microbatch}" for n in nodes) for nodes in lo
            ],
        }
        cfg = config(up, pp, m, 2, heavy)
        for name, make in (
            ("zb-v", lambda: up.zbv.PipelineGraph(pp, m, 1, 1, 1, 0, 1, 0, -1)),
            ("v-half", lambda: up.zbv_greedy.PipelineGraph(pp, m, "half", 1, 1, 1, 0)),
            ("v-min", lambda: up.zbv_greedy.PipelineGraph(pp, m, "min", 1, 1, 1, 0)),
        ):
            uni = config(up, pp, m, 2, 1.0)
            lo = make().create_schedule(uni)
            lo = up.passes.add_send_recv_peer_stage(cfg, lo)
            lo = up.passes.add_time(cfg, lo)
            out[name] = {
                "makespan": r(makespan_raw(up, lo) / 2),
                "peak": r(max(peak_raw(up, lo)) / 2),
            }
    for v in out.values():
        v["peak_x_1f1b"] = r(v["peak"] / pp)
    return out


_MEMO = {}


def run_case(up, pp, m, costs, copy, others):
    heavy = COSTS[costs]
    peak_1f1b = pp  # rank 0 of 1F1B holds pp microbatches of all its layers
    configs = {}
    plans = {}
    for vpp, gs, off, rc in group_configs(pp):
        name = config_name(vpp, gs, off, rc)
        rec = {"vpp": vpp, "group_size": gs, "offload_chunks": off, "recompute_chunks": rc}
        try:
            if off:
                raw, lo, copies = run_group(up, pp, m, vpp, heavy, gs, off, rc, copy)
            else:  # without offload a configuration does not depend on `copy`
                key = (pp, m, heavy, vpp, gs, rc)
                if key[:3] != _MEMO.get("case"):
                    _MEMO.clear()
                    _MEMO["case"] = key[:3]
                if key not in _MEMO:
                    _MEMO[key] = run_group(up, pp, m, vpp, heavy, gs, off, rc, copy)
                raw, lo, copies = _MEMO[key]
        except (AssertionError, IndexError, KeyError, RuntimeError, ValueError) as e:
            # Their code's own failures: "Unable to schedule offload ..." (an assert), or an
            # IndexError in `adjust_warmup` when a rank of a pair has no copy to make.
            rec["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            configs[name] = rec
            continue
        rec.update(raw)
        rec["makespan"] = r(raw["makespan_raw"] / vpp)
        rec["as_run"] = r(raw["as_run_raw"] / vpp)
        rec["peak"] = r(max(raw["peak_raw"]) / vpp)
        rec["peak_x_1f1b"] = r(max(raw["peak_raw"]) / vpp / peak_1f1b)
        if off:
            rec["offloaded"] = [sum(1 for p in c if p.index % 2 == 0) for c in copies]
            rec["copy_violations"] = check_copies(up, lo, copies)
        configs[name] = rec
        plans[name] = (lo, copies)
    best = {}
    best_any = {}
    used = {}
    for lim, frac in LIMITS.items():
        limit = peak_1f1b * frac
        fits = [
            (c["makespan"], c["peak"], n)
            for n, c in configs.items()
            if "error" not in c and c["peak"] <= limit + EPS
        ]
        if fits:
            mk, pk, n = min(fits)
            best[lim] = {"config": n, "makespan": mk, "peak": pk, "peak_x_1f1b": r(pk / pp)}
            lo, copies = plans[n]
            used[n] = plan(up, lo, copies)
        else:
            best[lim] = None
        # Also their schedules without offload (1F1B, ZB-V, V-Half, V-Min), which fit by
        # their shape alone: the best any of their code gives under the limit.
        fits += [
            (o["makespan"], o["peak"], k) for k, o in others.items() if o["peak"] <= limit + EPS
        ]
        if fits:
            mk, pk, n = min(fits)
            best_any[lim] = {"config": n, "makespan": mk, "peak": pk, "peak_x_1f1b": r(pk / pp)}
        else:
            best_any[lim] = None
    return {
        "pp": pp,
        "microbatches": m,
        "costs": costs,
        "heavy": heavy,
        "copy": copy,
        "paired": True,
        "limits": {k: r(peak_1f1b * v) for k, v in LIMITS.items()},
        "configs": configs,
        "best": best,
        "best_any": best_any,
        "plans": used,
    }


def reference(up):
    """The issue's figures: pp=8, M=32, uniform costs."""
    rec, lo, copies = run_group(up, 8, 32, 3, 1.0, 8, 2, 0, 1.0)
    other = other_schedules(up, 8, 32, 1.0)
    return {
        "grouped_interleaved_vpp3_g8_offload2_copy1": {
            "makespan": r(rec["makespan_raw"] / 3),
            "peak": r(max(rec["peak_raw"]) / 3),
            "peak_x_1f1b": r(max(rec["peak_raw"]) / 3 / 8),
            "issue": {"makespan": 100.67, "peak_x_1f1b": r(1 / 3)},
        },
        "1f1b": {**other["1f1b"], "issue": {"makespan": 117.0, "peak_x_1f1b": 1.0}},
        "zb-v": {**other["zb-v"], "issue": {"makespan": 99.5, "peak_x_1f1b": 1.0}},
        "v-half": {**other["v-half"], "issue": {"makespan": 104.5, "peak_x_1f1b": 0.625}},
        "v-min": {**other["v-min"], "issue": {"makespan": 109.5, "peak_x_1f1b": 0.5}},
        "copy_violations": check_copies(up, lo, copies),
    }


def case_id(pp, m, costs, copy):
    return f"pp{pp}-m{m}-{costs}-c{copy:g}"


def grid():
    for pp in PPS:
        for m in (2 * pp, 4 * pp):
            for costs in COSTS:
                for copy in COPIES:
                    yield pp, m, costs, copy


def record(upstream, only=None, with_reference=None):
    """The golden data: every case of the grid (or those in `only`), their other schedules,
    and the issue's reference figures (by default only for the whole grid)."""
    up = Upstream(upstream)
    cases = {}
    others = {}
    for pp, m, costs, copy in grid():
        cid = case_id(pp, m, costs, copy)
        if only is not None and cid not in only:
            continue
        key = f"pp{pp}-m{m}-{costs}"
        if key not in others:
            others[key] = other_schedules(up, pp, m, COSTS[costs])
        cases[cid] = run_case(up, pp, m, costs, copy, others[key])
    out = {
        "source": "github.com/sail-sg/zero-bubble-pipeline-parallelism",
        "commit": up.commit,
        "expected_commit": EXPECTED_COMMIT,
        "units": {
            "time": "one forward of one microbatch over all the layers of a uniform rank "
            "(their clock: f = b = w = 1 per chunk; *_raw = time * vpp)",
            "memory": "activations of one microbatch over all the layers of a uniform rank "
            "(1F1B's peak = pp; their unit is one chunk's: *_raw = memory * vpp)",
            "copy": "one-way copy of one chunk's activations, in forwards of that chunk "
            "(their parallel_offload_time, raw units); alone in the pair: 0.7 of it",
        },
        "cases": cases,
        "other_schedules": others,
    }
    if with_reference or (with_reference is None and only is None):
        out["reference"] = reference(up)
    return out


def dumps(obj):
    return json.dumps(obj, sort_keys=True, indent=None, separators=(",", ":"))


def write(out, stream):
    """Deterministic: sorted keys; one case (and one `other_schedules` entry) per line."""
    stream.write("{\n")
    keys = sorted(out)
    for i, k in enumerate(keys):
        v = out[k]
        sep = "," if i + 1 < len(keys) else ""
        if k in ("cases", "other_schedules"):
            stream.write(f"{json.dumps(k)}:{{\n")
            items = sorted(v.items())
            for j, (ck, cv) in enumerate(items):
                tail = "," if j + 1 < len(items) else ""
                stream.write(f"{json.dumps(ck)}:{dumps(cv)}{tail}\n")
            stream.write(f"}}{sep}\n")
        else:
            stream.write(f"{json.dumps(k)}:{dumps(v)}{sep}\n")
    stream.write("}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream", help="checkout, bare git dir or vendored copy of their code")
    ap.add_argument("--cases", nargs="*", help="record only these case ids")
    ap.add_argument("--reference", action="store_true", help="with --cases: the reference too")
    ap.add_argument("--allow-other-commit", action="store_true")
    args = ap.parse_args(argv)
    only = None if args.cases is None else set(args.cases)
    out = record(args.upstream, only, True if args.reference else None)
    if out["commit"] != EXPECTED_COMMIT and not args.allow_other_commit:
        sys.exit(f"their code is at {out['commit']}, recorded at {EXPECTED_COMMIT}")
    write(out, sys.stdout)


if __name__ == "__main__":
    main()
