"""pipec schedules on DeepSpeed's PipelineEngine (DeepSpeed 0.19.8, CPU, gloo, loopback).

Multi-process: one launch of 2 processes and one of 4 (``ds_worker.py``), each running every
configuration in sequence: 1f1b, 1f1b --combined (overlapped pairs), gpipe, looped-bfs at vpp=1,
zb-h1, zb-h2, zb-1p and a tuned plan train two ``train_batch`` steps (pp=2 with 4 microbatches,
pp=4 with 8); every loss (the value ``train_batch`` returns on each rank and each microbatch's
loss) and every parameter after the steps are compared with the unpipelined model on the same
data, and the order each rank ran its forwards and weight-gradient passes (recovered from the
tensors, not from the adapter) with the schedule. The split backward of the zero-bubble kinds
is checked to do the work of one whole backward: the ops torch's dispatcher runs in ``bwd_D``
and ``bwd_W`` of each microbatch, against one whole backward of the same stage unpipelined.
DeepSpeed's own ``TrainSchedule`` trains the same model for comparison with pipec's 1f1b;
forward-only schedules run through ``eval_batch``; on a bf16 engine (BF16_Optimizer, fp32 and
bf16 gradient accumulation) the split-backward plan tune returns and zb-h2 train as DeepSpeed's
own TrainSchedule does on the same engine (bitwise per-microbatch gradients; see the test);
schedules DeepSpeed cannot run are refused on every rank. Tolerance: relative error <= 1e-5
(fp32; the pipelined run sums the microbatch gradients in another order).

In-process: the blocking order of :meth:`pipec.Schedule.blocking_order` is checked by a
brute-force simulation of blocking rendezvous written here, which also shows that the listed
order deadlocks for 1f1b; and every refusal of :func:`pipec.deepspeed.check`.

Each launch is killed after LAUNCH_TIMEOUT seconds: a hang fails the tests, never blocks CI.
Under CI=true a missing DeepSpeed fails instead of skipping.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pipec
import pytest

if os.environ.get("CI") == "true":
    import deepspeed  # noqa: F401  (under CI nothing may be skipped)
else:
    pytest.importorskip("deepspeed")

import launch
import pipec.deepspeed as pds
import torch

TOL = 1e-5
LAUNCH_TIMEOUT = 300
SIZES = {2: 4, 4: 8}  # pp -> microbatches
# pytest-timeout on top of the launcher's kill: a launch runs in the setup of its first test.
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 60)

KINDS = [
    ("1f1b", {"schedule": "1f1b"}),
    ("1f1b-combined", {"schedule": "1f1b", "combined": True}),
    ("gpipe", {"schedule": "gpipe"}),
    ("looped-bfs", {"schedule": "looped-bfs", "vpp": 1}),
    ("zb-h1", {"schedule": "zb-h1"}),
    ("zb-h2", {"schedule": "zb-h2"}),
    ("zb-1p", {"schedule": "zb-1p"}),
]
# f, b, w per layer (a weight pass that costs something makes the tuner split the backward) and
# memory: with parameters this heavy, a limit of 30 units leaves no room for a second copy of a
# stage (dualpipe) or a V, so pipec tune plans a loop with one stage per rank.
TUNE_COST = "t.f=1,t.b=1,t.w=1,t.param=10,t.act=1,p2p=0.05"


def tune_args(pp: int, m: int) -> dict:
    layout = "|".join(["Ett"] + ["tt"] * (pp - 2) + ["ttL"])
    return {"pp": pp, "microbatches": m, "layout": layout, "cost": TUNE_COST, "memory_limit": "30"}


REFUSALS = {
    "v-placement": {"schedule": "zb-v"},
    "two-stages-per-rank": {"schedule": "interleaved-1f1b", "vpp": 2},
    "bidirectional": {"schedule": "dualpipe"},
}


def configs(pp: int) -> list[dict]:
    m = SIZES[pp]
    out = [
        {
            "name": name,
            "pp": pp,
            "m": m,
            "tol": TOL,
            "compile": dict(kw, pp=pp, microbatches=m),
        }
        for name, kw in KINDS
    ]
    out.append(
        {
            "name": "tuned",
            "pp": pp,
            "m": m,
            "tol": TOL,
            "tune": tune_args(pp, m),
        }
    )
    out.append({"name": "deepspeed-own-1f1b", "pp": pp, "m": m, "tol": TOL, "stock": True})
    for kind in ("1f1b", "gpipe"):
        out.append(
            {
                "name": f"eval-{kind}",
                "pp": pp,
                "m": m,
                "tol": TOL,
                "eval": True,
                "compile": {"schedule": kind, "pp": pp, "microbatches": m, "forward_only": True},
            }
        )
    if pp == 2:
        out += bf16_configs(pp, m)
    refuse = {k: dict(kw, pp=pp, microbatches=2 * pp) for k, kw in REFUSALS.items()}
    refuse["pp-mismatch"] = {"schedule": "1f1b", "pp": 6 - pp, "microbatches": m}
    refuse["microbatch-mismatch"] = {"schedule": "1f1b", "pp": pp, "microbatches": m + 1}
    out.append({"name": "refusals", "pp": pp, "m": m, "refuse": refuse})
    return out


# bf16 (issue #40 point 1): the plan `pipec.tune(2, 4, num_layers=4, target="deepspeed")`
# returns (zb-h1: whole and split backwards mixed) and zb-h2 (every backward split) against
# DeepSpeed's own TrainSchedule on the same bf16 engine, model and data. "fp32": ZeRO stage 1
# with fp32 gradient accumulation (bf16 pipeline jobs' setting); "bf16": ZeRO stage 0, which
# DeepSpeed allows only with bf16 accumulation. Both go through DeepSpeed's BF16_Optimizer.
BF16_ACCUM = ("fp32", "bf16")
BF16_PLANS = {
    "tuned": {"tune": {"pp": 2, "microbatches": 4, "num_layers": 4, "target": "deepspeed"}},
    "zb-h2": {"compile": {"schedule": "zb-h2", "pp": 2, "microbatches": 4}},
}


def bf16_configs(pp: int, m: int) -> list[dict]:
    out = []
    for acc in BF16_ACCUM:
        base = {"pp": pp, "m": m, "tol": TOL, "precision": "bf16", "accum": acc}
        out.append(dict(base, name=f"bf16-{acc}-deepspeed-own", stock=True))
        plans = BF16_PLANS if acc == "fp32" else {"tuned": BF16_PLANS["tuned"]}
        out += [dict(base, name=f"bf16-{acc}-{n}", **kw) for n, kw in plans.items()]
    return out


@pytest.fixture(scope="module", params=sorted(SIZES))
def run(request, tmp_path_factory):
    pp = request.param
    out = tmp_path_factory.mktemp(f"ds-pp{pp}")
    results, ok, logs = launch.train_all(
        configs(pp), pp, out, LAUNCH_TIMEOUT, worker="ds_worker.py"
    )
    return pp, results, ok, logs


def result(run, name: str) -> list[dict]:
    pp, *trained = run
    return launch.rank_results(trained, name, pp)


@pytest.mark.parametrize("name", [n for n, _ in KINDS] + ["tuned"])
def test_trains_like_the_unpipelined_model(run, name):
    res = result(run, name)
    for r in res:
        assert r["max_loss_rel_err"] <= TOL and r["max_param_rel_err"] <= TOL
        assert r["params"], "every rank compared its layers"
        assert len(r["returned"]) == 2
    # The last stage compared every microbatch loss of both steps.
    pp = run[0]
    assert res[-1]["losses_compared"] == 2 * SIZES[pp]
    # train_batch returns the same loss on every rank, as DeepSpeed's does.
    assert all(r["returned"] == res[-1]["returned"] for r in res)


SPLIT = ["zb-h1", "zb-h2", "zb-1p", "tuned"]
ACT, WEIGHT = "[2, 6]", "[6, 6]"  # ds_worker's microbatch activations and Linear weights
LAYER_OPS = ("mm[", "tanh_backward[", "sum[", "add_[")


def layer_ops(ops: dict) -> dict:
    return {k: v for k, v in ops.items() if k.startswith(LAYER_OPS)}


@pytest.mark.parametrize("name", SPLIT)
def test_split_backward_does_the_work_of_one_backward(run, name):
    """bwd_D + bwd_W of a microbatch run exactly the layer ops of one whole backward of the
    stage (counted by torch's dispatcher in ds_worker, against the same stage run unpipelined
    without DeepSpeed): the weight pass repeats nothing of the input-gradient chain. The worker
    checks every microbatch (and that each weight gradient is accumulated once, in bwd_W);
    here the first microbatch's counts, which the report shows."""
    split_ranks = 0
    for r in result(run, name):
        w = r["work"]
        if "bwd_D" not in w:
            assert layer_ops(w["bwd"]) == layer_ops(w["whole"])
            continue
        d, wt, whole = w["bwd_D"], w["bwd_W"], w["whole"]
        both = {k: d.get(k, 0) + wt.get(k, 0) for k in set(d) | set(wt)}
        assert layer_ops(both) == layer_ops(whole), (d, wt, whole)
        assert sum(both.values()) <= sum(whole.values()), (d, wt, whole)
        if r["stage"] == 0:
            assert d == {}  # nothing to send back: all of it is the weight pass
            continue
        split_ranks += 1
        assert d[f"tanh_backward{ACT}"] == 2 and f"tanh_backward{ACT}" not in wt
        assert f"mm{WEIGHT}" not in d and wt[f"mm{WEIGHT}"] == 2  # the two weights, in bwd_W
        assert f"mm{ACT}" not in wt  # no input gradient in bwd_W
    assert split_ranks >= 1


# Unit roundoff of the dtype DeepSpeed accumulates the microbatch gradients in.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}


# The bf16 runs are launched with pp=2 only (configs()): the module fixture at that size.
@pytest.mark.parametrize("run", [2], indirect=True)
@pytest.mark.parametrize("accum, plan", [("fp32", "tuned"), ("fp32", "zb-h2"), ("bf16", "tuned")])
def test_split_backward_in_bf16_matches_deepspeeds_own_schedule(run, accum, plan):
    """Issue #40 point 1: a split-backward plan on a bf16 engine (BF16_Optimizer) trains as
    DeepSpeed's own TrainSchedule does on the same model and data.

    The reference is DeepSpeed's own run. Each microbatch's bf16 gradient, as it is added into
    the optimizer's accumulator, must be bitwise one of the reference's for that step (the same
    multiset: bwd_D + bwd_W compute each gradient with the same ops on the same tensors as the
    whole backward; only the order the microbatches are added in may differ). The sums then
    agree within what summation order can change: two orders of adding m terms in a dtype of
    unit roundoff u each lie within gamma_(m-1) * sum|g_i| of the exact sum (Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed., eq. 4.4), so they differ by at most twice
    that, element by element, with the |g_i| taken from the logged terms. With fp32
    accumulation of m=4 bf16 terms that bound is tiny, and the test asserts exact equality of
    gradients, losses and parameters over both steps, which the run shows. With bf16
    accumulation the first step's sums are held to the bound (the second step starts from
    parameters updated with them, so only the first is compared)."""
    pp = run[0]
    ours, theirs = result(run, f"bf16-{accum}-{plan}"), result(run, f"bf16-{accum}-deepspeed-own")
    m = SIZES[pp]
    for a, b in zip(ours, theirs):
        assert a["optimizer"] == b["optimizer"] == "BF16_Optimizer"
        assert a["dtype"] == "torch.bfloat16"
        assert a["accum_dtype"] == f"torch.{'float32' if accum == 'fp32' else 'bfloat16'}"
        steps = range(len(b["added"])) if accum == "fp32" else range(1)
        for s in steps:
            assert len(a["added"][s]) == len(b["added"][s]) == m
            assert sorted(map(tuple, a["added"][s])) == sorted(map(tuple, b["added"][s]))
            terms = torch.tensor(b["added"][s], dtype=torch.float64)
            u = UNIT_ROUNDOFF[accum]
            gamma = (m - 1) * u / (1 - (m - 1) * u)
            bound = 2 * gamma * terms.abs().sum(0)
            diff = (
                torch.tensor(a["grads"][s], dtype=torch.float64)
                - torch.tensor(b["grads"][s], dtype=torch.float64)
            ).abs()
            assert bool((diff <= bound).all()), float((diff - bound).max())
            if accum == "fp32":
                assert a["grads"][s] == b["grads"][s]
        if accum == "fp32":
            assert a["returned"] == b["returned"]
            assert a["params"] == b["params"]
        else:
            assert a["returned"][0] == b["returned"][0]
    # The plan really splits its backward on this engine.
    split = [t for r in ours for t in r["trace"] if t[0] in ("bwd_D", "bwd_W")]
    assert split and ours[0]["kind"] in ("zb-h1", "zb-h2")


def test_pipec_1f1b_equals_deepspeeds_own_train_schedule(run):
    ours, theirs = result(run, "1f1b"), result(run, "deepspeed-own-1f1b")
    for a, b in zip(ours, theirs):
        assert a["returned"] == b["returned"]
        assert a["params"] == b["params"]


@pytest.mark.parametrize("name", ["eval-1f1b", "eval-gpipe"])
def test_forward_only_through_eval_batch(run, name):
    for r in result(run, name):
        assert r["max_loss_rel_err"] <= TOL


def test_refusals_on_every_rank(run):
    res = result(run, "refusals")
    errors = [r["errors"] for r in res]
    assert all(e == errors[0] for e in errors), "every rank refuses alike"
    e = errors[0]
    assert all(v is not None for v in e.values()), e
    assert "V" in e["v-placement"] and "one stage per rank" in e["v-placement"]
    assert "2 stages per rank" in e["two-stages-per-rank"]
    assert "two ranks" in e["bidirectional"] and "one stage per rank" in e["bidirectional"]
    pp = run[0]
    assert f"pp={6 - pp}" in e["pp-mismatch"] and f"has {pp} stages" in e["pp-mismatch"]
    m = SIZES[pp]
    assert f"{m + 1} microbatches" in e["microbatch-mismatch"]
    assert f"runs {m} (gradient_accumulation_steps)" in e["microbatch-mismatch"]


def test_all_ranks_exited_cleanly(run):
    _, _, ok, logs = run
    assert ok, logs


# --------------------------------------------------------------------------- in-process


def simulate_blocking(streams: list[list[dict]], orders: list[list[int]] | None) -> bool:
    """Brute force: every rank executes its ops one at a time; a send or receive completes only
    when the peer's current op is its partner (the k-th send a->b with b's k-th receive from a).
    Returns whether every rank reaches its end."""
    world = len(streams)
    if orders is None:
        orders = [[i for i, ins in enumerate(s) if ins["op"] != "wait"] for s in streams]
    seq = [[streams[r][i] for i in orders[r]] for r in range(world)]
    # Number each message on its channel, in the order the ops run.
    keyed = []
    for r in range(world):
        count: dict = {}
        ks = []
        for ins in seq[r]:
            if ins["op"] in ("send", "recv"):
                ch = (r, ins["peer"]) if ins["op"] == "send" else (ins["peer"], r)
                k = count.get((ins["op"], ch), 0)
                count[(ins["op"], ch)] = k + 1
                ks.append((ch, k, ins["op"], (ins["payload"], ins["stage"], ins["mb"])))
            else:
                ks.append(None)
        keyed.append(ks)
    pc = [0] * world
    progress = True
    while progress:
        progress = False
        for r in range(world):
            while pc[r] < len(seq[r]) and keyed[r][pc[r]] is None:
                pc[r] += 1
                progress = True
            if pc[r] == len(seq[r]):
                continue
            ch, k, op, payload = keyed[r][pc[r]]
            peer = ch[1] if op == "send" else ch[0]
            if pc[peer] < len(seq[peer]) and keyed[peer][pc[peer]] is not None:
                ch2, k2, op2, payload2 = keyed[peer][pc[peer]]
                if ch2 == ch and k2 == k and op2 != op:
                    assert payload == payload2, "the meeting ops carry the same tensor"
                    pc[r] += 1
                    pc[peer] += 1
                    progress = True
    return all(pc[r] == len(seq[r]) for r in range(world))


ALL_KINDS = [kw for _, kw in KINDS]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("kw", [*ALL_KINDS, "tuned"], ids=[*(n for n, _ in KINDS), "tuned"])
def test_blocking_order_never_deadlocks(pp, kw):
    if kw == "tuned":  # in-flight batches and waits (dropped: every batch blocks in place)
        s, _ = pipec.tune(**tune_args(pp, SIZES[pp]))
        assert any(i["op"] == "wait" for r in range(pp) for i in s.instructions(r))
    else:
        s = pipec.compile(**kw, pp=pp, microbatches=SIZES[pp])
    streams = [s.instructions(r) for r in range(pp)]
    orders = s.blocking_order()
    for r, (stream, order) in enumerate(zip(streams, orders)):
        # A permutation of the non-wait ops that moves ops only within their own comm batch:
        # each op's unit (its own index for compute, the batch's first index for a send or
        # receive) never decreases along the order.
        assert sorted(order) == [i for i, ins in enumerate(stream) if ins["op"] != "wait"]
        unit, first = [], None
        for i, ins in enumerate(stream):
            if ins["op"] in ("send", "recv"):
                prev = stream[i - 1] if i else {}
                if prev.get("op") not in ("send", "recv") or prev["batch"] != ins["batch"]:
                    first = i
                unit.append(first)
            else:
                unit.append(i)
        units = [unit[i] for i in order]
        assert units == sorted(units), f"rank {r}: an op left its batch"
    assert simulate_blocking(streams, orders)


@pytest.mark.parametrize("pp", [2, 4])
def test_listed_order_of_1f1b_deadlocks_under_blocking_sends(pp):
    """The issue's fact, reproduced by the brute-force simulation: taken as listed, 1f1b's
    batches deadlock with blocking one-at-a-time P2P; blocking_order's does not."""
    s = pipec.compile("1f1b", pp, SIZES[pp])
    streams = [s.instructions(r) for r in range(pp)]
    assert not simulate_blocking(streams, None)
    assert simulate_blocking(streams, s.blocking_order())


@pytest.mark.parametrize("pp", [2, 4])
def test_eligibility_rule(pp):
    """One stage per rank, stage s on rank s: every such kind is eligible, nothing else."""
    m = 2 * pp
    for kw in ALL_KINDS:
        assert pds.eligible(pipec.compile(**kw, pp=pp, microbatches=m)) is None
    for kind, vpp in (("zb-v", None), ("dualpipe-v", None), ("dualpipe", None)):
        assert pds.eligible(pipec.compile(kind, pp, m, vpp=vpp)) is not None
    s = pipec.compile("interleaved-1f1b", pp, m, vpp=2)
    assert "2 stages per rank" in pds.eligible(s)
    tuned, _ = pipec.tune(**tune_args(pp, m))
    assert tuned.placement == "looped" and tuned.stage_to_rank == list(range(pp))
    assert pds.eligible(tuned) is None
    assert any(i["op"] == "bwd_W" for i in tuned.instructions(0)), "a zero-bubble plan"
    # Without the limit, free to pick any placement, the tuner takes both directions
    # (DualPipe's placement): refused. Its default (every framework) and target="deepspeed"
    # hand back only what this adapter runs.
    free, _ = pipec.tune(**dict(tune_args(pp, m), memory_limit=None), target="any")
    assert free.placement != "looped" and "two ranks" in pds.eligible(free)
    for target in (None, "deepspeed"):
        chosen, _ = pipec.tune(**dict(tune_args(pp, m), memory_limit=None), target=target)
        assert pds.eligible(chosen) is None, (target, chosen)


def test_check_refuses_split_backward_on_a_loss_scaling_engine():
    s = pipec.compile("zb-h1", 2, 4)
    with pytest.raises(pipec.PipecError, match=r"bwd_D.*scales the loss"):
        pds.check(s, 2, 4, split_backward=False)
    pds.check(pipec.compile("1f1b", 2, 4), 2, 4, split_backward=False)
    with pytest.raises(pipec.PipecError, match=r"pp=2 ranks.*has 4 stages"):
        pds.check(s, 4, 4)
    with pytest.raises(pipec.PipecError, match=r"4 microbatches.*runs 8"):
        pds.check(s, 2, 8)


def test_use_refuses_what_is_not_an_engine():
    with pytest.raises(pipec.PipecError, match="PipelineEngine"):
        pds.use(object(), pipec.compile("1f1b", 2, 4))


REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "python" / "examples" / "deepspeed_train.py"


def test_deepspeed_doc_shows_the_example():
    doc = (REPO / "docs" / "deepspeed.md").read_text()
    m = re.search(
        r"<!-- python/examples/deepspeed_train.py -->\n```python\n(.*?)```", doc, re.DOTALL
    )
    assert m, "docs/deepspeed.md embeds python/examples/deepspeed_train.py"
    assert m.group(1) == EXAMPLE.read_text()


def test_the_deepspeed_example_trains(tmp_path):
    env = {"DS_ACCELERATOR": "cpu"}
    ok, logs = launch.launch(
        lambda r, port: [sys.executable, str(EXAMPLE)], 2, tmp_path, LAUNCH_TIMEOUT, env=env
    )
    assert ok, logs
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", logs)]
    assert len(losses) == 3, logs
    assert losses[-1] < losses[0], logs
    assert re.search(r"eval: loss [0-9.]+", logs), logs


def test_parts_and_pipeline_module_refusals():
    """``parts``: one layer per letter of the layout, boundaries counted by hand; the module
    builder refuses a layer count other than the layout's and a partition_method of the
    user's (it would split otherwise), before DeepSpeed is asked to build anything."""
    s = pipec.compile("1f1b", 2, 4, layout="Ett|ttL")
    assert pds.parts(s) == [0, 3, 6]
    assert pds.parts(pipec.compile("1f1b", 3, 6, layout="Et|tttt|L")) == [0, 2, 6, 7]
    with pytest.raises(pipec.PipecError, match=r"6 layers \(Ett\|ttL: one per letter\), but 4"):
        pds.pipeline_module(s, [object()] * 4)
    with pytest.raises(pipec.PipecError, match="partition_method"):
        pds.pipeline_module(s, [object()] * 6, partition_method="uniform")
    with pytest.raises(pipec.PipecError, match="one stage per rank"):
        pds.pipeline_module(pipec.compile("zb-v", 2, 4), [object()] * 6)
