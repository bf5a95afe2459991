"""Microbatches of different lengths on torch's own pipeline runtime (issue #38), CPU, gloo.

2 ranks build a float64 model of one Linear+Tanh per stage; each microbatch is a
``[tokens, 6]`` tensor of its own length (packed lengths, 3 to 9 tokens), and
``pipec.torch.build_schedule`` sizes every receive from the plan's ``tokens``. Two SGD steps;
every microbatch loss and every parameter gradient is compared with the same model run without
pipelining, microbatch by microbatch (relative error <= 1e-10, float64). Without the resizing
torch would receive every microbatch at the first one's size, and gloo refuses the mismatch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import launch

TOL = 1e-10
LAUNCH_TIMEOUT = 240
PACKED = [[3, 4], [5], [2, 2, 2], [9], [1, 7], [4]]

CASES = [
    ("lengths-1f1b", {"schedule": "1f1b"}),
    ("lengths-interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}),
    ("lengths-zb-v", {"schedule": "zb-v"}),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lengths")
    configs = [
        {
            "name": name,
            "pp": 2,
            "tol": TOL,
            "lengths": True,
            "compile": dict(kw, pp=2, lengths=PACKED),
        }
        for name, kw in CASES
    ]
    return launch.train_all(configs, 2, out, LAUNCH_TIMEOUT)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_lengths_train_like_the_unpipelined_model(trained, name):
    results, _, logs = trained
    for r in range(2):
        res = results.get((name, r))
        if res is None:
            pytest.fail(f"{name}: rank {r} reported nothing (hang or crash)\n{logs}")
        if not res["ok"]:
            pytest.fail(f"{name}: rank {r}: {res['error']}\n{logs}")
        assert res["max_grad_rel_err"] <= TOL
        assert res["max_loss_rel_err"] <= TOL
        assert res["grads_compared"] > 0
    assert sum(results[(name, r)]["losses_compared"] for r in range(2)) == 2 * len(PACKED)


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs
