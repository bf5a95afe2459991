"""``p2p_groups="direction"`` and ``"edge"`` on torch's pipeline runtime (CPU, gloo, loopback).

``pipec.torch.build_schedule`` creates the groups (``new_group`` of the member ranks) and
makes every stage post each message on its group; this trains through them and compares every
microbatch loss and every gradient with the model run without pipelining (the same
reference and tolerance as test_torch_train), and checks from the stages themselves which
group each message uses against the layout the sources describe: pytorch #186173 (two groups
over the pipeline group, downstream and upstream) and #196666 (one two-rank group per directed
edge, so the two ways between two ranks are two groups).

gloo does not run a group's operations in one FIFO as NCCL does, so this checks that the
messages go where the layout says and that training is unchanged, not the head-of-line waits
(the verifier's part: tests/integration/p2p_groups.rs).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import launch
import pipec

TOL = 1e-10
LAUNCH_TIMEOUT = 300
WORLD = 4

CASES = [
    # The #196666 shape (pp=4, vpp=2, looped) in training, and a V placement at pp=2.
    ("interleaved-edge", {"schedule": "interleaved-1f1b", "vpp": 2}, 4, 8, "edge"),
    ("interleaved-direction", {"schedule": "interleaved-1f1b", "vpp": 2}, 4, 8, "direction"),
    ("zb-v-edge", {"schedule": "zb-v"}, 2, 4, "edge"),
    ("1f1b-direction", {"schedule": "1f1b"}, 2, 4, "direction"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("p2p_groups")
    configs = [
        {
            "name": name,
            "pp": pp,
            "tol": TOL,
            "compile": dict(kw, pp=pp, microbatches=m, p2p_groups=groups),
        }
        for name, kw, pp, m, groups in CASES
    ]
    return launch.train_all(configs, WORLD, out, LAUNCH_TIMEOUT)


@pytest.mark.parametrize("name,kw,pp,m,groups", CASES, ids=[c[0] for c in CASES])
def test_trains_like_the_unpipelined_model_on_its_groups(trained, name, kw, pp, m, groups):
    results = trained[0]
    sched = pipec.compile(**kw, pp=pp, microbatches=m, p2p_groups=groups)
    assert sched.p2p_groups == groups
    rank_of = sched.stage_to_rank
    for r, res in enumerate(launch.rank_results(trained, name, pp)):
        assert res["max_grad_rel_err"] <= TOL
        assert res["max_loss_rel_err"] <= TOL
        used = res["p2p_groups"]
        assert used, f"{name}: rank {r} has no messages"
        ident = {}
        for a, b, members, obj in used:
            src, dst = rank_of[a], rank_of[b]
            if groups == "edge":
                # Two ranks: the message's own.
                assert members == sorted({src, dst}), (a, b, members)
                ident.setdefault((src, dst), set()).add(obj)
            else:
                # The whole pipeline group, one object per way along the stages.
                assert members == list(range(pp)), (a, b, members)
                ident.setdefault(a < b, set()).add(obj)
        # One group per key, and different keys never share one.
        assert all(len(v) == 1 for v in ident.values()), ident
        objs = [next(iter(v)) for v in ident.values()]
        assert len(set(objs)) == len(objs), ident
        if groups == "direction":
            assert set(ident) == {True, False}
    assert sum(results[(name, r)]["losses_compared"] for r in range(pp)) > 0


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs


def test_bad_name_is_refused():
    """In the words of ``--p2p-groups``' parser, as ``pipec.tune`` and both CLIs."""
    with pytest.raises(pipec.SpecError) as e:
        pipec.compile("1f1b", 2, 4, p2p_groups="ring")
    assert str(e.value) == "unknown P2P groups `ring` (expected one of pair, direction, edge)"
    with pytest.raises(pipec.SpecError, match="pair, direction, edge"):
        pipec.compile("1f1b", 2, 4, p2p_groups=None)
    assert pipec.compile("1f1b", 2, 4).p2p_groups == "pair"
