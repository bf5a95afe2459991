"""``offload``, ``reload`` and ``wait_offload`` (issue 30) executed by ``pipec.megatron``, on a
CPU over gloo, against megatron-core 0.19.2's own computations.

One launch of 2 processes (``megatron_worker.py``, as ``test_megatron``) trains the small
megatron-core GPTModel two SGD steps with schedules that offload activations: compiled 1F1B,
interleaved 1F1B (Megatron's outputs deallocated), its combined F&B form, ZB-V (split backward,
the V turn) and Megatron's partial recompute (1F1B and interleaved), with offloads, reloads and waits added to their
rank files as another tool would write them and sealed (so verified), and two winners of
``pipec.tune(..., target="torch")`` under a memory limit, fitted with offload by the tuner.
Every microbatch loss and parameter gradient equals Megatron's ``forward_backward_no_pipelining``
on the full model (max abs difference <= TOL, test_megatron's tolerance), and where Megatron has
the schedule, its own schedule function's (partial recompute: the same checkpoint flags). Each
rank's memory trace shows the activations on the host and off the device from each offload to
its reload; and a run whose reloads alter the host copies gets other gradients (the backward
reads what came back from the host). Refusals are checked in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import types

import pytest

if os.environ.get("CI") == "true":
    import megatron.core  # noqa: F401  (under CI nothing may be skipped)
    import torch
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (test.sh installs it)"
    )

import launch
import pipec
import pipec.megatron as pm
from pipec import _offload
from test_megatron import (
    L2,
    L2_1,
    LAUNCH_TIMEOUT,
    MG_1F1B,
    MG_INTERLEAVED,
    OVERLAP,
    TOL,
    Chunk,
    call,
    megatron_cfg,
)
from test_torch_memory import _batch_boundary, _parts

DEALLOCATE = {"deallocate_pipeline_outputs": True}


def with_offloads(ins: list[dict], rng: random.Random, share: float) -> list[dict]:
    """``ins`` (one rank's records) with each forward that has a backward later on the rank
    (plain, not checkpointed, or the forward of a ``fwd_bwd``) offloaded with probability
    ``share``: the offload anywhere between the forward and its backward, the reload anywhere
    between the offload and the backward, a ``wait_offload`` after the offload half the time.
    Never inside a comm batch."""
    ins = [dict(r) for r in ins]
    adds: list[tuple[int, int, dict]] = []
    n = len(ins)

    def pick(lo: int, hi: int) -> int:
        return rng.choice([x for x in range(lo, hi + 1) if _batch_boundary(ins, x)])

    for i, rec in enumerate(ins):
        fwd = [(s, m) for p, s, m in _parts(rec) if p == "fwd"]
        if not fwd or rec.get("checkpoint") or rng.random() >= share:
            continue
        t = fwd[0]
        need = next(
            (
                j
                for j in range(i + 1, n)
                if any(p in ("bwd", "bwd_D") and (s, m) == t for p, s, m in _parts(ins[j]))
            ),
            None,
        )
        if need is None:
            continue
        task = {"stage": t[0], "mb": t[1]}
        a = pick(i + 1, need)
        adds.append((a, len(adds), {"op": "offload", **task}))
        adds.append((pick(a, need), len(adds), {"op": "reload", **task}))
        if rng.random() < 0.5:
            adds.append((pick(a, n), len(adds), {"op": "wait_offload", **task}))
    out: list[dict] = []
    adds.sort(key=lambda a: (a[0], a[1]))
    k = 0
    for x, rec in enumerate(ins):
        while k < len(adds) and adds[k][0] == x:
            out.append(adds[k][2])
            k += 1
        out.append(rec)
    out.extend(a[2] for a in adds[k:])
    return out


def offload_schedule(path, compile_kwargs: dict, seed: int, share: float) -> pipec.Schedule:
    """A compiled schedule with offloads on every rank, written into its JSON rank files,
    sealed and loaded (so verified)."""
    pipec.compile(**compile_kwargs).save(path)
    rng = random.Random(seed)
    for f in sorted(path.glob("rank-*.json")):
        doc = json.loads(f.read_text())
        doc["instructions"] = with_offloads(doc["instructions"], rng, share)
        f.write_text(json.dumps(doc))
    pipec.seal(path)
    return pipec.load(path)


def edited(name, compare_with, compile_kwargs, seed, share, p2p=None, **extra):
    """A pipec configuration of megatron_worker.py running an offloading schedule (built into
    its ``dir`` by the fixture)."""
    cfg = {"name": name, "build": ("edit", compile_kwargs, seed, share), **extra}
    if compare_with:
        cfg["compare_with"] = compare_with
    if p2p:
        cfg["p2p"] = p2p
    return cfg


# The tuner's torch winners at pp=2, M=4, 4 layers under a limit of 2 and 3 activation units:
# pipec's own scheduler (split backward), looped and V-shaped, fitted with offload.
TUNED = {
    "tuned-looped-offload-pp2": 2,
    "tuned-v-offload-pp2": 3,
}
TUNE = {"pp": 2, "microbatches": 4, "num_layers": 4, "cost": "f=1,b=1,w=1", "recompute": False}

CONFIGS = [
    megatron_cfg("megatron-1f1b-pp2", MG_1F1B, L2_1, 4),
    megatron_cfg("megatron-interleaved-overlap-pp2", MG_INTERLEAVED, L2, 4, 2, **OVERLAP),
    dict(megatron_cfg("megatron-1f1b-recompute-pp2", MG_1F1B, L2_1, 4), recompute=1),
    dict(
        megatron_cfg("megatron-interleaved-recompute-pp2", MG_INTERLEAVED, L2, 4, 2, **OVERLAP),
        recompute=2,
    ),
    # Every forward offloaded.
    edited(
        "1f1b-offload-pp2",
        "megatron-1f1b-pp2",
        {"schedule": "1f1b", "pp": 2, "microbatches": 4, "layout": L2_1},
        1,
        1.0,
    ),
    # Megatron's overlap mode (outputs deallocated after their send), some forwards offloaded.
    edited(
        "interleaved-1f1b-offload-pp2",
        "megatron-interleaved-overlap-pp2",
        {"schedule": "interleaved-1f1b", "vpp": 2, "pp": 2, "microbatches": 4, "layout": L2},
        2,
        0.6,
        p2p=DEALLOCATE,
    ),
    # Megatron's partial recompute on the checkpointed forwards, offload on all the others.
    edited(
        "1f1b-recompute-offload-pp2",
        "megatron-1f1b-recompute-pp2",
        {
            "schedule": "1f1b",
            "pp": 2,
            "microbatches": 4,
            "layout": L2_1,
            "megatron_partial_recompute": 1,
        },
        3,
        1.0,
        recompute=1,
    ),
    # The same, interleaved, with Megatron's outputs deallocated.
    edited(
        "interleaved-1f1b-recompute-offload-pp2",
        "megatron-interleaved-recompute-pp2",
        {
            "schedule": "interleaved-1f1b",
            "vpp": 2,
            "pp": 2,
            "microbatches": 4,
            "layout": L2,
            "megatron_partial_recompute": 2,
        },
        6,
        1.0,
        p2p=DEALLOCATE,
        recompute=2,
    ),
    edited(
        "interleaved-1f1b-combined-offload-pp2",
        None,
        {
            "schedule": "interleaved-1f1b",
            "vpp": 2,
            "pp": 2,
            "microbatches": 4,
            "layout": L2,
            "combined": True,
        },
        4,
        1.0,
    ),
    edited(
        "zb-v-offload-pp2",
        None,
        {"schedule": "zb-v", "pp": 2, "microbatches": 4, "layout": L2},
        5,
        1.0,
        p2p=DEALLOCATE,
    ),
    *({"name": n, "build": ("tune", limit)} for n, limit in TUNED.items()),
    # Last (its reloads stay altered in the process): 1f1b-offload-pp2 with every reload
    # adding 1 to the host copies first.
    dict(
        edited(
            "1f1b-offload-poisoned-pp2",
            None,
            {"schedule": "1f1b", "pp": 2, "microbatches": 4, "layout": L2_1},
            1,
            1.0,
        ),
        poison_reload=True,
    ),
]
RUNS = [c["name"] for c in CONFIGS if "build" in c and not c.get("poison_reload")]


def _build(cfg: dict, path) -> pipec.Schedule:
    how = cfg["build"]
    if how[0] == "edit":
        return offload_schedule(path, *how[1:])
    s, _report = pipec.tune(**TUNE, memory_limit=how[1], target="torch")
    s.save(path)
    return pipec.load(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pipec.Schedule]:
    root = tmp_path_factory.mktemp("megatron-offload-dirs")
    out = {}
    for cfg in CONFIGS:
        if "build" in cfg:
            cfg["dir"] = str(root / cfg["name"])
            out[cfg["name"]] = _build(cfg, root / cfg["name"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, built):
    d = tmp_path_factory.mktemp("megatron-offload")
    configs = [{k: v for k, v in c.items() if k != "build"} for c in CONFIGS]
    return launch.train_all(configs, 2, d, LAUNCH_TIMEOUT, worker="megatron_worker.py")


def ranks_of(results, name: str) -> list[dict]:
    return launch.rank_results(results, name, 2)


def _counts(s: pipec.Schedule) -> dict[str, int]:
    c: dict[str, int] = {}
    for r in range(s.pp):
        for i in s.instructions(r):
            name = i.op.name + ("_checkpoint" if i.checkpoint else "")
            c[name] = c.get(name, 0) + 1
    return c


def test_the_cases_hold_what_they_test(built):
    """Every schedule offloads and reloads, the partial-recompute one checkpoints and
    recomputes too, and the tuned winners are the tuner's own offloading fits (split
    backward), one looped and one V-shaped, with Megatron's data order."""
    for name, s in built.items():
        c = _counts(s)
        assert c.get("offload", 0) == c.get("reload", 0) > 0, (name, c)
    assert sum(_counts(s).get("wait_offload", 0) for s in built.values()) > 0
    for name in ("1f1b-recompute-offload-pp2", "interleaved-1f1b-recompute-offload-pp2"):
        c = _counts(built[name])
        assert c["fwd_checkpoint"] == c["recompute"] > 0, (name, c)
    assert _counts(built["zb-v-offload-pp2"]).get("bwd_D", 0) > 0
    assert _counts(built["interleaved-1f1b-combined-offload-pp2"]).get("fwd_bwd", 0) > 0
    placements = set()
    for name in TUNED:
        s = built[name]
        assert s.kind == "tuned" and _counts(s).get("bwd_W", 0) > 0, name
        placements.add(s.placement)
    assert placements == {"looped", "v"}


def _trace_holds(events: list[list], sched: pipec.Schedule, rank: int) -> None:
    """The rank's memory trace of the last step against its program: one event per offloaded
    forward and per copy instruction, in program order; after an offload the activations are
    on the host and not on the device, after its reload back on the device and off the host."""
    ev = [_offload.MemoryEvent(*e) for e in events]
    ins = sched.instructions(rank)
    offloaded = {(i.stage, i.mb) for i in ins if i.op == pipec.Op.offload}
    want = []
    for i in ins:
        if i.op == pipec.Op.fwd and (i.stage, i.mb) in offloaded:
            want.append(("fwd", i.stage, i.mb))
        elif i.op == pipec.Op.fwd_bwd and (i.fwd.stage, i.fwd.mb) in offloaded:
            want.append(("fwd", i.fwd.stage, i.fwd.mb))
        elif i.op in (pipec.Op.offload, pipec.Op.reload, pipec.Op.wait_offload):
            want.append((i.op.name, i.stage, i.mb))
    assert [(e.op, e.stage, e.mb) for e in ev] == want
    size = {}
    for e in ev:
        key = (e.stage, e.mb)
        if e.op == "fwd":
            assert e.device > 0 and e.host == 0, e
            size[key] = e.device
        elif e.op == "offload":
            assert e.device == 0 and e.host == size[key] and e.host_total >= e.host, e
        elif e.op == "reload":
            assert e.device == size[key] and e.host == 0, e
    if ev:
        assert ev[-1].host_total == 0
        assert max(e.host_total for e in ev) > 0


@pytest.mark.parametrize("name", RUNS)
def test_offloading_schedule_trains_like_megatron_without_pipelining(results, built, name):
    got = ranks_of(results, name)
    for d in got:
        assert d["loss_diff"] <= TOL, (name, d)
        assert d["grad_diff"] <= TOL, (name, d)
        assert d["grads_compared"] > 0
    assert sorted(s for d in got for s in d["stages"]) == list(range(built[name].num_stages))
    assert sum(d["losses_compared"] for d in got) > 0
    for r, d in enumerate(got):
        _trace_holds(d["memory_events"], built[name], r)


COMPARED = [(c["name"], c["compare_with"]) for c in CONFIGS if "compare_with" in c]


@pytest.mark.parametrize("name,megatron", COMPARED, ids=[n for n, _ in COMPARED])
def test_offloading_equals_megatrons_own_schedule(results, name, megatron):
    """Megatron's own schedule function on the same model and data (without offload) gives the
    same losses and gradients; under partial recompute it passed the same checkpoint flags."""
    for d in ranks_of(results, megatron):
        assert d["loss_diff"] <= TOL and d["grad_diff"] <= TOL, d
    flags = []
    for d in ranks_of(results, name):
        assert d["vs_loss_diff"] <= TOL and d["vs_grad_diff"] <= TOL, d
        assert d["flags"] == d["vs_flags"], d
        flags += d["flags"]
    if "recompute" in name:
        assert True in flags and False in flags, flags


def test_the_backward_reads_what_was_reloaded(results):
    """The same schedule with every reload altering the host copies first (floating-point
    tensors + 1) trains to other gradients: the activations really were on the host from the
    offload to the reload, and the backward used what came back."""
    got = ranks_of(results, "1f1b-offload-poisoned-pp2")
    assert max(d["grad_diff"] for d in got) > 1e-3, got
    assert all(any(e[0] == "reload" for e in d["memory_events"]) for d in got)


def test_all_ranks_exited_cleanly(results):
    _, ok, logs = results
    assert ok, logs


# --------------------------------------------------------------------------- in-process


def test_a_backward_before_its_reload_names_where_it_is():
    """The store's unpack, reached by a backward whose activations are still on the host,
    raises a PipecError naming what the executor says it is running."""
    store = _offload.ActivationStore()
    store.begin_step()
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    entry = store.open((0, 0), checkpoint=False)
    with store.saving(entry):
        y = torch.tanh(x @ w).sum()
    store.settle(entry, _offload._kept_storages(x, torch.nn.Module()))
    store.offload(0, 0)
    store.context = "rank 0, #7: bwd(stage 0, mb 0)"
    with pytest.raises(pipec.PipecError, match=r"rank 0, #7: bwd\(stage 0, mb 0\): .*host memory"):
        y.backward()
    store.reload(0, 0)
    y.backward()
    want = torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0]
    assert torch.equal(w.grad, want)


def test_an_offload_of_storage_freed_outside_autograd_is_refused():
    """An output-discarding checkpoint frees a saved tensor's storage behind autograd
    (``untyped_storage().resize_(0)``, as Megatron's CheckpointWithoutOutput): the offload
    refuses to copy what is no longer there."""
    store = _offload.ActivationStore()
    x = torch.randn(4, requires_grad=True)
    entry = store.open((1, 2), checkpoint=False)
    with store.saving(entry):
        h = x * 2
        y = torch.tanh(h)  # saves its output
    store.settle(entry, _offload._kept_storages(x, torch.nn.Module()))
    y.untyped_storage().resize_(0)
    with pytest.raises(pipec.PipecError, match=r"offload\(stage 1, mb 2\).*released outside"):
        store.offload(1, 2)


def _config(**kw):
    base = {
        "num_microbatches_with_partial_activation_checkpoints": None,
        "variable_seq_lengths": False,
        "pipeline_dtype": torch.float32,
        "recompute_granularity": None,
        "recompute_modules": None,
        "distribute_saved_activations": False,
        "fine_grained_activation_offloading": False,
        "cpu_offloading": False,
        "cuda_graph_impl": "none",
        "enable_cuda_graph": False,
    }
    return types.SimpleNamespace(**{**base, **kw})


class ConfigChunk(Chunk):
    def __init__(self, config, ddp=None, **kw):
        super().__init__(**kw)
        self.config = config
        if ddp is not None:
            self.ddp_config = ddp


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fine_grained_activation_offloading": True}, "fine_grained_activation_offloading"),
        ({"cpu_offloading": True}, "cpu_offloading"),
        ({"cuda_graph_impl": "local"}, "CUDA graphs"),
        ({"enable_cuda_graph": True}, "CUDA graphs"),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm"]},
            r"\['layernorm'\].*CheckpointWithoutOutput",
        ),
        (
            {"recompute_granularity": "full", "distribute_saved_activations": True},
            "distribute_saved_activations",
        ),
        ({"ddp": types.SimpleNamespace(use_megatron_fsdp=True)}, "Megatron-FSDP"),
    ],
)
def test_refuses_to_offload_where_the_hooks_cannot_hold_the_tensors(tmp_path, kw, match):
    """Before anything runs, on a rank that offloads: Megatron's own offloading, CUDA graphs,
    output-discarding recompute, distributed saved activations and Megatron-FSDP are refused,
    naming the setting; the same settings pass on a rank with no offload, and a plain
    config passes the refusals on both (it then fails later, at the stand-in's missing
    process groups)."""
    s = offload_schedule(
        tmp_path / "s", {"schedule": "1f1b", "pp": 2, "microbatches": 4}, seed=1, share=1.0
    )
    ddp = kw.pop("ddp", None)
    fb = pm.forward_backward_func(s)
    chunks = [ConfigChunk(_config(**kw), ddp, pre=True)]
    with pytest.raises(pipec.PipecError, match=r"rank 0 offloads fwd\(stage 0, mb 0\).*" + match):
        call(fb, 2, 0, chunks, 4)
    plain = offload_schedule(
        tmp_path / "p", {"schedule": "1f1b", "pp": 2, "microbatches": 4}, seed=1, share=0.0
    )
    for sched, cfg in ((plain, _config(**kw)), (s, _config())):
        fb = pm.forward_backward_func(sched)
        with contextlib.suppress(AttributeError):  # past the refusals: the stand-in ends here
            call(fb, 2, 0, [ConfigChunk(cfg, None if sched is s else ddp, pre=True)], 4)
