"""The torchtitan recipe, run on CPU: torchtitan 0.3.0's own schedule builder
(``_build_pipeline_schedule`` with ``pipeline_parallel_schedule_csv``) and its own stage
placement (``_get_pp_rank_to_stage_indices_mapping``) load pipec's compute-only CSV and train
two steps; losses and gradients equal the unpipelined float64 model (relative 1e-10).

torchtitan is installed by test.sh without its dependencies (datasets, wandb, ... are not
needed by the schedule builder) into target/py312-torchtitan, which PIPEC_TORCHTITAN_PATH
names; without it these tests are skipped.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

import launch
import pipec

TT = os.environ.get("PIPEC_TORCHTITAN_PATH")
pytestmark = pytest.mark.skipif(
    not TT or not os.path.isdir(TT), reason="torchtitan not installed (PIPEC_TORCHTITAN_PATH)"
)

TOL = 1e-10
# (pipec kind and options, the torchtitan schedule class that places its stages)
CASES = [
    ("1f1b", {"schedule": "1f1b"}, "1F1B"),
    ("zb-1p", {"schedule": "zb-1p"}, "1F1B"),
    ("interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}, "Interleaved1F1B"),
    ("zb-v", {"schedule": "zb-v"}, "ZBVZeroBubble"),
    ("dualpipe-v", {"schedule": "dualpipe-v"}, "DualPipeV"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchtitan")
    configs = []
    for name, kw, cls in CASES:
        sched = pipec.compile(pp=2, microbatches=4, **kw)
        csv = out / f"{name}.csv"
        csv.write_text(sched.to_torch_csv(compute_only=True))
        configs.append(
            {
                "name": name,
                "pp": 2,
                "tol": TOL,
                "compile": dict(kw, pp=2, microbatches=4),
                "torchtitan": cls,
                "csv": str(csv),
            }
        )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = TT + (os.pathsep + old if old else "")
    try:
        return launch.train_all(configs, 2, out, 300)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.mark.parametrize("name,kw,cls", CASES, ids=[c[0] for c in CASES])
def test_torchtitan_trains_with_a_pipec_csv(trained, name, kw, cls):
    results, _, logs = trained
    for r in range(2):
        res = results.get((name, r))
        if res is None:
            pytest.fail(f"{name}: rank {r} reported nothing (hang or crash)\n{logs}")
        if not res["ok"]:
            pytest.fail(f"{name}: rank {r}: {res['error']}\n{logs}")
        assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL
