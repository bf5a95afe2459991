"""One rank of the multi-process training tests (launched by ``launch.py``, gloo on loopback).

For every configuration in the JSON file it is given, the ranks of the configuration's
pipeline group build a small float64 model cut into the schedule's stages, train two SGD steps
with ``pipec.torch.build_schedule``, and compare every microbatch loss and every parameter
gradient with the same model run without pipelining on this rank. One JSON line per
configuration goes to ``<out>/rank-<r>.jsonl`` as soon as it is done, so a hang loses only the
configurations after it.

Usage: python torch_worker.py CONFIGS.json RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import copy
import sys

import pipec
import pipec.torch as pt
import torch
import torch.distributed as dist
from launch import record_each, start_worker
from torch.distributed.pipelining import PipelineStage

DIM = 6
ROWS = 2  # rows per microbatch
STEPS = 2
LR = 0.05


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def make_layers(num_stages: int, deep: bool = False) -> list[torch.nn.Module]:
    """One Linear+Tanh per stage; ``deep``: two, so a stage keeps activations of its own for
    the backward beyond its input and output (what memory instructions move)."""
    torch.manual_seed(1234)
    layers = 2 if deep else 1
    return [
        torch.nn.Sequential(
            *(
                m
                for _ in range(layers)
                for m in (torch.nn.Linear(DIM, DIM, dtype=torch.float64), torch.nn.Tanh())
            )
        )
        for _ in range(num_stages)
    ]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


class Tally:
    """The losses and gradients compared with the unpipelined reference: each within ``tol``
    (relative) or an AssertionError naming it, with their counts and largest errors."""

    def __init__(self, tol: float) -> None:
        self.tol = tol
        self.n_losses = self.n_grads = 0
        self.loss_err = self.grad_err = 0.0

    def losses(self, step: int, losses: list, ref_losses: list, m: int) -> None:
        if len(losses) != m:
            raise AssertionError(f"step {step}: {len(losses)} losses for {m} microbatches")
        for mb, (a, b) in enumerate(zip(losses, ref_losses)):
            e = rel_err(a.detach(), b)
            self.loss_err = max(self.loss_err, e)
            self.n_losses += 1
            if not e <= self.tol:
                raise AssertionError(f"step {step} microbatch {mb}: loss {a} != {b}")

    def grads(self, step: int, mine, layers, ref) -> None:
        for i in mine:
            for (name, p), q in zip(layers[i].named_parameters(), ref[i].parameters()):
                if p.grad is None:
                    raise AssertionError(f"step {step}: stage {i} {name} has no gradient")
                e = rel_err(p.grad, q.grad)
                self.grad_err = max(self.grad_err, e)
                self.n_grads += 1
                if not e <= self.tol:
                    raise AssertionError(
                        f"step {step}: stage {i} {name} gradient differs (relative {e:.3g})"
                    )

    def report(self) -> dict:
        return {
            "losses_compared": self.n_losses,
            "grads_compared": self.n_grads,
            "max_loss_rel_err": self.loss_err,
            "max_grad_rel_err": self.grad_err,
        }


def torchtitan_schedule(cfg: dict, sched, layers, rank: int, group):
    """The torchtitan recipe: torchtitan places the stages (by the class named in
    ``pipeline_parallel_schedule``) and loads pipec's compute-only CSV itself. torchtitan 0.3.0
    takes the microbatch count as ``local_batch_size / pipeline_parallel_microbatch_size``;
    its 2026 main branch names the count itself ``num_pp_microbatches``."""
    import dataclasses

    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import pipeline_parallel as tt

    s_count, m = sched.num_stages, sched.num_microbatches
    placed = list(
        tt._get_pp_rank_to_stage_indices_mapping(rank, sched.pp, cfg["torchtitan"], s_count)
    )
    if sorted(placed) != pt.stage_indices(sched, rank):
        raise AssertionError(
            f"torchtitan places stages {placed}, pipec {pt.stage_indices(sched, rank)}"
        )
    stages = [
        PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=group) for i in placed
    ]
    fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    count = "num_pp_microbatches" in fields
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=sched.pp,
        pipeline_parallel_schedule=cfg["torchtitan"],
        pipeline_parallel_schedule_csv=cfg["csv"],
        **({"num_pp_microbatches": m} if count else {"pipeline_parallel_microbatch_size": ROWS}),
    )
    runtime = tt._build_pipeline_schedule(
        parallelism=parallelism,
        local_batch_size=m * ROWS,
        stages=stages,
        loss_fn=lambda out, target: (loss_fn(out, target), None),
    )
    if runtime._n_microbatches != m:
        raise AssertionError(f"torchtitan made {runtime._n_microbatches} microbatches, not {m}")
    field = "num_pp_microbatches" if count else "pipeline_parallel_microbatch_size"
    return stages, runtime, field


def automodel_schedule(cfg: dict, sched, layers, rank: int, group):
    """The NeMo AutoModel recipe, with AutoModel's own code: its placement
    (``stage_ids_this_rank``, V-shaped only when ``pp_schedule`` names ``ZBVZeroBubble``, the
    rule of ``split_model_into_stages``) and its ``build_pipeline_schedule``, which loads
    ``pp_schedule_csv`` into torch's ``_PipelineScheduleRuntime`` (``scale_grads=False``:
    AutoModel divides the gradients afterwards with ``scale_grads_by_divisor``)."""
    import inspect

    from nemo_automodel.components.distributed.pipelining import functional as am
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, get_schedule_class

    rule = 'style = "v" if schedule_class == ScheduleZBVZeroBubble else "loop"'
    if rule not in inspect.getsource(am.split_model_into_stages):
        raise AssertionError(f"AutoModel's split_model_into_stages no longer says `{rule}`")
    s_count, m = sched.num_stages, sched.num_microbatches
    style = "v" if get_schedule_class(cfg["automodel"]) == ScheduleZBVZeroBubble else "loop"
    placed = list(am.stage_ids_this_rank(rank, sched.pp, s_count, style=style))
    if sorted(placed) != pt.stage_indices(sched, rank):
        raise AssertionError(
            f"AutoModel places stages {placed}, pipec {pt.stage_indices(sched, rank)}"
        )
    stages = [
        PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=group) for i in placed
    ]
    runtime = am.build_pipeline_schedule(
        pipeline_parallel_schedule_csv=cfg["csv"],
        pipeline_parallel_schedule=cfg["automodel"],
        microbatch_size=ROWS,
        local_batch_size=m * ROWS,
        stages=stages,
        loss_fn=loss_fn,
        scale_grads=False,
    )
    return stages, runtime, lambda: am.scale_grads_by_divisor(stages, m)


class Receives:
    """What torch's runtime receives into, seen from outside pipec: the storage of every
    receive's tensor (each stage's ``get_fwd_recv_ops``/``get_bwd_recv_ops``, wrapped last, so
    around pipec's own wrappers), per step, and how often torch's own receive allocation
    (``_RecvInfo.allocate_buffer``, the class's method) runs."""

    def __init__(self, stages) -> None:
        from torch.distributed.pipelining._recv_buffers import _RecvInfo

        self.steps: list[list[int]] = []
        self.torch_allocs = 0
        self._cls, self._orig = _RecvInfo, _RecvInfo.allocate_buffer

        def allocate_buffer(info, device):
            self.torch_allocs += 1
            return self._orig(info, device)

        _RecvInfo.allocate_buffer = allocate_buffer
        for st in stages:
            for name in ("get_fwd_recv_ops", "get_bwd_recv_ops"):
                setattr(st, name, self._watch(getattr(st, name)))

    def _watch(self, orig):
        def recv_ops(mb):
            ops = orig(mb)
            self.steps[-1].extend(op.tensor.untyped_storage().data_ptr() for op in ops)
            return ops

        return recv_ops

    def begin_step(self) -> None:
        self.steps.append([])

    def close(self, runtime) -> dict:
        self._cls.allocate_buffer = self._orig
        pool = runtime.pipec_slots
        return {
            "recv_storages": self.steps,
            "torch_recv_allocs": self.torch_allocs,
            "pool": None
            if pool is None
            else {
                "sizes": {str(k): v for k, v in pool.sizes.items()},
                "storages": sorted(t.untyped_storage().data_ptr() for t in pool.buffers.values()),
            },
        }


def run_eval(cfg: dict, rank: int, group) -> dict:
    """A forward-only pipec schedule through ``.eval``: the last stage's merged output equals
    the unpipelined model's."""
    sched = pipec.compile(**cfg["compile"])
    s_count, m = sched.num_stages, sched.num_microbatches
    layers = make_layers(s_count)
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    mine = pt.stage_indices(sched, rank)
    stages = [PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=group) for i in mine]
    runtime = pt.build_schedule(sched, stages, None)
    receives = Receives(stages) if cfg.get("slots") else None
    err, compared = 0.0, 0
    # With a receive recorder, two evaluations (the receive storages of both are reported).
    for seed in (7, 8) if receives is not None else (7,):
        if receives is not None:
            receives.begin_step()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m * ROWS, DIM, dtype=torch.float64, generator=g)
        with torch.no_grad():
            out = runtime.eval(*((x,) if 0 in mine else ()))
            want = ref(x)
        if s_count - 1 in mine:
            err = max(err, rel_err(out, want))
            compared += 1
            if not err <= cfg["tol"]:
                raise AssertionError(f"eval output differs (relative {err:.3g})")
    return {
        "stages": mine,
        "losses_compared": compared,
        "grads_compared": 0,
        "max_loss_rel_err": err,
        "max_grad_rel_err": 0.0,
        **(receives.close(runtime) if receives is not None else {}),
    }


def run_lengths(cfg: dict, rank: int, group) -> dict:
    """A schedule with microbatch lengths (issue #38): microbatch m is a ``[tokens_m, DIM]``
    tensor of its own length, passed pre-split (``arg_mbs``, ``target_mbs``), and every receive
    is sized from the plan. The loss is the per-token mean over the step (``scale_grads=False``,
    each microbatch's summed loss divided by the step's tokens), so the reference is the same
    model run on each microbatch alone, accumulating the same loss. A plan in another
    microbatch order (``microbatch_order``, or ``tune``'s choice) takes the inputs and returns
    the losses and outputs in the caller's order all the same (``build_schedule`` renumbers
    the microbatches for torch)."""
    if "tune" in cfg:
        sched, _ = pipec.tune(**cfg["tune"])
    else:
        sched = pipec.compile(**cfg["compile"])
    lengths = [sum(x) if isinstance(x, list) else x for x in sched.lengths]
    total = sum(lengths)
    s_count, m = sched.num_stages, sched.num_microbatches

    def token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean(dim=1).sum() / total

    layers = make_layers(s_count)
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    mine = pt.stage_indices(sched, rank)
    stages = [PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=group) for i in mine]
    runtime = pt.build_schedule(sched, stages, token_loss, scale_grads=False)
    receives = Receives(stages) if cfg.get("slots") else None
    opt = torch.optim.SGD([p for i in mine for p in layers[i].parameters()], lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    tally = Tally(cfg["tol"])
    for step in range(STEPS):
        if receives is not None:
            receives.begin_step()
        g = torch.Generator().manual_seed(200 + step)
        xs = [torch.randn(n, DIM, dtype=torch.float64, generator=g) for n in lengths]
        ys = [torch.randn(n, DIM, dtype=torch.float64, generator=g) for n in lengths]
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs = {}
        if 0 in mine:
            kwargs["arg_mbs"] = [(x,) for x in xs]
        if s_count - 1 in mine:
            kwargs.update(target_mbs=list(ys), losses=losses)
        out = runtime.step(**kwargs)
        ref_opt.zero_grad()
        ref_losses, ref_outs = [], []
        for xm, ym in zip(xs, ys):
            ref_outs.append(ref(xm))
            loss = token_loss(ref_outs[-1], ym)
            ref_losses.append(loss.detach())
            loss.backward()
        if s_count - 1 in mine:
            e = rel_err(out.detach(), torch.cat(ref_outs).detach())
            if not e <= cfg["tol"]:
                raise AssertionError(f"step {step}: the outputs differ (relative {e:.3g})")
            tally.losses(step, losses, ref_losses, m)
        tally.grads(step, mine, layers, ref)
        opt.step()
        ref_opt.step()
    return {
        "stages": mine,
        **tally.report(),
        "kind": sched.kind,
        "relabelled": runtime.pipec_microbatch_order,
        **(receives.close(runtime) if receives is not None else {}),
    }


def run(cfg: dict, rank: int, group) -> dict:
    if cfg.get("eval"):
        return run_eval(cfg, rank, group)
    if cfg.get("lengths"):
        return run_lengths(cfg, rank, group)
    if "dir" in cfg:
        sched = pipec.load(cfg["dir"])
    else:
        sched = pipec.compile(**cfg["compile"])
    s_count, m = sched.num_stages, sched.num_microbatches
    layers = make_layers(s_count, cfg.get("deep", False))
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    mine = pt.stage_indices(sched, rank)
    extra = {}
    after_step = None
    if "torchtitan" in cfg:
        stages, runtime, extra["microbatch_field"] = torchtitan_schedule(
            cfg, sched, layers, rank, group
        )
    elif "automodel" in cfg:
        stages, runtime, after_step = automodel_schedule(cfg, sched, layers, rank, group)
    else:
        stages = [
            PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=group) for i in mine
        ]
        runtime = pt.build_schedule(sched, stages, loss_fn)
        if sched.p2p_groups != "pair":
            # The global ranks of the group each message between this rank's stages and their
            # neighbours goes on, by (source stage, destination stage), and which of those
            # groups are one object (test_torch_p2p_groups checks the layout).
            pairs = [
                (a, b)
                for i in mine
                for a, b in ((i - 1, i), (i, i + 1), (i + 1, i), (i, i - 1))
                if 0 <= min(a, b)
                and max(a, b) < s_count
                and sched.stage_to_rank[a] != sched.stage_to_rank[b]
                and (a < b or not sched.forward_only)
            ]
            of = {p: stages[0]._get_p2p_group(*p) for p in pairs}
            ids = {}
            extra["p2p_groups"] = [
                [a, b, dist.get_process_group_ranks(g), ids.setdefault(id(g), len(ids))]
                for (a, b), g in sorted(of.items())
            ]
    receives = Receives(stages) if cfg.get("slots") else None
    # torchtitan builds its schedule with scale_grads=False: gradients are sums over microbatches.
    scale = m if "torchtitan" not in cfg else 1
    opt = torch.optim.SGD([p for i in mine for p in layers[i].parameters()], lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    tally = Tally(cfg["tol"])
    for step in range(STEPS):
        if receives is not None:
            receives.begin_step()
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(m * ROWS, DIM, dtype=torch.float64, generator=g)
        y = torch.randn(m * ROWS, DIM, dtype=torch.float64, generator=g)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": losses} if s_count - 1 in mine else {}
        runtime.step(*args, **kwargs)
        if after_step is not None:
            after_step()
        # The same model without pipelining: gradients of the mean microbatch loss
        # (torch's scale_grads=True divides the accumulated gradients by M).
        ref_opt.zero_grad()
        ref_losses = []
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = loss_fn(ref(xm), ym)
            ref_losses.append(loss.detach())
            (loss / scale).backward()
        if s_count - 1 in mine:
            tally.losses(step, losses, ref_losses, m)
        tally.grads(step, mine, layers, ref)
        opt.step()
        ref_opt.step()
    if getattr(runtime, "pipec_memory", None) is not None:
        # The last step's trace of the memory instructions (test_torch_memory checks it).
        extra["memory_events"] = [list(e) for e in runtime.pipec_memory.events]
    if receives is not None:
        extra.update(receives.close(runtime))
    return {
        "stages": mine,
        **tally.report(),
        **extra,
    }


def main() -> None:
    configs, rank, _world, out = start_worker(sys.argv[1:6])
    groups = {}
    for pp in sorted({c["pp"] for c in configs}):
        groups[pp] = dist.new_group(list(range(pp)))
    record_each(
        configs,
        rank,
        out,
        lambda cfg: run(cfg, rank, groups[cfg["pp"]]),
        takes_part=lambda cfg: rank < cfg["pp"],
    )


if __name__ == "__main__":
    main()
