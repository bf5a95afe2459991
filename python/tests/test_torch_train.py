"""Training on torch's own pipeline runtime with pipec's schedules (CPU, gloo, loopback).

Every kind torch can run, at two sizes (pp=2 with 4 microbatches, pp=4 with 8): pp processes
build a float64 model of one Linear+Tanh per stage, train two SGD steps through
``pipec.torch.build_schedule``, and compare every microbatch loss and every parameter gradient
with the same model run without pipelining. Tolerance: relative error <= 1e-10 (float64; the
pipelined run only sums the microbatch gradients in another order).

All configurations run in one launch of 4 processes (a process group per pipeline size), so
torch is imported once per rank. The launch is killed after LAUNCH_TIMEOUT seconds: a hang
fails the tests, it never blocks CI.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import launch
import pipec

TOL = 1e-10
LAUNCH_TIMEOUT = 420
WORLD = 4

SIZES = {"small": (2, 4), "large": (4, 8)}

# (name, compile kwargs without pp/microbatches)
KINDS = [
    ("gpipe", {"schedule": "gpipe"}),
    ("1f1b", {"schedule": "1f1b"}),
    ("1f1b-combined", {"schedule": "1f1b", "combined": True}),
    ("interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}),
    ("interleaved-1f1b-combined", {"schedule": "interleaved-1f1b", "vpp": 2, "combined": True}),
    ("looped-bfs", {"schedule": "looped-bfs", "vpp": 2}),
    ("zb-h1", {"schedule": "zb-h1"}),
    ("zb-h2", {"schedule": "zb-h2"}),
    ("zb-1p", {"schedule": "zb-1p"}),
    ("zb-v", {"schedule": "zb-v"}),
    ("v-half", {"schedule": "v-half"}),
    ("v-min", {"schedule": "v-min"}),
    ("dualpipe-v", {"schedule": "dualpipe-v"}),
    ("group-interleaved", {"schedule": "group-interleaved", "vpp": 2, "group_size": 2}),
]
# Megatron's P2P modes (waits for batches in flight) at the large size only.
EXTRA = [
    (
        "interleaved-1f1b-unbatched",
        {"schedule": "interleaved-1f1b", "vpp": 2, "megatron_p2p": "unbatched"},
    ),
    (
        "interleaved-1f1b-overlap",
        {"schedule": "interleaved-1f1b", "vpp": 2, "megatron_p2p": "overlap"},
    ),
    ("1f1b-unbatched", {"schedule": "1f1b", "megatron_p2p": "unbatched"}),
]

# Another microbatch order (#38): the k-th microbatch the schedule runs is the caller's
# ORDER[k]; build_schedule renumbers them for torch and the whole batch's chunk i stays the
# caller's microbatch i (its loss at losses[i], its rows at rows i of the output).
ORDER = [2, 0, 3, 1]
ORDERED = [
    ("1f1b-ordered", {"schedule": "1f1b", "microbatch_order": ORDER}, 2, 4),
    ("zb-v-ordered", {"schedule": "zb-v", "microbatch_order": ORDER}, 2, 4),
]

CASES = (
    [(f"{n}-{size}", kw, *SIZES[size]) for n, kw in KINDS for size in SIZES]
    + [(f"{n}-large", kw, *SIZES["large"]) for n, kw in EXTRA]
    + ORDERED
)


EVAL_CASES = [
    ("eval-1f1b", {"schedule": "1f1b"}, 4, 8),
    ("eval-interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}, 2, 4),
    ("eval-zb-v", {"schedule": "zb-v"}, 2, 4),
    ("eval-zb-v-ordered", {"schedule": "zb-v", "microbatch_order": ORDER}, 2, 4),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    configs = [
        {"name": name, "pp": pp, "tol": TOL, "compile": dict(kw, pp=pp, microbatches=m)}
        for name, kw, pp, m in CASES
    ]
    # One configuration loads a saved binary directory: build_schedule(path) and load's checks.
    saved = out / "zb-v-bin"
    pipec.compile("zb-v", 2, 4).save(saved, format="bin")
    configs.append({"name": "zb-v-from-dir", "pp": 2, "tol": TOL, "dir": str(saved)})
    # Forward-only schedules through .eval (outputs compared instead of gradients).
    for name, kw, pp, m in EVAL_CASES:
        configs.append(
            {
                "name": name,
                "pp": pp,
                "tol": TOL,
                "eval": True,
                "compile": dict(kw, pp=pp, microbatches=m, forward_only=True),
            }
        )
    return launch.train_all(configs, WORLD, out, LAUNCH_TIMEOUT)


def check(trained, name: str, pp: int) -> None:
    results = trained[0]
    for res in launch.rank_results(trained, name, pp):
        assert res["max_grad_rel_err"] <= TOL
        assert res["max_loss_rel_err"] <= TOL
    # Every gradient of every stage, and the losses of every microbatch of both steps.
    stages = sorted(s for r in range(pp) for s in results[(name, r)]["stages"])
    assert stages == list(range(len(stages)))
    assert sum(results[(name, r)]["losses_compared"] for r in range(pp)) > 0


@pytest.mark.parametrize("name,kw,pp,m", CASES, ids=[c[0] for c in CASES])
def test_trains_like_the_unpipelined_model(trained, name, kw, pp, m):
    check(trained, name, pp)


def test_build_schedule_from_a_saved_directory(trained):
    check(trained, "zb-v-from-dir", 2)


@pytest.mark.parametrize("name,pp", [(c[0], c[2]) for c in EVAL_CASES])
def test_forward_only_schedules_evaluate_like_the_unpipelined_model(trained, name, pp):
    check(trained, name, pp)


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs
