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
    res, _, logs = results[pp]
    got = []
    for r in range(pp):
        d = res.get((name, r))
        if d is None:
            pytest.fail(f"{name}: rank {r} reported nothing (hang or crash)\n{logs}")
        if not d["ok"]:
            pytest.fail(f"{name}: rank {r}: {d['error']}\n{logs}")
        got.append(d)
    return got


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


def test_refuses_forwards_out_of_microbatch_order(tmp_path):
    """#41: pipec.megatron applies the Rust rule (``Schedule.refusal("megatron")``, what
    ``pipec tune --target megatron`` filters by) in its own words: Megatron's data iterators
    hand out microbatches in order, so every stage runs its forwards in that order."""
    from test_api import forwards_out_of_order

    s = forwards_out_of_order(tmp_path)
    assert "out of microbatch order (0 after 1)" in s.refusal("megatron")
    assert pm.stage_indices(s, 0) == [0]  # the placement is fine
    with pytest.raises(pipec.PipecError) as e:
        pm.forward_backward_func(s)
    assert str(e.value) == (
        "gpipe runs the forwards of stage 0 (rank 0) in the order [1, 0]; Megatron's data "
        "iterators hand out microbatches in order, so the microbatches would get the wrong "
        "data. Refusing to run it"
    )
    with pytest.raises(pipec.PipecError) as e:
        pm.stage_indices(pipec.compile("dualpipe", 2, 4), 0)
    assert str(e.value) == (
        "dualpipe places every stage on two ranks (one copy per direction, with their "
        "gradients summed); a Megatron model chunk lives on one rank, so pipec.megatron "
        "cannot run it (use dualpipe-v, its V-shaped form)"
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
