"""pipec's schedules inside Megatron-LM training (``pipec.megatron``), against megatron-core
0.19.2's own computations, on a CPU over gloo.

Two launches (2 and 4 processes, ``megatron_worker.py``) train a small megatron-core GPTModel
(local layer spec, 4 or 8 decoder layers, embedding on the first stage, output layer and loss on
the last) for two SGD steps with every configuration below, and compare every microbatch loss
and every parameter gradient with Megatron's own ``forward_backward_no_pipelining`` on the same
weights and data; the pipec runs of 1f1b and interleaved-1f1b are also compared with Megatron's
own schedule functions on the same model. Tolerance: max abs difference <= TOL (float32; the
measured difference is 0, the results are bitwise equal).

Refusals and the stage/layer mapping are checked in this process without launching anything.
Every launch is killed after LAUNCH_TIMEOUT seconds: a hang fails the tests, it never blocks CI.
"""

from __future__ import annotations

import math
import os
import re
import sys
import types
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import megatron.core  # noqa: F401  (under CI nothing may be skipped)
    import torch  # noqa: F401
else:
    pytest.importorskip("torch")
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (test.sh installs it)"
    )

import launch
import pipec
import pipec.megatron as pm

TOL = 1e-6
LAUNCH_TIMEOUT = 240

L2, L4 = "Et|t|t|tL", "Et|t|t|t|t|t|t|tL"  # 4 and 8 stages of one decoder layer each
L2_1, L4_1 = "Ett|ttL", "Ett|tt|tt|ttL"  # the same layers on 2 and 4 stages
MG_1F1B = "forward_backward_pipelining_without_interleaving"
MG_INTERLEAVED = "forward_backward_pipelining_with_interleaving"


def pipec_cfg(name, pp, m, layout, compare_with=None, p2p=None, **kw):
    cfg = {"name": name, "compile": dict(kw, pp=pp, microbatches=m, layout=layout)}
    if compare_with:
        cfg["compare_with"] = compare_with
    if p2p:
        cfg["p2p"] = p2p
    return cfg


def megatron_cfg(name, fn, layout, m, vpp=None, **p2p):
    return {
        "name": name,
        "megatron": fn,
        "layout": layout,
        "microbatches": m,
        "vpp": vpp,
        "p2p": p2p,
    }


UNBATCHED = {"batch_p2p_comm": False}
OVERLAP = {"batch_p2p_comm": False, "overlap_p2p_comm": True, "deallocate_pipeline_outputs": True}

# pp=2, 4 microbatches. Megatron's own runs first (the pipec runs compare with them).
PP2 = [
    megatron_cfg("megatron-1f1b-pp2", MG_1F1B, L2_1, 4),  # batch_p2p_comm=True (default)
    megatron_cfg("megatron-interleaved-unbatched-pp2", MG_INTERLEAVED, L2, 4, 2, **UNBATCHED),
    megatron_cfg("megatron-interleaved-overlap-pp2", MG_INTERLEAVED, L2, 4, 2, **OVERLAP),
    # Known upstream: at pp=2 the batched call pairs a gradient with an activation.
    megatron_cfg("megatron-interleaved-batched-pp2", MG_INTERLEAVED, L2, 4, 2, batch_p2p_comm=True),
    pipec_cfg("1f1b-pp2", 2, 4, L2_1, "megatron-1f1b-pp2", schedule="1f1b"),
    pipec_cfg(
        "1f1b-unbatched-pp2",
        2,
        4,
        L2_1,
        "megatron-1f1b-pp2",
        schedule="1f1b",
        megatron_p2p="unbatched",
    ),
    # pipec's default at pp=2 is Megatron-LM's overlap mode (batched is refused there).
    pipec_cfg(
        "interleaved-1f1b-pp2",
        2,
        4,
        L2,
        "megatron-interleaved-overlap-pp2",
        p2p={"deallocate_pipeline_outputs": True},
        schedule="interleaved-1f1b",
        vpp=2,
    ),
    pipec_cfg(
        "interleaved-1f1b-unbatched-pp2",
        2,
        4,
        L2,
        "megatron-interleaved-unbatched-pp2",
        schedule="interleaved-1f1b",
        vpp=2,
        megatron_p2p="unbatched",
    ),
    pipec_cfg(
        "interleaved-1f1b-combined-pp2", 2, 4, L2, schedule="interleaved-1f1b", vpp=2, combined=True
    ),
    # Megatron's partial recompute (num_microbatches_with_partial_activation_checkpoints = N):
    # Megatron's own functions decide which forwards to checkpoint, pipec's compiled marks
    # must pass the same flags to forward_step_func, in the same order.
    dict(megatron_cfg("megatron-1f1b-recompute-pp2", MG_1F1B, L2_1, 4), recompute=1),
    dict(
        pipec_cfg(
            "1f1b-recompute-pp2",
            2,
            4,
            L2_1,
            "megatron-1f1b-recompute-pp2",
            schedule="1f1b",
            megatron_partial_recompute=1,
        ),
        recompute=1,
    ),
    dict(
        megatron_cfg("megatron-interleaved-recompute-pp2", MG_INTERLEAVED, L2, 4, 2, **OVERLAP),
        recompute=2,
    ),
    dict(
        pipec_cfg(
            "interleaved-1f1b-recompute-pp2",
            2,
            4,
            L2,
            "megatron-interleaved-recompute-pp2",
            p2p={"deallocate_pipeline_outputs": True},
            schedule="interleaved-1f1b",
            vpp=2,
            megatron_partial_recompute=2,
        ),
        recompute=2,
    ),
    pipec_cfg("zb-1p-pp2", 2, 4, L2_1, schedule="zb-1p"),
    pipec_cfg("zb-v-pp2", 2, 4, L2, schedule="zb-v"),
    pipec_cfg(
        "zb-v-deallocated-pp2", 2, 4, L2, p2p={"deallocate_pipeline_outputs": True}, schedule="zb-v"
    ),
    dict(pipec_cfg("dualpipe-v-pp2", 2, 4, L2, schedule="dualpipe-v"), loss="per-token"),
    dict(
        pipec_cfg("eval-zb-v-pp2", 2, 4, L2, schedule="zb-v", forward_only=True),
        forward_only=True,
    ),
    dict(
        pipec_cfg(
            "eval-interleaved-1f1b-pp2",
            2,
            4,
            L2,
            schedule="interleaved-1f1b",
            vpp=2,
            forward_only=True,
        ),
        forward_only=True,
        collect=True,
    ),
]

# pp=4: batched interleaving (Megatron's default where it is correct), and zero bubble / V.
PP4 = [
    megatron_cfg("megatron-1f1b-pp4", MG_1F1B, L4_1, 4),
    megatron_cfg("megatron-interleaved-batched-pp4", MG_INTERLEAVED, L4, 4, 2, batch_p2p_comm=True),
    pipec_cfg("1f1b-pp4", 4, 4, L4_1, "megatron-1f1b-pp4", schedule="1f1b"),
    pipec_cfg(
        "interleaved-1f1b-pp4",
        4,
        4,
        L4,
        "megatron-interleaved-batched-pp4",
        schedule="interleaved-1f1b",
        vpp=2,
    ),
    # Megatron-core's config default (deallocate_pipeline_outputs=False): a forward's send is
    # waited only when the next is posted, so one rank runs a backward of an output whose send
    # is still in flight (rank 2, stage 6, mb 3); once with the outputs deallocated as well.
    megatron_cfg(
        "megatron-interleaved-overlap-keep-outputs-pp4",
        MG_INTERLEAVED,
        L4,
        4,
        2,
        batch_p2p_comm=False,
        overlap_p2p_comm=True,
    ),
    pipec_cfg(
        "interleaved-1f1b-overlap-keep-outputs-pp4",
        4,
        4,
        L4,
        "megatron-interleaved-overlap-keep-outputs-pp4",
        schedule="interleaved-1f1b",
        vpp=2,
        megatron_p2p="overlap-keep-outputs",
    ),
    pipec_cfg(
        "interleaved-1f1b-overlap-keep-outputs-deallocated-pp4",
        4,
        4,
        L4,
        p2p={"deallocate_pipeline_outputs": True},
        schedule="interleaved-1f1b",
        vpp=2,
        megatron_p2p="overlap-keep-outputs",
    ),
    pipec_cfg("zb-1p-pp4", 4, 8, L4_1, schedule="zb-1p"),
    pipec_cfg("zb-v-pp4", 4, 8, L4, schedule="zb-v"),
    pipec_cfg("dualpipe-v-pp4", 4, 8, L4, schedule="dualpipe-v"),
]

# Microbatches of different lengths (#38), two steps of other lengths each (at most SEQ = 8
# tokens, the model's position table): Megatron's own schedules with variable_seq_lengths (a
# shape message before every tensor), then pipec's plans compiled per step from the lengths
# (no shape message), in index order and in permuted orders, compared with Megatron's run on
# the same model and with the unpipelined one. Last in each launch: a Megatron run that hung
# would end the launch.
VARLEN = {"variable_seq_lengths": True}
LEN_PP2 = [[8, 3, 5, 6], [2, 7, 4, 8]]
LEN_PP4 = [[8, 2, 6, 4, 7, 3, 5, 8], [3, 8, 5, 2, 6, 8, 4, 7]]


def varlen_cfg(cfg, lengths, order=None, like=None):
    """``like``: Megatron's run of the same model on another placement (its losses and
    gradients sit on other ranks, so each is compared with the unpipelined run, bitwise)."""
    cfg = dict(cfg, lengths=lengths)
    cfg["p2p"] = dict(cfg.get("p2p") or {}, **VARLEN)
    if order is not None:
        cfg["order"] = order
    if like is not None:
        cfg["like"] = like
    return cfg


MG_VARLEN_PP2, MG_VARLEN_PP4 = "megatron-1f1b-varlen-pp2", "megatron-interleaved-varlen-pp4"
PP2 += [
    varlen_cfg(megatron_cfg(MG_VARLEN_PP2, MG_1F1B, L2_1, 4), LEN_PP2),
    varlen_cfg(pipec_cfg("1f1b-varlen-pp2", 2, 4, L2_1, MG_VARLEN_PP2, schedule="1f1b"), LEN_PP2),
    varlen_cfg(
        pipec_cfg("1f1b-varlen-order-pp2", 2, 4, L2_1, MG_VARLEN_PP2, schedule="1f1b"),
        LEN_PP2,
        order=[3, 1, 0, 2],
    ),
    # The same 4-layer model on 4 stages.
    varlen_cfg(
        pipec_cfg("zb-v-varlen-pp2", 2, 4, L2, schedule="zb-v"), LEN_PP2, like=MG_VARLEN_PP2
    ),
    varlen_cfg(
        pipec_cfg("zb-v-varlen-order-pp2", 2, 4, L2, schedule="zb-v"),
        LEN_PP2,
        order=[2, 0, 3, 1],
        like=MG_VARLEN_PP2,
    ),
    varlen_cfg(
        pipec_cfg(
            "interleaved-1f1b-varlen-pp2",
            2,
            4,
            L2,
            p2p={"deallocate_pipeline_outputs": True},
            schedule="interleaved-1f1b",
            vpp=2,
        ),
        LEN_PP2,
        like=MG_VARLEN_PP2,
    ),
    # Megatron's own interleaved run in this mode crosses the shapes at pp = 2 (gloo aborts:
    # "Received data size doesn't match expected size"); pipec's sends none to cross.
    varlen_cfg(
        pipec_cfg(
            "interleaved-1f1b-varlen-unbatched-pp2",
            2,
            4,
            L2,
            schedule="interleaved-1f1b",
            vpp=2,
            megatron_p2p="unbatched",
        ),
        LEN_PP2,
        like=MG_VARLEN_PP2,
    ),
]

PP4 += [
    varlen_cfg(megatron_cfg("megatron-1f1b-varlen-pp4", MG_1F1B, L4_1, 8), LEN_PP4),
    varlen_cfg(megatron_cfg(MG_VARLEN_PP4, MG_INTERLEAVED, L4, 8, 2, batch_p2p_comm=True), LEN_PP4),
    varlen_cfg(
        pipec_cfg("1f1b-varlen-pp4", 4, 8, L4_1, "megatron-1f1b-varlen-pp4", schedule="1f1b"),
        LEN_PP4,
    ),
    varlen_cfg(
        pipec_cfg(
            "interleaved-1f1b-varlen-pp4",
            4,
            8,
            L4,
            MG_VARLEN_PP4,
            schedule="interleaved-1f1b",
            vpp=2,
        ),
        LEN_PP4,
    ),
    varlen_cfg(
        pipec_cfg(
            "interleaved-1f1b-varlen-order-pp4",
            4,
            8,
            L4,
            MG_VARLEN_PP4,
            schedule="interleaved-1f1b",
            vpp=2,
        ),
        LEN_PP4,
        order=[7, 0, 5, 2, 3, 4, 1, 6],
    ),
    varlen_cfg(
        pipec_cfg("zb-v-varlen-pp4", 4, 8, L4, schedule="zb-v"), LEN_PP4, like=MG_VARLEN_PP4
    ),
]

LAUNCHES = {2: PP2, 4: PP4}
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "python" / "examples" / "megatron_train.py"
ALL = {c["name"]: (pp, c) for pp, cfgs in LAUNCHES.items() for c in cfgs}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for pp, cfgs in LAUNCHES.items():
        d = tmp_path_factory.mktemp(f"megatron-pp{pp}")
        out[pp] = launch.train_all(cfgs, pp, d, LAUNCH_TIMEOUT, worker="megatron_worker.py")
    return out


def ranks_of(results, name: str) -> list[dict]:
    pp, _ = ALL[name]
    return launch.rank_results(results[pp], name, pp)


def assert_like_unpipelined(results, name: str) -> None:
    got = ranks_of(results, name)
    for d in got:
        assert d["loss_diff"] <= TOL, (name, d)
        assert d["grad_diff"] <= TOL, (name, d)
    # Every stage, every loss, every gradient (none on forward-only runs) was compared.
    stages = sorted(s for d in got for s in d["stages"])
    assert stages == list(range(len(stages)))
    assert sum(d["losses_compared"] for d in got) > 0
    if not ALL[name][1].get("forward_only"):
        assert all(d["grads_compared"] > 0 for d in got)


PIPEC_RUNS = [n for n, (_, c) in ALL.items() if "compile" in c]


@pytest.mark.parametrize("name", PIPEC_RUNS)
def test_pipec_schedule_trains_like_megatron_without_pipelining(results, name):
    assert_like_unpipelined(results, name)


COMPARED = [(n, c["compare_with"]) for n, (_, c) in ALL.items() if "compare_with" in c]


@pytest.mark.parametrize("name,megatron", COMPARED, ids=[n for n, _ in COMPARED])
def test_pipec_equals_megatrons_own_schedule(results, name, megatron):
    assert_like_unpipelined(results, megatron)  # Megatron's own run is right here
    for d in ranks_of(results, name):
        assert d["vs_loss_diff"] <= TOL, d
        assert d["vs_grad_diff"] <= TOL, d


@pytest.mark.parametrize("name", ["1f1b-recompute-pp2", "interleaved-1f1b-recompute-pp2"])
def test_partial_recompute_passes_megatrons_flags(results, name):
    """Under num_microbatches_with_partial_activation_checkpoints, pipec's executor hands
    forward_step_func the checkpoint flag of every forward exactly as Megatron's own schedule
    function does (same values, same order, on every rank, both steps), some True and some
    False; the checkpointed forwards are recomputed in the backward and the gradients stay
    those of the unpipelined model (checked by the tests above)."""
    flags = []
    for d in ranks_of(results, name):
        assert d["flags"] == d["vs_flags"], (name, d["flags"], d["vs_flags"])
        flags += d["flags"]
    assert True in flags and False in flags, flags


def test_megatron_interleaved_batched_at_pp2_is_wrong_and_pipec_refuses_it(results):
    """megatron-core's interleaved schedule with batch_p2p_comm=True at pp=2 silently trains
    on wrong gradients; pipec refuses that placement and runs Megatron-LM's overlap mode."""
    got = ranks_of(results, "megatron-interleaved-batched-pp2")
    assert max(d["grad_diff"] for d in got) > 1e-2, got
    with pytest.raises(pipec.SpecError, match="greater than 2"):
        pipec.compile("interleaved-1f1b", 2, 4, vpp=2, megatron_p2p="batched")
    assert "megatron-interleaved-batched-pp4" in ALL  # and at pp=4 Megatron's batched is right
    assert_like_unpipelined(results, "megatron-interleaved-batched-pp4")


VARLEN_PIPEC = [n for n, (_, c) in ALL.items() if "lengths" in c and "compile" in c]
VARLEN_MEGATRON = [n for n, (_, c) in ALL.items() if "lengths" in c and "megatron" in c]


@pytest.mark.parametrize("name", VARLEN_PIPEC)
def test_varlen_messages_are_exactly_the_plans(results, name):
    """Under variable_seq_lengths pipec.megatron posts exactly its plan's sends and receives:
    every isend/irecv of each step on each rank, in order, equals the rank's send/recv
    instructions of that step's plan with the plan's tokens as the sequence dimension; no
    shape message, no synchronize. (Its losses and gradients: the tests above, against the
    unpipelined run and, where the placement is Megatron's, Megatron's own varlen run.)"""
    for d in ranks_of(results, name):
        msg = d["messages"]
        assert msg["plan_equal"] == [True, True], (name, d["rank"], msg)
        assert msg["shape_messages"] == 0 and d["shape_syncs"] == 0, (name, msg)
        assert msg["posted"] > 0, msg
    like = ALL[name][1].get("like")
    if like is not None:  # the same model on Megatron's placement: both equal the unpipelined
        assert_like_unpipelined(results, like)


@pytest.mark.parametrize("name", VARLEN_MEGATRON)
def test_megatrons_own_varlen_run_exchanges_shapes_and_is_right_here(results, name):
    """The reference runs are what they claim: Megatron's variable_seq_lengths path ran (a
    3-number int64 shape message before each tensor, then its synchronize), twice the
    messages of pipec's plan, and it trained like the unpipelined model."""
    assert_like_unpipelined(results, name)
    for d in ranks_of(results, name):
        msg = d["messages"]
        assert msg["shape_messages"] * 2 == msg["posted"] > 0, (name, msg)
        assert d["shape_syncs"] > 0, d
    pipec_runs = [n for n in VARLEN_PIPEC if ALL[n][1].get("compare_with") == name]
    assert pipec_runs, name
    for n in pipec_runs:
        for mine, theirs in zip(ranks_of(results, n), ranks_of(results, name), strict=True):
            assert mine["messages"]["posted"] * 2 == theirs["messages"]["posted"], (n, name)


def test_cpu_patches_take_effect(results):
    """Each test-only patch of megatron_cpu.py was used by Megatron's own code (a new
    megatron-core that bypasses one fails here), and Megatron never synchronized."""
    for pp in LAUNCHES:
        res, ok, logs = results[pp]
        assert ok, logs
        for d in res.values():
            h = d["hits"]
            assert h["synchronize"] == 0, h
        first = res[(LAUNCHES[pp][0]["name"], 0)]  # after Megatron's own (batched) 1F1B
        assert first["ok"], first
        h = first["hits"]
        assert h["current_device"] > 0, h  # P2P receive buffers
        assert h["rng_fork"] > 0, h  # attention dropout under the RNG tracker
        assert h["cuda_device_arg"] > 0, h  # the schedule's token counter


# --------------------------------------------------------------------------- in-process


def test_stage_indices_and_layers_are_megatrons_for_looped_placements():
    """Looped placements: chunk c of rank r is stage c*pp + r with the layers Megatron's own
    PipelineParallelLayerLayout gives (virtual stage c, pipeline rank r)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    for kind, pp, vpp, layout in [
        ("1f1b", 4, None, "Ettt|tt|t|ttL"),
        ("interleaved-1f1b", 2, 2, "Et|ttt||tL"),
        ("interleaved-1f1b", 4, 2, "E|t|tt|t|t|tt|t|tL"),
    ]:
        s = pipec.compile(kind, pp, 4, vpp=vpp, layout=layout)
        ml = PipelineParallelLayerLayout(layout, pp)
        lay = pm.stage_layers(s)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
        try:
            for r in range(pp):
                stages = pm.stage_indices(s, r)
                assert stages == [c * pp + r for c in range(vpp or 1)]
                for c, st in enumerate(stages):
                    ids = ml.get_layer_id_list(vp_stage=c, pp_rank=r)
                    assert list(lay[st].decoder_layers) == ids, (layout, r, c)
                    assert lay[st].pre_process == (LayerType.embedding in ml.layout[r][c])
                    assert lay[st].post_process == (LayerType.loss in ml.layout[r][c])
        finally:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_stage_indices_of_v_placements():
    for kind in ("zb-v", "dualpipe-v", "v-half"):
        s = pipec.compile(kind, 4, 8)
        for r in range(4):
            assert pm.stage_indices(s, r) == [r, 7 - r]
        lay = pm.stage_layers(s)
        assert [x.pre_process for x in lay] == [True] + [False] * 7
        assert [x.post_process for x in lay] == [False] * 7 + [True]


class Chunk:
    """Stands in for a model chunk: the refusals come before anything runs."""

    def __init__(self, pre=False, post=False, vp_stage=None):
        self.pre_process, self.post_process, self.vp_stage = pre, post, vp_stage

    def parameters(self):
        return iter(())


def call(fb, pp, rank, model, m, data=None, **kw):
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return fb(
        forward_step_func=None,
        data_iterator=data if data is not None else [iter(()) for _ in model],
        model=model,
        num_microbatches=m,
        seq_length=8,
        micro_batch_size=1,
        p2p_communicator=types.SimpleNamespace(pp_group=group),
        pg_collection=types.SimpleNamespace(),
        **kw,
    )


def test_refuses_a_world_of_another_size():
    fb = pm.forward_backward_func(pipec.compile("1f1b", 2, 4))
    with pytest.raises(pipec.PipecError, match=r"pp=2 .* has 4"):
        call(fb, 4, 0, [Chunk(pre=True)], 4)


def test_refuses_another_number_of_model_chunks():
    fb = pm.forward_backward_func(pipec.compile("zb-v", 2, 4))
    with pytest.raises(pipec.PipecError, match=r"2 stages \[0, 3\] .* 1 chunk"):
        call(fb, 2, 0, [Chunk(pre=True)], 4)


def test_refuses_another_microbatch_count():
    fb = pm.forward_backward_func(pipec.compile("interleaved-1f1b", 2, 4, vpp=2))
    with pytest.raises(pipec.PipecError, match=r"num_microbatches=8.*compiled for 4"):
        call(fb, 2, 1, [Chunk(vp_stage=0), Chunk(post=True, vp_stage=1)], 8)


def test_refuses_chunks_built_for_megatrons_placement_on_a_v_schedule():
    """Rank 0 of a V schedule runs the first and the last stage: a chunk 1 built the Megatron
    way (stage pp + 0, no output layer) is refused, naming the stage."""
    fb = pm.forward_backward_func(pipec.compile("zb-v", 2, 4))
    with pytest.raises(pipec.PipecError, match=r"chunk 1 .*stage 3, .*post_process=False"):
        call(fb, 2, 0, [Chunk(pre=True, vp_stage=0), Chunk(vp_stage=1)], 4)


def test_loads_a_compiled_directory(tmp_path):
    """A path is loaded with pipec.load's checks (here: the directory's microbatch count)."""
    pipec.compile("zb-v", 2, 4).save(tmp_path / "zbv", format="bin")
    fb = pm.forward_backward_func(tmp_path / "zbv")
    assert fb.pipec_schedule.kind == "zb-v"
    with pytest.raises(pipec.PipecError, match=r"num_microbatches=6.*compiled for 4"):
        call(fb, 2, 0, [Chunk(pre=True), Chunk(post=True)], 6)
    with pytest.raises(pipec.FileError):
        pm.forward_backward_func(tmp_path / "missing")


def test_refuses_forward_only_mismatch_and_data_iterators():
    fb = pm.forward_backward_func(pipec.compile("zb-v", 2, 4))
    chunks = [Chunk(pre=True), Chunk(post=True)]
    with pytest.raises(pipec.PipecError, match="forward_only=True"):
        call(fb, 2, 0, chunks, 4, forward_only=True)
    with pytest.raises(pipec.PipecError, match="1 data iterators for 2 model chunks"):
        call(fb, 2, 0, chunks, 4, data=[iter(())])


def test_refuses_dualpipe():
    s = pipec.compile("dualpipe", 2, 4)
    with pytest.raises(pipec.PipecError, match="dualpipe-v"):
        pm.forward_backward_func(s)
    with pytest.raises(pipec.PipecError, match="two ranks"):
        pm.stage_indices(s, 0)


def test_refuses_p2p_groups_megatron_does_not_create():
    """#39: a plan verified under ``direction``/``edge`` communicators is refused (Megatron
    posts on its pipeline group's per-pair communicators, which that verdict does not cover),
    in the words of the Rust rule ``pipec tune --target megatron`` applies; ``pair`` runs."""
    for groups in ["direction", "edge"]:
        s = pipec.compile("1f1b", 2, 4, p2p_groups=groups)
        assert s.refusal("megatron") is not None
        with pytest.raises(pipec.PipecError, match=f"P2P groups `{groups}`.*Megatron posts"):
            pm.forward_backward_func(s)
        assert s.refusal("torch") is None and s.refusal("deepspeed") is None
    assert callable(pm.forward_backward_func(pipec.compile("1f1b", 2, 4, p2p_groups="pair")))


def test_forwards_out_of_microbatch_order_are_fed_by_id(tmp_path):
    """#38: forwards may enter in any microbatch order (a tuned ``microbatch_order``): the
    Rust rule (``Schedule.refusal("megatron")``, what ``pipec tune --target megatron`` filters
    by) accepts them, and pipec.megatron hands each forward its own microbatch (trained in
    the launches above: the ``-order-`` configurations). Only the placement is refused."""
    from test_api import forwards_out_of_order

    s = forwards_out_of_order(tmp_path)
    assert s.refusal("megatron") is None
    assert callable(pm.forward_backward_func(s))
    with pytest.raises(pipec.PipecError) as e:
        pm.stage_indices(pipec.compile("dualpipe", 2, 4), 0)
    assert str(e.value) == (
        "dualpipe places every stage on two ranks (one copy per direction, with their "
        "gradients summed); a Megatron model chunk lives on one rank, so pipec.megatron "
        "cannot run it (use dualpipe-v, its V-shaped form)"
    )


def test_data_by_id_draws_lazily_in_microbatch_order():
    """A chunk whose forwards run microbatches 2, 0, 3, 1 gets items 2, 0, 3, 1 of an iterator
    that yields them in order, drawing no item before a forward asks (never ahead of the
    microbatch asked for), and a second next() in one forward is refused."""
    drawn = []

    def items():
        for k in range(4):
            drawn.append(k)
            yield f"item {k}"

    feed = pm._ById(items(), rank=1, chunk=0)
    got, counts = [], []
    assert drawn == []
    for mb in (2, 0, 3, 1):
        feed.want = mb
        got.append(next(feed))
        counts.append(len(drawn))
    assert got == ["item 2", "item 0", "item 3", "item 1"]
    assert counts == [3, 3, 4, 4] and drawn == [0, 1, 2, 3]
    feed.want = 0
    with pytest.raises(pipec.PipecError, match="already taken"):
        next(feed)
    with pytest.raises(pipec.PipecError, match="twice in one forward"):
        next(feed)


def varlen_call(s, variable: bool, cp: int = 1, seq: int = 8):
    """Rank 0 of a pp=2 looped schedule, called with a model config that says
    ``variable_seq_lengths``: everything before the first instruction runs."""
    config = types.SimpleNamespace(
        num_microbatches_with_partial_activation_checkpoints=None,
        variable_seq_lengths=variable,
        sequence_parallel=False,
    )
    chunk = Chunk(pre=True)
    chunk.config = config
    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    size = types.SimpleNamespace(size=lambda: cp)
    return pm.forward_backward_func(s)(
        forward_step_func=None,
        data_iterator=iter(()),
        model=[chunk],
        num_microbatches=s.num_microbatches,
        seq_length=seq,
        micro_batch_size=1,
        p2p_communicator=types.SimpleNamespace(pp_group=group),
        pg_collection=types.SimpleNamespace(cp=size, tp=size),
    )


def test_variable_seq_lengths_needs_a_plan_with_lengths():
    """Megatron exchanges each message's shape under variable_seq_lengths; pipec.megatron
    exchanges none, so a plan without lengths has nothing to size the receives from."""
    with pytest.raises(
        pipec.PipecError, match=r"carries no microbatch lengths.*lengths=\[\.\.\.\]"
    ):
        varlen_call(pipec.compile("1f1b", 2, 4), variable=True)


def test_lengths_without_variable_seq_lengths_are_refused_unless_they_are_seq_length():
    """Without variable_seq_lengths every Megatron message is seq_length tokens: a plan whose
    lengths say otherwise is refused, naming the first microbatch that differs; one whose
    lengths are all seq_length agrees with it (checked without running)."""
    s = pipec.compile("1f1b", 2, lengths=[8, 3, 5, 6])
    with pytest.raises(pipec.PipecError, match=r"microbatch 1: 3 tokens.*seq_length=8"):
        varlen_call(s, variable=False)
    config = types.SimpleNamespace(variable_seq_lengths=False)
    pm._check_lengths(pipec.compile("1f1b", 2, lengths=[8, 8, 8, 8]), config, 8, None)
    with pytest.raises(pipec.PipecError, match="microbatch 0: 8 tokens"):
        pm._check_lengths(pipec.compile("1f1b", 2, lengths=[8, 8, 8, 8]), config, 16, None)


def test_lengths_must_split_over_context_parallel_ranks():
    s = pipec.compile("1f1b", 2, lengths=[8, 6, 3, 4])
    with pytest.raises(pipec.PipecError, match="microbatch 2 has 3 tokens.*2 equal parts"):
        varlen_call(s, variable=True, cp=2)


def test_a_tensor_of_another_shape_than_the_plans_is_not_sent():
    """The receiver allocates from the plan; the sender checks its tensor against the same
    plan before posting it (a batch of other lengths than the plan's is the user's error)."""
    import torch

    s = pipec.compile("1f1b", 2, lengths=[8, 3, 5, 6])
    send = next(i for i in s.instructions(0) if i.op.name == "send" and i.mb == 1)
    assert send.tokens == 3
    ex = types.SimpleNamespace(
        variable=True, seq_divisor=1, tensor_shape=[8, 2, 16], rank=0, kw={"seq_length": 8}
    )
    ex._shape = lambda ins: pm._Executor._shape(ex, ins)
    pm._Executor._check_sent(ex, send, torch.zeros(3, 2, 16))  # the plan's shape
    with pytest.raises(pipec.PipecError) as e:
        pm._Executor._check_sent(ex, send, torch.zeros(8, 2, 16))
    assert "activation of stage 0, microbatch 1 has shape [8, 2, 16], but the plan's 3 " in str(
        e.value
    )


def test_pinned_megatron_core_version():
    import megatron.core

    # The wheel's version carries a local build tag: 0.19.2+3370bb4.
    assert megatron.core.__version__.split("+")[0] == pm.MEGATRON_CORE_VERSION


# --------------------------------------------------------------------------- the example


def test_docs_show_the_example_script():
    doc = (REPO / "docs" / "megatron.md").read_text()
    m = re.search(
        r"<!-- python/examples/megatron_train.py -->\n```python\n(.*?)```", doc, re.DOTALL
    )
    assert m, "docs/megatron.md embeds python/examples/megatron_train.py"
    assert m.group(1) == EXAMPLE.read_text()
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Megatron-LM") :]
    assert "python/examples/megatron_train.py" in section[: section.index("\n### ")]


LENGTHS_EXAMPLE = REPO / "python" / "examples" / "megatron_lengths.py"


def test_docs_show_the_lengths_example():
    doc = (REPO / "docs" / "megatron.md").read_text()
    m = re.search(
        r"<!-- python/examples/megatron_lengths.py -->\n```python\n(.*?)```", doc, re.DOTALL
    )
    assert m, "docs/megatron.md embeds python/examples/megatron_lengths.py"
    assert m.group(1) == LENGTHS_EXAMPLE.read_text()


def test_the_lengths_example_trains(tmp_path):
    """Packed documents of random lengths, a ZB-V plan compiled per step from them, on two CPU
    processes under variable_seq_lengths (the script unchanged, the CPU patches first): it
    learns the counting documents."""
    runner = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import megatron_cpu; "
        "runpy.run_path(sys.argv[2], run_name='__main__')"
    )
    here = str(Path(__file__).resolve().parent)
    argv = [sys.executable, "-c", runner, here, str(LENGTHS_EXAMPLE)]
    ok, logs = launch.launch(lambda r, port: argv, 2, tmp_path, LAUNCH_TIMEOUT)
    assert ok, logs
    steps = re.findall(r"step \d+: loss ([0-9.]+) \((\d+) tokens\)", logs)
    assert len(steps) == 3, logs
    losses = [float(x) for x, _ in steps]
    assert losses[-1] < losses[0] - 0.2, logs
    assert len({n for _, n in steps}) > 1, logs  # the batches had other lengths


def test_the_example_script_trains(tmp_path):
    """ZB-V on two CPU processes, the script unchanged; only the test-only CPU patches are
    imported first."""
    runner = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import megatron_cpu; "
        "runpy.run_path(sys.argv[2], run_name='__main__')"
    )
    here = str(Path(__file__).resolve().parent)
    argv = [sys.executable, "-c", runner, here, str(EXAMPLE)]
    ok, logs = launch.launch(lambda r, port: argv, 2, tmp_path, LAUNCH_TIMEOUT)
    assert ok, logs
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", logs)]
    assert len(losses) == 3, logs
    assert losses[-1] < losses[0], logs
    # Regression (#29): the script printed the loss divided by the 8 microbatches (its
    # detach() shared storage with the tensor megatron-core divides in place). Next-token
    # cross-entropy on random tokens starts near ln(vocab = 64) = 4.16; divided, <= 0.52.
    assert losses[0] > math.log(64) / 2, logs
