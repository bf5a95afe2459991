"""One rank of the FSDP2 x pipeline test (``test_torch_fsdp.py``; launched by ``launch.py``,
gloo on loopback).

World of 4 = pp 2 x dp 2 (``init_device_mesh(("pp", "dp"))``). For every configuration the
ranks build a float64 model of one Linear+Tanh per stage, ``fully_shard`` each stage's
submodule over the dp dimension, train two SGD steps on dp-distinct data, and compare the
losses of their replica, the gradients of both steps and the parameters after them with the
same model run unsharded and unpipelined on this rank over the data of both replicas.

``repair`` says which actions run: ``pipec`` (``build_schedule`` as users call it),
``none`` (the exporter's actions without pipec's repair: what torch would run), ``naive``
(RESHARD + UNSHARD before every I/W that follows a forward of its stage, built here from the
unrepaired actions) or ``torch`` (``schedule`` names torch's own class). FSDP's all-gathers
(``dist.all_gather_single``, which FSDP2's default all-gather calls) are counted per step.

Usage: python fsdp_worker.py CONFIGS.json RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import copy
import sys

import pipec
import pipec.torch as pt
import torch
import torch.distributed as dist
from launch import record_each, start_worker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as ts

DIM = 8
ROWS = 2
STEPS = 2
LR = 0.05
PP = DP = 2

ALL_GATHERS = [0]
_all_gather_single = dist.all_gather_single


def _counting_all_gather(*args, **kwargs):
    ALL_GATHERS[0] += 1
    return _all_gather_single(*args, **kwargs)


dist.all_gather_single = _counting_all_gather


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def naive(line: list, stages: list[int]) -> list:
    """The repair without bookkeeping: re-gather before every I/W after a forward."""
    T = ts._ComputationType
    out, seen = [], set()
    for a in line:
        for sub in a.sub_actions or (a,):
            if sub.computation_type == T.FORWARD:
                seen.add(sub.stage_index)
            if sub.computation_type in (T.BACKWARD_INPUT, T.BACKWARD_WEIGHT) and (
                sub.stage_index in seen
            ):
                out.append(ts._Action(sub.stage_index, T.RESHARD, None))
                out.append(ts._Action(sub.stage_index, T.UNSHARD, None))
        out.append(a)
    return out


def run(cfg: dict, mesh) -> dict:
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    m = cfg["microbatches"]
    repair = cfg["repair"]
    if repair == "torch":
        cls = getattr(ts, cfg["schedule"])
        s_count = 2 * PP
        mine = sorted([pp_rank, 2 * PP - 1 - pp_rank])
    else:
        sched = pipec.compile(cfg["schedule"], PP, m)
        s_count = sched.num_stages
        mine = pt.stage_indices(sched, pp_rank)
    torch.manual_seed(1234)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(DIM, DIM, dtype=torch.float64), torch.nn.Tanh())
        for _ in range(s_count)
    ]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    raf = cfg.get("reshard_after_forward")  # None: FSDP2's default
    for i in mine:
        shard = cfg.get("shard", "stage")
        if shard in ("nested", "inner"):
            # The Linear its own FSDP group. Under FSDP2's default (None) it reshards after
            # forward when it is not a root, i.e. when the stage is fully_shard-ed too, and the
            # stage, a root, does not.
            fully_shard(layers[i][0], mesh=mesh["dp"], reshard_after_forward=raf)
        if shard in ("stage", "nested"):
            fully_shard(layers[i], mesh=mesh["dp"], reshard_after_forward=raf)
    stages = [
        PipelineStage(layers[i], i, s_count, torch.device("cpu"), group=mesh["pp"].get_group())
        for i in mine
    ]
    if repair == "torch":
        runtime = cls(stages, n_microbatches=m, loss_fn=loss_fn)
    elif repair == "refused":
        try:
            pt.build_schedule(sched, stages, loss_fn)
        except pipec.PipecError as e:
            return {"stages": mine, "refused": str(e)}
        raise AssertionError("build_schedule accepted a stage it cannot repair")
    else:
        runtime = pt.build_schedule(sched, stages, loss_fn)
        line = runtime.pipeline_order_with_comms[pp_rank]
        unshards = sum(1 for a in line if a.computation_type == ts._ComputationType.UNSHARD)
        if repair != "pipec":
            plain = pt.actions(sched)[pp_rank]
            runtime.pipeline_order_with_comms[pp_rank] = (
                naive(plain, mine) if repair == "naive" else plain
            )
            unshards = sum(
                1
                for a in runtime.pipeline_order_with_comms[pp_rank]
                if a.computation_type == ts._ComputationType.UNSHARD
            )
    opt = torch.optim.SGD([p for i in mine for p in layers[i].parameters()], lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss_err = grad_err = 0.0
    all_gathers = []
    for step in range(STEPS):
        xs, ys = [], []
        for d in range(DP):
            g = torch.Generator().manual_seed(100 + 10 * step + d)
            xs.append(torch.randn(m * ROWS, DIM, dtype=torch.float64, generator=g))
            ys.append(torch.randn(m * ROWS, DIM, dtype=torch.float64, generator=g))
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        before = ALL_GATHERS[0]
        args = (xs[dp_rank],) if 0 in mine else ()
        kwargs = {"target": ys[dp_rank], "losses": losses} if s_count - 1 in mine else {}
        runtime.step(*args, **kwargs)
        all_gathers.append(ALL_GATHERS[0] - before)
        # The unsharded, unpipelined model over both replicas' data: FSDP averages the
        # replicas' gradients, torch's scale_grads=True the microbatches'.
        ref_opt.zero_grad()
        ref_losses = []
        for d in range(DP):
            for xm, ym in zip(xs[d].chunk(m), ys[d].chunk(m)):
                loss = loss_fn(ref(xm), ym)
                if d == dp_rank:
                    ref_losses.append(loss.detach())
                (loss / (m * DP)).backward()
        if s_count - 1 in mine:
            if len(losses) != m:
                raise AssertionError(f"step {step}: {len(losses)} losses for {m} microbatches")
            for a, b in zip(losses, ref_losses):
                loss_err = max(loss_err, rel_err(a.detach(), b))
        for i in mine:
            for p, q in zip(layers[i].parameters(), ref[i].parameters()):
                grad_err = max(grad_err, 1.0 if p.grad is None else rel_err(full(p.grad), q.grad))
        opt.step()
        ref_opt.step()
    param_err = max(
        rel_err(full(p), q.detach())
        for i in mine
        for p, q in zip(layers[i].parameters(), ref[i].parameters())
    )
    return {
        "stages": mine,
        "loss_err": loss_err,
        "grad_err": grad_err,
        "param_err": param_err,
        "all_gathers": all_gathers,
        "unshard_actions": None if repair == "torch" else unshards,
    }


def main() -> None:
    configs, rank, _world, out = start_worker(sys.argv[1:6])
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    record_each(configs, rank, out, lambda cfg: run(cfg, mesh))


if __name__ == "__main__":
    main()
