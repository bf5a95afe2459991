"""The NeMo AutoModel recipe, run on CPU with AutoModel's own code: nemo_automodel 0.7.0's
placement (``stage_ids_this_rank`` with the style ``split_model_into_stages`` derives from
``pp_schedule``: V-shaped only for ``ZBVZeroBubble``) and its ``build_pipeline_schedule``,
which loads pipec's compute-only CSV (``pp_schedule_csv``) into torch's runtime; two training
steps with AutoModel's ``scale_grads_by_divisor`` afterwards, losses and gradients equal to the
unpipelined float64 model (relative 1e-10).

nemo_automodel is installed by test.sh without its dependencies (transformers, datasets, ...
are not needed by the schedule builder) into target/py312-automodel, which
PIPEC_AUTOMODEL_PATH names; without it these tests are skipped, except under CI=true, where
they fail.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")

import launch
import pipec
import pipec.torch as pt

AM = os.environ.get("PIPEC_AUTOMODEL_PATH")
HAVE = bool(AM) and os.path.isdir(AM)
if not HAVE and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true: NeMo AutoModel is not installed (PIPEC_AUTOMODEL_PATH)")
pytestmark = pytest.mark.skipif(
    not HAVE, reason="NeMo AutoModel not installed (PIPEC_AUTOMODEL_PATH)"
)

TOL = 1e-10
# (pipec kind and options, AutoModel's pp_schedule: the name that gives pipec's placement)
CASES = [
    ("1f1b", {"schedule": "1f1b"}, "1F1B"),
    ("zb-h1", {"schedule": "zb-h1"}, "1F1B"),
    ("interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}, "Interleaved1F1B"),
    ("zb-v", {"schedule": "zb-v"}, "ZBVZeroBubble"),
    # V-shaped too, but AutoModel places DualPipeV's stages looped: name ZBVZeroBubble.
    ("dualpipe-v", {"schedule": "dualpipe-v"}, "ZBVZeroBubble"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return launch.train_csv_recipes(
        CASES, "automodel", AM, tmp_path_factory.mktemp("automodel"), TOL
    )


@pytest.mark.parametrize("name,kw,cls", CASES, ids=[c[0] for c in CASES])
def test_automodel_trains_with_a_pipec_csv(trained, name, kw, cls):
    for res in launch.rank_results(trained, name):
        assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL
        assert res["grads_compared"] > 0


def test_dualpipe_v_under_its_own_name_is_misplaced_by_automodel():
    """Why the table says ZBVZeroBubble for dualpipe-v: AutoModel's placement for the name
    DualPipeV is looped, not pipec's V."""
    sys.path.insert(0, AM)
    try:
        from nemo_automodel.components.distributed.pipelining import functional as am
    finally:
        sys.path.remove(AM)
    s = pipec.compile("dualpipe-v", 4, 8)
    loop = [list(am.stage_ids_this_rank(r, 4, 8, style="loop")) for r in range(4)]
    v = [sorted(am.stage_ids_this_rank(r, 4, 8, style="v")) for r in range(4)]
    assert v == [pt.stage_indices(s, r) for r in range(4)]
    assert loop != [pt.stage_indices(s, r) for r in range(4)]


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs
