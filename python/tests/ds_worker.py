"""One rank of the DeepSpeed tests (launched by ``launch.py``; CPU, gloo on loopback).

For every configuration in the JSON file it is given, this rank builds a DeepSpeed
``PipelineEngine`` over a ``PipelineModule`` of Linear+Tanh layers (fp32, ZeRO stage 0, a client
SGD, ``gradient_accumulation_steps`` = microbatches), installs a pipec schedule with
``pipec.deepspeed.use`` (or keeps DeepSpeed's own ``TrainSchedule``), trains two
``train_batch`` steps and compares with the same model run without pipelining on this rank:

- the value ``train_batch`` returns on this rank, with the mean microbatch loss;
- each microbatch's loss (last stage), with the unpipelined one;
- every parameter of this rank's layers after the two steps;
- the order in which this rank ran its forwards (found from what each forward received,
  matched against the unpipelined activations) and its weight-gradient passes (found from the
  gradient each added, matched against per-microbatch unpipelined gradients), with the
  schedule's own order; and the adapter's trace of every compute op with the schedule;
- the work of every backward instruction (the aten ops torch's dispatcher runs in it) with one
  whole backward of the same stage run unpipelined: ``bwd_D`` + ``bwd_W`` must do no more than
  it, each weight gradient accumulated once per microbatch, in ``bwd_W``.

Forward-only configurations run ``eval_batch``; refusal configurations call ``use`` with a
schedule DeepSpeed cannot run and record the error. One JSON line per configuration goes to
``<out>/rank-<r>.jsonl``.

Usage: python ds_worker.py CONFIGS.json RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections import Counter
from datetime import timedelta

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import deepspeed.ops
import pipec
import pipec.deepspeed as pds
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from launch import record_each
from torch.utils._python_dispatch import TorchDispatchMode

# The CPU accelerator JIT-builds a shared-memory op with ninja and g++ unless it is marked
# incompatible; gloo needs none of it.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

DIM = 6
ROWS = 2  # rows per microbatch
LAYERS_PER_STAGE = 2
STEPS = 2
LR = 0.05
BASE_SEED = 1234


class Layer(torch.nn.Module):
    """Linear + Tanh whose weights depend only on its global index (each rank builds only its
    own layers, the unpipelined copy all of them)."""

    def __init__(self, index: int):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)
        g = torch.Generator().manual_seed(BASE_SEED + index)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(DIM, DIM, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(DIM, generator=g) * 0.1)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def data(step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)) for _ in range(m)
    ]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------- work counting
# Ops that move or alias data but compute nothing (what a backward costs is the rest).
NO_WORK = {
    "t",
    "view",
    "expand",
    "detach",
    "alias",
    "_to_copy",
    "clone",
    "copy_",
    "empty_like",
    "empty",
    "zeros_like",
    "ones_like",
    "fill_",
    "zero_",
    "new_empty_strided",
    "new_zeros",
}


class OpCount(TorchDispatchMode):
    """Every aten op torch's dispatcher runs while active (the autograd engine carries the mode
    into the backward), as (op, output shape) -> count."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = list(out.shape) if torch.is_tensor(out) else "-"
        self.ops[f"{func.overloadpacket.__name__}{shape}"] += 1
        return out


def work(ops: Counter) -> Counter:
    return Counter({k: v for k, v in ops.items() if k.split("[")[0].rstrip("-") not in NO_WORK})


def layer_ops(ops: Counter) -> Counter:
    """The ops of the Linear+Tanh layers' backward and of the gradient accumulation."""
    return Counter({k: v for k, v in ops.items() if k.split("[")[0] in LAYER_OPS})


LAYER_OPS = {"mm", "tanh_backward", "sum", "add_"}


def reference_backward_work(pp: int, m: int, rank: int, ref, accumulate: bool) -> Counter:
    """The ops of one whole backward of this rank's stage, unpipelined and without DeepSpeed:
    a copy of its layers, the loss divided by the microbatch count on the last stage (as
    DeepSpeed scales it), the output's gradient elsewhere; the stage input needs a gradient
    except on the first stage (data). ``accumulate``: ``.grad`` already holds an earlier
    microbatch's gradient (added to, where the first microbatch's is stored)."""
    start, stop = rank * LAYERS_PER_STAGE, (rank + 1) * LAYERS_PER_STAGE
    stage = copy.deepcopy(torch.nn.Sequential(*[ref[i] for i in range(start, stop)]))
    for p in stage.parameters():
        p.grad = torch.zeros_like(p) if accumulate else None
    x, y = data(0, 1)[0]
    x.requires_grad_(rank > 0)
    out = stage(x)
    root = loss_fn(out, y) if rank == pp - 1 else out
    with OpCount() as c:
        if rank == pp - 1:
            (root / m).backward()
        else:
            root.backward(torch.ones_like(root))
    return work(c.ops)


def make_engine(pp: int, m: int, precision: str | None = None, accum: str = "bf16"):
    layers = pp * LAYERS_PER_STAGE
    module = PipelineModule(
        layers=[LayerSpec(Layer, i) for i in range(layers)],
        num_stages=pp,
        loss_fn=loss_fn,
        partition_method="uniform",
    )
    config = {
        "train_batch_size": m * ROWS,
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,
    }
    if precision is not None:  # DeepSpeed casts the module to it and wraps the SGD
        config[precision] = {"enabled": True}
        if accum == "fp32":
            config["zero_optimization"] = {"stage": 1}
            config["data_types"] = {"grad_accum_dtype": "fp32"}
            config["zero_allow_untested_optimizer"] = True  # the client SGD
    opt = torch.optim.SGD([p for p in module.parameters()], lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    return engine


def schedule_of(cfg: dict):
    if "tune" in cfg:
        sched, _ = pipec.tune(**cfg["tune"])
        return sched, json.loads(sched._n.header_json())["layout"]["stages"]
    return pipec.compile(**cfg["compile"]), None


def expected_order(sched, rank: int) -> list[tuple[str, int, int]]:
    out = []
    for ins in sched.instructions(rank):
        if ins["op"] == "fwd_bwd":
            out.append(("fwd", ins["fwd_stage"], ins["fwd_mb"]))
            out.append(("bwd", ins["bwd_stage"], ins["bwd_mb"]))
        elif ins["op"] in ("fwd", "bwd", "bwd_D", "bwd_W"):
            out.append((ins["op"], ins["stage"], ins["mb"]))
    return out


def nearest(x: torch.Tensor, candidates: list[torch.Tensor]) -> tuple[int, float]:
    errs = [rel_err(x, c) for c in candidates]
    k = min(range(len(errs)), key=errs.__getitem__)
    return k, errs[k]


def run_train(cfg: dict, rank: int) -> dict:
    pp, m, tol = cfg["pp"], cfg["m"], cfg["tol"]
    sched = layout = None
    engine = make_engine(pp, m)
    if cfg.get("stock"):
        want = None
    else:
        sched, layout = schedule_of(cfg)
        pds.use(engine, sched)
        want = expected_order(sched, rank)
    module = engine.module
    start, stop = module._local_start, module._local_stop
    if layout is not None:
        # The tuned plan's layer split must be the one the PipelineModule made.
        per_stage = [stage.count("t") for stage in layout]
        if per_stage[rank] != stop - start:
            raise AssertionError(f"tuned layout {layout} vs DeepSpeed's split {module.parts}")
    local = [f for f in module.forward_funcs]
    ref = torch.nn.Sequential(*[Layer(i) for i in range(pp * LAYERS_PER_STAGE)])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    # What the pipelined forwards received, and what each weight-gradient pass added.
    seen_inputs: list[torch.Tensor] = []
    local[0].register_forward_pre_hook(
        lambda mod, args: seen_inputs.append(args[0].detach().clone())
    )
    watched = local[-1].lin.weight
    grad_snaps: list[torch.Tensor] = []
    watched.register_post_accumulate_grad_hook(lambda p: grad_snaps.append(p.grad.detach().clone()))

    # What every backward instruction of the adapter runs (torch's dispatcher, not the adapter,
    # tells), and which pass each local parameter's gradient is accumulated in.
    passes: dict[tuple[str, int], Counter] = {}
    accumulated: list[tuple[str, int, str]] = []
    current: list = [None]
    if want is not None:
        instr = pds._instructions()
        for op in ("bwd", "bwd_D", "bwd_W"):
            cls = instr[getattr(pipec.Op, op)]
            fn = engine._INSTRUCTION_MAP[cls]

            def counted(eng, buffer_id, fn=fn, op=op):
                current[0] = (op, buffer_id)
                with OpCount() as c:
                    fn(eng, buffer_id)
                current[0] = None
                passes[(op, buffer_id)] = passes.get((op, buffer_id), Counter()) + c.ops

            engine._INSTRUCTION_MAP[cls] = counted
        for name, p in module.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: accumulated.append((*(current[0] or ("none", -1)), name))
            )
    work_report = None

    loss_err = param_err = 0.0
    n_losses = 0
    traces, returned = [], []
    for step in range(STEPS):
        batch = data(step, m)
        # The unpipelined model: the stage input of each microbatch, its loss, and the
        # gradient it adds to the watched weight (DeepSpeed scales each loss by 1/m).
        ref_inputs, ref_losses, ref_wgrads = [], [], []
        ref_opt.zero_grad()
        for x, y in batch:
            h = x
            for i in range(start):
                h = ref[i](h)
            ref_inputs.append(h.detach().clone())
            before = ref[stop - 1].lin.weight.grad
            before = (
                torch.zeros_like(ref[stop - 1].lin.weight) if before is None else before.clone()
            )
            loss = loss_fn(ref(x), y)
            (loss / m).backward()
            ref_wgrads.append(ref[stop - 1].lin.weight.grad - before)
            ref_losses.append(loss.detach())
        seen_inputs.clear()
        grad_snaps.clear()
        passes.clear()
        accumulated.clear()
        out = engine.train_batch(iter(batch))
        returned.append(float(out))
        mean = torch.stack(ref_losses).mean()
        e = rel_err(out.detach().reshape(()), mean)
        loss_err = max(loss_err, e)
        if not e <= tol:
            raise AssertionError(
                f"step {step}: train_batch returned {out}, unpipelined mean {mean}"
            )
        if engine.is_last_stage() and not cfg.get("stock"):
            if len(engine.pipec_losses) != m:
                raise AssertionError(f"{len(engine.pipec_losses)} microbatch losses for {m}")
            for mb, (a, b) in enumerate(zip(engine.pipec_losses, ref_losses)):
                e = rel_err(a, b)
                loss_err = max(loss_err, e)
                n_losses += 1
                if not e <= tol:
                    raise AssertionError(f"step {step} microbatch {mb}: loss {a} != {b}")
        # The order the forwards really ran in, from what they received.
        fwd_order = []
        for t in seen_inputs:
            k, e = nearest(t, ref_inputs)
            if not e <= tol:
                raise AssertionError(f"step {step}: a forward received no microbatch's input")
            fwd_order.append(k)
        # The order of the weight-gradient passes, from what each added to the watched weight.
        w_order, prev = [], torch.zeros_like(watched)
        for snap in grad_snaps:
            k, e = nearest(snap - prev, ref_wgrads)
            if not e <= tol * 100:
                raise AssertionError(f"step {step}: a weight gradient matches no microbatch ({e})")
            w_order.append(k)
            prev = snap
        if want is not None:
            want_f = [mb for op, _, mb in want if op == "fwd"]
            want_w = [mb for op, _, mb in want if op in ("bwd", "bwd_W")]
            if fwd_order != want_f:
                raise AssertionError(f"step {step}: forwards ran {fwd_order}, schedule {want_f}")
            if w_order != want_w:
                raise AssertionError(f"step {step}: weight grads ran {w_order}, schedule {want_w}")
            got = [tuple(t) for t in engine.pipec_trace]
            if got != [tuple(t) for t in want]:
                raise AssertionError(f"step {step}: trace {got} != schedule {want}")
        traces.append({"fwd": fwd_order, "w": w_order})
        if want is not None:
            work_report = check_work(pp, m, rank, ref, module, want, passes, accumulated)
        ref_opt.step()
    params = {}
    for i in range(start, stop):
        for name, p in module.named_parameters():
            if name.startswith(f"{i}."):
                q = dict(ref.named_parameters())[name]
                e = rel_err(p.detach(), q.detach())
                param_err = max(param_err, e)
                params[name] = p.detach().flatten().tolist()
                if not e <= tol:
                    raise AssertionError(f"parameter {name} differs (relative {e:.3g})")
    return {
        "stage": rank,
        "returned": returned,
        "losses_compared": n_losses,
        "params": params,
        "orders": traces,
        "max_loss_rel_err": loss_err,
        "max_param_rel_err": param_err,
        "work": work_report,
    }


def check_work(pp, m, rank, ref, module, want, passes, accumulated) -> dict:
    """Each microbatch's backward work on this rank: bwd_D and bwd_W together run exactly the
    ops of one whole unpipelined backward of the stage (the input-gradient chain once, each
    weight gradient once), bwd_D accumulates no weight gradient, bwd_W none of the
    input-gradient chain's ops (tanh_backward and the input-shaped mm), and every parameter's
    gradient is accumulated exactly once per microbatch."""
    first, later = (reference_backward_work(pp, m, rank, ref, acc) for acc in (False, True))
    names = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    act = f"{[ROWS, DIM]}"
    # The microbatch whose weight pass runs first on this rank stores .grad, the others add.
    w_first = next(mb for op, _, mb in want if op in ("bwd", "bwd_W"))
    for mb in range(m):
        whole = first if mb == w_first else later
        split = ("bwd_D", mb) in passes
        if split:
            d, w = work(passes[("bwd_D", mb)]), work(passes[("bwd_W", mb)])
            got = d + w
            if rank == 0:
                # No input gradient to send: bwd_D does nothing, bwd_W the whole backward.
                if d:
                    raise AssertionError(f"mb {mb}: bwd_D of the first stage ran {d}")
            elif d[f"tanh_backward{act}"] != LAYERS_PER_STAGE or w[f"tanh_backward{act}"]:
                raise AssertionError(f"mb {mb}: the chain ran {d} in bwd_D, {w} in bwd_W")
            elif w[f"mm{act}"] or d[f"mm{[DIM, DIM]}"]:
                raise AssertionError(f"mb {mb}: an input gradient in bwd_W or a weight's in bwd_D")
        else:
            got = work(passes[("bwd", mb)])
        # The layers' backward ops (each input- and weight-gradient mm, each tanh_backward,
        # each bias sum, each accumulation into .grad) exactly as in one whole backward; in
        # all, no more ops (on the last stage DeepSpeed's output hook divides the output's
        # gradient by the microbatch count where its whole backward divides the loss).
        if layer_ops(got) != layer_ops(whole) or sum(got.values()) > sum(whole.values()):
            raise AssertionError(
                f"mb {mb}: the backward ran {dict(got)}, one whole backward {dict(whole)}"
            )
        acc = sorted((op, n) for op, b, n in accumulated if b == mb)
        if acc != sorted(("bwd_W" if split else "bwd", n) for n in names):
            raise AssertionError(f"mb {mb}: weight gradients accumulated as {acc}")
    report = {"whole": dict(first if w_first == 0 else later)}
    if ("bwd_D", 0) in passes:
        report["bwd_D"] = dict(work(passes[("bwd_D", 0)]))
        report["bwd_W"] = dict(work(passes[("bwd_W", 0)]))
    else:
        report["bwd"] = dict(work(passes[("bwd", 0)]))
    return report


def run_eval(cfg: dict, rank: int) -> dict:
    pp, m, tol = cfg["pp"], cfg["m"], cfg["tol"]
    engine = make_engine(pp, m)
    sched = pipec.compile(**cfg["compile"])
    pds.use(engine, sched)
    ref = torch.nn.Sequential(*[Layer(i) for i in range(pp * LAYERS_PER_STAGE)])
    batch = data(7, m)
    out = engine.eval_batch(iter(batch))
    with torch.no_grad():
        mean = torch.stack([loss_fn(ref(x), y) for x, y in batch]).mean()
    e = rel_err(out.reshape(()), mean)
    if not e <= tol:
        raise AssertionError(f"eval_batch returned {out}, unpipelined {mean}")
    want = [t for t in expected_order(sched, rank)]
    if [tuple(t) for t in engine.pipec_trace] != want:
        raise AssertionError(f"trace {engine.pipec_trace} != schedule {want}")
    return {"stage": rank, "max_loss_rel_err": e, "max_param_rel_err": 0.0}


def run_refusals(cfg: dict, rank: int) -> dict:
    pp, m = cfg["pp"], cfg["m"]
    engine = make_engine(pp, m)
    errors = {}
    for name, kw in cfg["refuse"].items():
        try:
            pds.use(engine, pipec.compile(**kw))
        except pipec.PipecError as e:
            errors[name] = str(e)
        else:
            errors[name] = None
    return {"stage": rank, "errors": errors, "max_loss_rel_err": 0.0, "max_param_rel_err": 0.0}


def run_precision(cfg: dict, rank: int) -> dict:
    """A bf16 engine (DeepSpeed's ``BF16_Optimizer``): DeepSpeed's own TrainSchedule
    (``stock``) or a pipec schedule (``compile`` or ``tune`` arguments) trains STEPS steps on
    the same model and data. ``accum`` is the dtype DeepSpeed sums the microbatch gradients in:
    "fp32" (ZeRO stage 1 with ``data_types.grad_accum_dtype = fp32``, what bf16 pipeline jobs
    use) or "bf16" (ZeRO stage 0, which DeepSpeed allows only with bf16 accumulation). What
    comes back is what the test compares between two runs: the value ``train_batch`` returned
    each step; every microbatch's bf16 gradient as it is added into the optimizer's
    accumulator (the ``.grad`` of every parameter at each ``update_hp_grads``); the accumulated
    gradients the optimizer step reads (``fp32_groups_gradients_flat``, taken just before each
    OptimizerStep); and this rank's parameters after the steps."""
    from deepspeed.runtime.pipe import schedule as ds

    pp, m = cfg["pp"], cfg["m"]
    engine = make_engine(pp, m, "bf16", accum=cfg["accum"])
    if not cfg.get("stock"):
        sched, _ = schedule_of(cfg)
        pds.use(engine, sched)
    opt = engine.optimizer
    grads: list[list[float]] = []
    step_fn = engine._INSTRUCTION_MAP[ds.OptimizerStep]

    def snapshot_then_step(eng, *args, **kwargs):
        grads.append(
            torch.cat([g.detach().float() for g in opt.fp32_groups_gradients_flat]).tolist()
        )
        return step_fn(eng, *args, **kwargs)

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, ds.OptimizerStep: snapshot_then_step}
    added: list[list[list[float]]] = [[] for _ in range(STEPS)]
    update = opt.update_hp_grads
    step = 0

    def logged_update(*args, **kwargs):
        lp = [p.grad for g in opt.bf16_groups for p in g]
        if any(g is not None for g in lp):
            added[step].append(torch.cat([g.float().flatten() for g in lp]).tolist())
        return update(*args, **kwargs)

    opt.update_hp_grads = logged_update
    returned = []
    for step in range(STEPS):
        batch = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in data(step, m)]
        returned.append(float(engine.train_batch(iter(batch))))
    params = {n: p.detach().float().flatten().tolist() for n, p in engine.module.named_parameters()}
    return {
        "stage": rank,
        "returned": returned,
        "added": added,
        "grads": grads,
        "accum_dtype": str(opt.fp32_groups_gradients_flat[0].dtype),
        "params": params,
        "dtype": str(next(engine.module.parameters()).dtype),
        "optimizer": type(opt).__name__,
        "trace": [list(t) for t in getattr(engine, "pipec_trace", [])],
        "kind": None if cfg.get("stock") else sched.kind,
        "max_loss_rel_err": 0.0,
        "max_param_rel_err": 0.0,
    }


def run_lines(cfg: dict, rank: int) -> dict:
    """The DeepSpeed lines ``pipec tune`` printed for a plan (``>>> `` Python statements), run
    as written on this rank, with what their comments say the user provides: ``layers`` (one
    LayerSpec per letter of the layout), ``loss_fn`` and, before the ``use`` line, ``engine``
    (``deepspeed.initialize`` of the module the first line built, bf16, the printed
    ``gradient_accumulation_steps``). Then one ``train_batch`` step; returns the split the
    module made and the loss."""
    pp, m, letters = cfg["pp"], cfg["m"], cfg["letters"]
    ns: dict = {
        "pipec": pipec,
        "layers": [LayerSpec(Layer, i) for i in range(letters)],
        "loss_fn": loss_fn,
    }
    for line in cfg["lines"]:
        if "pipec.deepspeed.use(" in line:
            config = {
                "train_batch_size": m * ROWS,
                "train_micro_batch_size_per_gpu": ROWS,
                "gradient_accumulation_steps": m,
                "steps_per_print": 10**9,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"},
                "zero_allow_untested_optimizer": True,
            }
            module = ns["module"]
            opt = torch.optim.SGD(module.parameters(), lr=LR)
            ns["engine"], _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
        exec(line, ns)  # noqa: S102  (the printed line, run as the user would)
    engine = ns["engine"]
    batch = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in data(0, m)]
    loss = float(engine.train_batch(iter(batch)))
    if not torch.isfinite(torch.tensor(loss)):
        raise AssertionError(f"train_batch returned {loss}")
    return {
        "stage": rank,
        "parts": list(ns["module"].parts),
        "local": [ns["module"]._local_start, ns["module"]._local_stop],
        "loss": loss,
        "trace": [list(t) for t in engine.pipec_trace],
        "pp": pp,
        "max_loss_rel_err": 0.0,
        "max_param_rel_err": 0.0,
    }


def run(cfg: dict, rank: int) -> dict:
    if "lines" in cfg:
        return run_lines(cfg, rank)
    if "precision" in cfg:
        return run_precision(cfg, rank)
    if "refuse" in cfg:
        return run_refusals(cfg, rank)
    if cfg.get("eval"):
        return run_eval(cfg, rank)
    return run_train(cfg, rank)


def main() -> None:
    cfg_path, rank, world, _port, out = sys.argv[1:6]
    rank, world = int(rank), int(world)
    with open(cfg_path) as f:
        configs = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    record_each(configs, rank, out, lambda cfg: run(cfg, rank))


if __name__ == "__main__":
    main()
