"""Every "run it" line ``pipec tune`` prints is a command that works for its plan (issue #40
point 7), run here as written for a few plans per target: a split-backward winner
(DeepSpeed's and the default target's zb-h1), offload winners (torch, Megatron), Megatron's own
schedule, an uneven torchtitan layout and pipec-run.

The lines have three forms (``pipec_compiler::target::how_to_run``): ``$ `` a shell command,
``>>> `` a Python statement, anything else a statement of what a command cannot do and how
to do it. Here:

- every ``$`` line runs as a subprocess (the ``pipec`` and ``pipec-run`` the workspace built:
  ``PIPEC_BIN_DIR`` or ``target/debug``) and exits 0; none asks for ``--backend cuda`` (a GPU
  line is a statement, by the rule checked in ``test_every_line_has_a_form``);
- torch's ``>>>`` lines run for every rank (torch's fake process group, real
  ``PipelineStage``s built from the ``stage_ids`` the first line gives);
- Megatron's run in-process (megatron-core's schedule construction);
- DeepSpeed's run on 2 gloo processes (``ds_worker.py``): the ``pipeline_module`` line builds
  the ``PipelineModule`` split as the plan, a bf16 engine (BF16_Optimizer) runs the ``use``
  line and trains a step of the split-backward plan;
- torchtitan's statement lines (its flags, ``module_fqns_per_model_part``) are checked against
  torchtitan's own source: every flag is a field of its ``ParallelismConfig``, and the module
  lists use the names its ``_generate_llm_fqn_per_model_part`` gives, the layout's counts per
  stage. Megatron-LM's launch flags (Megatron-LM is not installed; megatron-core's parser of
  the layout flag is checked in test_tune_target.py) are the statement lines not run.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import launch
import pipec
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("PIPEC_BIN_DIR", REPO / "target" / "debug"))
HAVE_BIN = (BIN / "pipec").is_file() and (BIN / "pipec-run").is_file()
TT = os.environ.get("PIPEC_TORCHTITAN_PATH")
HAVE_TT = bool(TT and os.path.isdir(TT))
LAUNCH_TIMEOUT = 300

HEAVY_ENDS = "t.f=1,t.b=1,t.w=1,E.f=1,L.f=2"
SMALL = {"pp": 2, "microbatches": 4, "num_layers": 4}
PLANS = {
    "deepspeed-split": dict(SMALL, target="deepspeed"),
    "default-split": dict(SMALL),
    "torch-offload": dict(SMALL, memory_limit=3, target="torch"),
    "megatron-offload": dict(SMALL, memory_limit=3, target="megatron"),
    "megatron-own": dict(SMALL, kinds=["1f1b"], target="megatron"),
    "torchtitan-uneven": dict(SMALL, num_layers=6, cost=HEAVY_ENDS, target="torchtitan"),
    "pipec-run": dict(SMALL, target="pipec-run"),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """{name: (directory, schedule, {target: lines})}."""
    root = tmp_path_factory.mktemp("run-lines")
    out = {}
    for name, kw in PLANS.items():
        d = root / name
        s, report = pipec.tune(**kw, out=d)
        s.save(d)
        out[name] = (d, s, report["run"])
    return out


def shell(line: str) -> bool:
    return line.startswith("$ ")


def python(line: str) -> bool:
    return line.startswith(">>> ")


def test_the_plans_are_the_ones_meant(plans):
    """The cases the issue names: a split-backward winner for DeepSpeed and the default, an
    offload winner for torch and Megatron, Megatron's own schedule."""
    kinds = {n: s.kind for n, (_, s, _) in plans.items()}
    assert kinds["deepspeed-split"] == kinds["default-split"] == "zb-h1", kinds
    for name in ("torch-offload", "megatron-offload"):
        ops = {i["op"] for r in range(2) for i in plans[name][1].instructions(r)}
        assert "offload" in ops, (name, kinds[name])
    assert plans["megatron-own"][2]["megatron"][0].startswith("Megatron's own schedule")
    counts = {len(st.decoder_layers) for st in _stage_layers(plans["torchtitan-uneven"][0])}
    assert len(counts) > 1, counts  # an uneven split, which torchtitan's default would not make


def test_every_line_has_a_form(plans):
    """A command is marked (``$``/``>>>``); an unmarked line is no command (it does not start
    with a program's name); a GPU line is never a ``$`` command (this test runs them on any
    machine); torch's CSV command is printed exactly where the export accepts the plan."""
    for name, (_, s, run) in plans.items():
        assert run, name
        for target, lines in run.items():
            for line in lines:
                if shell(line):
                    assert "--backend cuda" not in line, line
                    assert shlex.split(line[2:], comments=True)[0] in ("pipec", "pipec-run")
                elif not python(line):
                    assert not re.match(r"(pipec|pipec-run|python|torchrun|deepspeed)\b", line)
            if target == "torch":
                has_csv = any(shell(x) and "torch-csv" in x for x in lines)
                offload = any(
                    i["op"] in ("offload", "reload", "recompute")
                    for r in range(s.pp)
                    for i in s.instructions(r)
                )
                assert has_csv == (not offload), (name, lines)
                if offload:
                    assert any("no CSV for this plan" in x for x in lines), lines
            if target == "pipec-run":
                assert any("synthetic model" in x for x in lines), lines
                assert any("--features cuda" in x for x in lines), lines
            if target in ("megatron", "deepspeed") and not lines[0].startswith("Megatron's own"):
                assert any(x.startswith("not run with:") for x in lines), lines


def test_shell_lines_run(plans, tmp_path):
    if not HAVE_BIN:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: no pipec and pipec-run in {BIN} (PIPEC_BIN_DIR)")
        pytest.skip(f"no pipec and pipec-run in {BIN} (cargo build -p pipec-cli)")
    ran = 0
    for name, (_, _, run) in plans.items():
        for lines in run.values():
            for line in filter(shell, lines):
                argv = shlex.split(line[2:], comments=True)
                argv[0] = str(BIN / argv[0])
                p = subprocess.run(
                    argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
                )
                assert p.returncode == 0, (name, line, p.stdout[-2000:], p.stderr[-2000:])
                ran += 1
    # default-split: torch's CSV, torchtitan's, pipec-run; torchtitan-uneven; pipec-run.
    assert ran >= 5, ran


def _stage_layers(d):
    """What each stage holds (decoder layers, embedding, head), from the plan's layout."""
    return importlib.import_module("pipec.megatron").stage_layers(d)


def _fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@pytest.mark.parametrize("name", ["default-split", "torch-offload"])
def test_torch_lines_run(plans, name):
    from torch.distributed.pipelining import PipelineStage

    _, s, run = plans[name]
    lines = [x[4:] for x in run["torch"] if python(x)]
    assert len(lines) == 2, run["torch"]
    for rank in range(s.pp):
        dist.init_process_group("fake", rank=rank, world_size=s.pp, store=_fake_store())
        try:
            ns = {"pipec": pipec, "rank": rank, "loss_fn": lambda o, t: ((o - t) ** 2).mean()}
            importlib.import_module("pipec.torch")  # the lines name pipec.torch
            exec(lines[0], ns)  # noqa: S102
            ns["stages"] = [
                PipelineStage(torch.nn.Linear(2, 2), i, s.num_stages, torch.device("cpu"))
                for i in ns["stage_ids"]
            ]
            exec(lines[1], ns)  # noqa: S102
            assert ns["schedule"].stage_index_to_group_rank == dict(enumerate(s.stage_to_rank))
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("name", ["megatron-offload", "megatron-own", "default-split"])
def test_megatron_lines_run(plans, name):
    pytest.importorskip("megatron.core")
    importlib.import_module("pipec.megatron")  # the lines name pipec.megatron
    _, _, run = plans[name]
    lines = [x[4:] for x in run["megatron"] if python(x)]
    if name == "megatron-own":
        assert lines == []  # Megatron's own schedule: its flags only
        return
    ns = {"pipec": pipec}
    for line in lines:
        exec(line, ns)  # noqa: S102
    assert ns["forward_backward"].pipec_schedule.num_microbatches == SMALL["microbatches"]


@pytest.mark.parametrize("name", ["torchtitan-uneven", "default-split"])
def test_torchtitan_lines_name_what_torchtitan_has(plans, name):
    d, s, run = plans[name]
    lines = run["torchtitan"]
    text = " ".join(lines)
    parts_line = next(x for x in lines if "module_fqns_per_model_part =" in x)
    m = re.search(r"module_fqns_per_model_part = (\[\[.*?\]\])", parts_line)
    parts = ast.literal_eval(m.group(1))
    stages = _stage_layers(d)
    assert len(parts) == len(stages) == s.num_stages
    for names, stage in zip(parts, stages):
        want = [f"layers.{i}" for i in stage.decoder_layers]
        assert [n for n in names if n.startswith("layers.")] == want, (names, stage)
        assert ("tok_embeddings" in names) == stage.pre_process
        assert ("lm_head" in names) == stage.post_process
    flat = [n for p in parts for n in p]
    layers = [n for n in flat if n.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(len(layers))]
    if not HAVE_TT:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: torchtitan is not installed (PIPEC_TORCHTITAN_PATH)")
        return
    sys.path.insert(0, TT)
    try:
        from torchtitan.config.configs import ParallelismConfig
        from torchtitan.distributed import pipeline_parallel as tpp
    finally:
        sys.path.remove(TT)
    fields = set(ParallelismConfig.__dataclass_fields__)
    for flag in re.findall(r"--parallelism\.(\w+)", text):
        assert flag in fields, flag
    assert "module_fqns_per_model_part" in fields
    # torchtitan's own names for a model of this many layers, split its way: the same names.
    own = tpp._generate_llm_fqn_per_model_part(s.num_stages, len(layers), 1, 1)
    assert sorted(flat) == sorted(n for p in own for n in p)


def test_deepspeed_lines_run(plans, tmp_path):
    """DeepSpeed's lines for the split-backward winners (its own target and the default), on
    2 gloo processes: the module split as the plan, a bf16 engine, one step of zb-h1."""
    pytest.importorskip("deepspeed")
    import pipec.deepspeed as pds

    configs = []
    for name in ("deepspeed-split", "default-split"):
        d, s, run = plans[name]
        configs.append(
            {
                "name": name,
                "pp": s.pp,
                "m": s.num_microbatches,
                "letters": pds.parts(d)[-1],
                "lines": [x[4:] for x in run["deepspeed"] if python(x)],
            }
        )
    results, ok, logs = launch.train_all(
        configs, 2, tmp_path / "ds", LAUNCH_TIMEOUT, worker="ds_worker.py"
    )
    for name in ("deepspeed-split", "default-split"):
        d, s, _ = plans[name]
        want = pds.parts(d)
        for r in range(2):
            res = results.get((name, r))
            assert res is not None and res["ok"], (name, r, res, logs)
            assert res["parts"] == want
            assert res["local"] == want[r : r + 2]
        split = [t for r in range(2) for t in results[(name, r)]["trace"] if t[0] == "bwd_W"]
        assert split, "the plan split its backward on the bf16 engine"
    assert ok, logs
