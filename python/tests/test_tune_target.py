"""``pipec.tune(..., target=...)``: the winner for each target is accepted by that target's own
adapter, called for real, and the Rust rule (``Schedule.refusal``) agrees with the adapters.

- torch: ``pipec.torch.stage_indices`` and ``build_schedule`` for every rank (torch's
  ``_PipelineScheduleRuntime`` and its ``_prepare_schedule_with_comms`` on real
  ``PipelineStage`` objects, in one process over torch's fake process group), then two
  training steps on 2-4 gloo processes, losses and gradients equal to the unpipelined model;
- megatron: ``stage_indices``, ``stage_layers`` and ``forward_backward_func`` construction (its
  refusals and data-order check), and for loop placements megatron-core's own layout parser
  (``PipelineParallelLayerLayout``) given the reported ``--pipeline-model-parallel-layout``
  places the same layers on the same rank and chunk as the schedule;
- torchtitan: the compute-only CSV parsed by torch (``_Action.from_str``), lowered by torch's
  ``_add_send_recv`` and run through torch's ``_simulate_comms_compute`` with the placement of
  the reported class (torchtitan's own ``_get_pp_rank_to_stage_indices_mapping`` where
  torchtitan is installed), and trained with torchtitan's schedule builder;
- pipec-run: ``pipec.load`` (every check ``pipec-run`` makes, the verifier included).
"""

from __future__ import annotations

import os
import re

import pytest

torch = pytest.importorskip("torch")

import launch
import pipec
import pipec.megatron as pm
import pipec.torch as pt
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as ts

UNEVEN = "f=1,b=1.5,w=0.7,E.f=2,E.b=2,E.w=1,L.f=3,L.b=3,L.w=1"
HEAVY_ENDS = "t.f=1,t.b=1,t.w=1,E.f=1,L.f=2"
SHAPES = {
    "pp2-heavy-ends": {"pp": 2, "microbatches": 8, "num_layers": 6, "cost": HEAVY_ENDS},
    "pp2-heavy-ends-limit6": {
        "pp": 2,
        "microbatches": 8,
        "num_layers": 6,
        "cost": HEAVY_ENDS,
        "memory_limit": 6,
    },
    "pp4-uniform": {"pp": 4, "microbatches": 8, "num_layers": 8, "cost": "f=1,b=1,w=1"},
    "pp4-uneven": {"pp": 4, "microbatches": 16, "num_layers": 14, "cost": UNEVEN},
    "pp4-uneven-limit8": {
        "pp": 4,
        "microbatches": 16,
        "num_layers": 14,
        "cost": UNEVEN,
        "memory_limit": 8,
    },
}
TARGETS = ["megatron", "torch", "torchtitan", "pipec-run", "any", None]
TT = os.environ.get("PIPEC_TORCHTITAN_PATH")
HAVE_TT = bool(TT and os.path.isdir(TT))
TOL = 1e-10


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """{(shape, target): (directory, report)} for every shape and target."""
    root = tmp_path_factory.mktemp("tune-target")
    out = {}
    for name, kw in SHAPES.items():
        for target in TARGETS:
            d = root / f"{name}-{target or 'default'}"
            s, report = pipec.tune(**kw, target=target, out=d)
            s.save(d)
            out[(name, target)] = (d, report)
    return out


def cases():
    return [(n, t) for n in SHAPES for t in TARGETS]


def ids():
    return [f"{n}-{t or 'default'}" for n, t in cases()]


def runs_on(target: str | None, framework: str) -> bool:
    """Whether ``framework``'s adapter must accept the winner of ``target``."""
    return target is None or target == framework


# ------------------------------------------------------------------ the adapters, constructed


def torch_accepts(d) -> str | None:
    """Build every rank's torch schedule with ``pipec.torch.build_schedule`` on real
    PipelineStages (fake process group, one process); the refusal's message, or None."""
    s = pipec.load(d)
    try:
        for rank in range(s.pp):
            dist.init_process_group("fake", rank=rank, world_size=s.pp, store=_fake_store())
            try:
                mine = pt.stage_indices(s, rank)
                stages = [
                    PipelineStage(torch.nn.Linear(2, 2), i, s.num_stages, torch.device("cpu"))
                    for i in mine
                ]
                runtime = pt.build_schedule(d, stages, lambda o, t: ((o - t) ** 2).mean())
                assert runtime.stage_index_to_group_rank == dict(enumerate(s.stage_to_rank))
            finally:
                dist.destroy_process_group()
    except pipec.PipecError as e:
        return str(e)
    return None


def _fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def megatron_accepts(d) -> str | None:
    s = pipec.load(d)
    try:
        fb = pm.forward_backward_func(d)
        layers = pm.stage_layers(d)
        for rank in range(s.pp):
            pm.stage_indices(s, rank)
    except pipec.PipecError as e:
        return str(e)
    assert fb.pipec_schedule.num_stages == len(layers)
    return None


@pytest.mark.parametrize("name,target", cases(), ids=ids())
def test_winner_runs_on_its_adapters(tuned, name, target):
    d, report = tuned[(name, target)]
    s = pipec.load(d)  # pipec-run's checks: versions, hashes, the verifier
    assert report["schedule"]["placement"] in ("loop", "v", "bidirectional")
    assert len(report["peak_memory"]) == s.pp
    # The adapters' verdicts equal the Rust rule's, whichever way they go.
    for framework, accepts in (("torch", torch_accepts), ("megatron", megatron_accepts)):
        refused = accepts(d)
        assert (refused is None) == (s.refusal(framework) is None), (framework, refused)
        assert (framework in report["runs_on"]) == (refused is None)
        if runs_on(target, framework):
            assert refused is None, f"{framework} refuses the {target} winner: {refused}"
    for framework in ("torchtitan", "deepspeed", "pipec-run"):
        if runs_on(target, framework):
            assert s.refusal(framework) is None
            assert framework in report["runs_on"]
    if target is not None:
        assert report["target"] == target


def test_the_issues_example_is_refused_by_torch_only_under_any(tuned):
    """``any`` picks DualPipe's two directions, which both adapters refuse; every named
    framework target and the default give a plan their adapters run."""
    d, report = tuned[("pp2-heavy-ends", "any")]
    assert report["schedule"]["placement"] == "bidirectional"
    with pytest.raises(pipec.TorchExportError):
        pt.stage_indices(pipec.load(d), 0)
    with pytest.raises(pipec.PipecError):
        pm.forward_backward_func(d)
    for target in ("torch", "megatron", "torchtitan", None):
        d, report = tuned[("pp2-heavy-ends", target)]
        assert report["schedule"]["placement"] != "bidirectional"


# ------------------------------------------------------------------ Megatron's layout flag


def test_megatron_layout_flag_places_loop_winners(tuned):
    """Where the report hands Megatron ``--pipeline-model-parallel-layout``, megatron-core's
    own parser of that flag puts every stage's layers on the rank and chunk where the schedule
    runs them; where it does not (V), the report says to use ``stage_layers``."""
    layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    checked = 0
    for (_name, target), (d, report) in tuned.items():
        if not runs_on(target, "megatron"):
            continue
        s = pipec.load(d)
        run = " ".join(report["run"]["megatron"])
        m = re.search(r'--pipeline-model-parallel-layout "([^"]+)"', run)
        if report["schedule"]["placement"] != "loop":
            assert m is None and "pipec.megatron.stage_layers" in run, run
            continue
        assert m, run
        meg = layout_mod.PipelineParallelLayerLayout(m.group(1), s.pp)
        layers = pm.stage_layers(d)
        vpp = s.num_stages // s.pp
        for rank in range(s.pp):
            for chunk, stage in enumerate(pm.stage_indices(s, rank)):
                got = meg.layout[rank][chunk]
                names = [str(x).split(".")[-1].lower() for x in got]
                assert names.count("decoder") == layers[stage].num_layers, (rank, chunk, got)
                assert ("embedding" in names) == layers[stage].pre_process
                assert ("loss" in names) == layers[stage].post_process
                assert stage == chunk * s.pp + rank and chunk < vpp
        checked += 1
    assert checked >= 3


# ------------------------------------------------------------------ torchtitan's path


def _torchtitan_class(report) -> str:
    run = " ".join(report["run"]["torchtitan"])
    return re.search(r"pipeline_parallel_schedule (\w+)", run).group(1)


def _placement(cls: str, pp: int, num_stages: int) -> dict[int, int]:
    """stage -> rank as torchtitan places stages for ``cls``."""
    if HAVE_TT:
        import sys

        sys.path.insert(0, TT)
        from torchtitan.distributed import pipeline_parallel as tt

        return {
            st: r
            for r in range(pp)
            for st in tt._get_pp_rank_to_stage_indices_mapping(r, pp, cls, num_stages)
        }
    if os.environ.get("CI") == "true":
        pytest.fail("torchtitan must be installed under CI (PIPEC_TORCHTITAN_PATH)")
    # torchtitan 0.3.0's rule: "v" style for ZBVZeroBubble and DualPipeV, else "loop".
    if cls in ("ZBVZeroBubble", "DualPipeV"):
        return {st: st if st < pp else 2 * pp - 1 - st for st in range(num_stages)}
    return {st: st % pp for st in range(num_stages)}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("target", ["torchtitan", None])
def test_torchtitan_lowers_the_csv(tuned, name, target):
    d, report = tuned[(name, target)]
    s = pipec.load(d)
    cls = _torchtitan_class(report)
    where = _placement(cls, s.pp, s.num_stages)
    assert where == dict(enumerate(s.stage_to_rank)), (cls, where, s.stage_to_rank)
    rows = [line.split(",") for line in s.to_torch_csv(compute_only=True).splitlines()]
    compute = {
        r: [ts._Action.from_str(c) if c.strip() else None for c in row]
        for r, row in enumerate(rows)
    }
    comms = ts._add_send_recv(compute, lambda st: where[st], s.num_stages)
    ts._simulate_comms_compute(comms, lambda st: where[st], s.num_stages)


# ------------------------------------------------------------------ real training


@pytest.fixture(scope="module")
def trained(tuned, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune-target-train")
    configs = []
    for name in SHAPES:
        for target in ("torch", None):
            d, _ = tuned[(name, target)]
            pp = SHAPES[name]["pp"]
            configs.append({"name": f"{name}-{target}", "pp": pp, "tol": TOL, "dir": str(d)})
        if HAVE_TT:
            d, report = tuned[(name, "torchtitan")]
            s = pipec.load(d)
            csv = out / f"{name}.csv"
            csv.write_text(s.to_torch_csv(compute_only=True))
            configs.append(
                {
                    "name": f"{name}-torchtitan",
                    "pp": s.pp,
                    "tol": TOL,
                    "dir": str(d),
                    "torchtitan": _torchtitan_class(report),
                    "csv": str(csv),
                }
            )
    old = os.environ.get("PYTHONPATH")
    if HAVE_TT:
        os.environ["PYTHONPATH"] = TT + (os.pathsep + old if old else "")
    try:
        return configs, launch.train_all(configs, 4, out, 400)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def test_winners_train_like_the_unpipelined_model(trained):
    """torch's runtime (and torchtitan's builder where installed) trains every torch and
    default winner two steps with the unpipelined model's losses and gradients."""
    configs, (results, _ok, logs) = trained
    if not HAVE_TT and os.environ.get("CI") == "true":
        pytest.fail("torchtitan must be installed under CI (PIPEC_TORCHTITAN_PATH)")
    for cfg in configs:
        for r in range(cfg["pp"]):
            res = results.get((cfg["name"], r))
            assert res is not None, f"{cfg['name']}: rank {r} reported nothing\n{logs}"
            assert res["ok"], f"{cfg['name']}: rank {r}: {res.get('error')}\n{logs}"
            assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL


def test_target_and_kinds_errors_match_the_cli():
    with pytest.raises(pipec.SpecError, match="unknown target `jax`"):
        pipec.tune(2, 4, target="jax")
    with pytest.raises(pipec.SpecError, match="unknown schedule kind `1f1f`"):
        pipec.tune(2, 4, exclude_kinds=["1f1f"])
    with pytest.raises(pipec.SpecError, match="no candidate runs on deepspeed"):
        pipec.tune(4, 8, target="deepspeed", kinds=["zb-v"])
    with pytest.raises(pipec.SpecError, match="kinds must be a list"):
        pipec.tune(4, 8, kinds="zb-v")
    _, report = pipec.tune(4, 8, kinds=["1f1b"], target="megatron")
    assert [c["schedule"] for c in report["candidates"]] == ["1f1b"]
    assert report["run"]["megatron"][0].startswith("Megatron's own schedule")


def test_torch_winner_under_a_limit_is_fitted_with_offload(tuned):
    """Under a memory limit, torch's winner may be fitted with offload (pipec.torch runs
    memory instructions): the limited uneven shape's is, so the training test above trains an
    offloading schedule on torch's runtime."""
    d, report = tuned[("pp4-uneven-limit8", "torch")]
    winner = next(c for c in report["candidates"] if c["fits"] and c["not_runnable"] is None)
    assert sum(winner["levers"]["offloaded"]) > 0, winner
    ops = {i.op for r in range(4) for i in pipec.load(d).instructions(r)}
    assert pipec.Op.offload in ops and pipec.Op.reload in ops
    # The default target (every framework) never pulls a lever.
    _, plain = tuned[("pp4-uneven-limit8", None)]
    assert all("levers" not in c for c in plain["candidates"])
