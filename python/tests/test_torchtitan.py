"""The torchtitan recipe, run on CPU: torchtitan 0.3.0's own schedule builder
(``_build_pipeline_schedule`` with ``pipeline_parallel_schedule_csv``) and its own stage
placement (``_get_pp_rank_to_stage_indices_mapping``) load pipec's compute-only CSV and train
two steps; losses and gradients equal the unpipelined float64 model (relative 1e-10).

torchtitan is installed by test.sh without its dependencies (datasets, wandb, ... are not
needed by the schedule builder) into target/py312-torchtitan, which PIPEC_TORCHTITAN_PATH
names; without it these tests are skipped (under CI=true they fail).

The microbatch option: torchtitan 0.3.0 (the PyPI release tested here) takes
``pipeline_parallel_microbatch_size`` (rows per microbatch); torchtitan's main branch replaced
it in 2026 with ``num_pp_microbatches`` (the count). The worker uses whichever the installed
``ParallelismConfig`` has and reports it; docs/torch.md must name the one of the tested version.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")

import launch

TT = os.environ.get("PIPEC_TORCHTITAN_PATH")
HAVE = bool(TT) and os.path.isdir(TT)
if not HAVE and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true: torchtitan is not installed (PIPEC_TORCHTITAN_PATH)")
pytestmark = pytest.mark.skipif(not HAVE, reason="torchtitan not installed (PIPEC_TORCHTITAN_PATH)")

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
    return launch.train_csv_recipes(
        CASES, "torchtitan", TT, tmp_path_factory.mktemp("torchtitan"), TOL
    )


@pytest.mark.parametrize("name,kw,cls", CASES, ids=[c[0] for c in CASES])
def test_torchtitan_trains_with_a_pipec_csv(trained, name, kw, cls):
    for res in launch.rank_results(trained, name):
        assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL


def test_the_docs_name_the_microbatch_option_of_the_tested_torchtitan(trained):
    from importlib.metadata import distributions
    from pathlib import Path

    (dist,) = [d for d in distributions(path=[TT]) if d.metadata["Name"] == "torchtitan"]
    results, _, _ = trained
    used = {results[(name, r)]["microbatch_field"] for name, _, _ in CASES for r in range(2)}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "torch.md").read_text()
    assert used == {"pipeline_parallel_microbatch_size"}, (dist.version, used)
    assert dist.version == "0.3.0"
    assert f"torchtitan {dist.version}" in doc
    for option in ("--parallelism.pipeline_parallel_microbatch_size", "num_pp_microbatches"):
        assert option in doc
