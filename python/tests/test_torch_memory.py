"""Memory instructions (issue 30) on torch's runtime: ``offload``, ``reload``,
``wait_offload``, ``recompute`` and checkpointed forwards, executed by
:class:`pipec.torch.SavedActivations`.

Two layers. In one process, the store against plain autograd and ``torch.utils.checkpoint``:
a forward whose activations go to the host and come back, or are dropped and recomputed (with
dropout, so the RNG replay is checked), gives bit-identical gradients; a host copy altered
while offloaded changes them (the backward really reads what was reloaded); a backward before
its reload or recompute is refused. Across processes (CPU, gloo, like ``test_torch_train``):
schedules compiled by pipec, with memory instructions added to their rank files as another
tool would write them and sealed, train two SGD steps through ``pipec.torch.build_schedule``
with every loss and gradient equal to the unpipelined model's (relative error <= 1e-10, the
tolerance of ``test_torch_train``), and each rank's trace shows the activations on the host
and off the device between each offload and its reload, and off the device between each
checkpointed forward and its recompute.
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

import launch
import pipec
import pipec.torch as pt
from torch.distributed.pipelining import PipelineStageInfo

TOL = 1e-10
LAUNCH_TIMEOUT = 300
WORLD = 4


# --------------------------------------------------------------------------- one process


class _Handle:
    """The handle ``register_forward_context`` returns (torch's ``RemovableHandle``)."""

    def __init__(self, stage):
        self.stage = stage

    def remove(self):
        self.stage.context = None


class _Stage:
    """What ``pipec.torch.SavedActivations`` uses of a torch ``PipelineStage``: its index,
    module and device, ``register_forward_context``, and ``forward_maybe_with_nosync``, called
    inside the context as ``forward_one_chunk`` calls it (test_compat checks that torch's
    stage does so)."""

    def __init__(self, module: torch.nn.Module, index: int = 0):
        self.stage_index = index
        self.submod = module
        self.device = torch.device("cpu")
        self.context = None

    def register_forward_context(self, factory):
        if self.context is not None:
            raise RuntimeError("A pipeline forward context is already registered")
        self.context = factory
        return _Handle(self)

    def forward_maybe_with_nosync(self, *args, **kwargs):
        return self.submod(*args, **kwargs)

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        info = PipelineStageInfo(stage_index=self.stage_index, microbatch_index=mb)
        with self.context(info):
            return self.forward_maybe_with_nosync(x)


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(3)
    d = torch.float64
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7, dtype=d),
        torch.nn.Tanh(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(7, 4, dtype=d),
        torch.nn.Tanh(),
    )


def _input() -> torch.Tensor:
    return torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in model.parameters())]


def _reference(dropout: float = 0.0, seed: int = 11):
    """Gradients of the plain forward and backward (no hooks), under ``seed``."""
    model, x = _model(dropout), _input().requires_grad_()
    torch.manual_seed(seed)
    model(x).sum().backward()
    return _grads(model, x)


def _managed(checkpoint: bool, dropout: float = 0.0):
    model = _model(dropout)
    st = _Stage(model)
    keys = {(0, 0)}
    store = pt.SavedActivations([st], keys if checkpoint else set(), set() if checkpoint else keys)
    store.attach()
    return model, st, store


def test_offload_and_reload_give_the_plain_gradients():
    """The activations go to a separate host copy (the store holds no device tensor of them
    between offload and reload) and come back; the gradients are the plain ones bit for bit."""
    want = _reference()
    model, st, store = _managed(checkpoint=False)
    x = _input().requires_grad_()
    out = st.forward(0, x)
    entry = store._entries[(0, 0)]
    managed = entry.managed()
    # Linear saves its input (tanh's output, an activation) and the weight (kept); tanh its
    # output: the stage input and the parameters stay, the two tanh outputs are managed.
    assert len(managed) >= 2 and len(entry.saved) > len(managed)
    before = [h.tensor.clone() for h in managed]
    store.offload(0, 0)
    assert all(h.tensor is None and h.host is not None for h in managed)
    store.wait_offload(0, 0)
    store.reload(0, 0)
    assert all(torch.equal(h.tensor, b) for h, b in zip(managed, before, strict=True))
    assert store.pending() == []
    out.sum().backward()
    for g, w in zip(_grads(model, x), want, strict=True):
        assert torch.equal(g, w)
    ops = [(e.op, e.device > 0, e.host > 0) for e in store.events]
    assert ops == [
        ("fwd", True, False),
        ("offload", False, True),
        ("wait_offload", False, True),
        ("reload", True, False),
    ]
    nbytes = store.events[0].device
    assert store.events[1].host == store.events[1].host_total == nbytes
    assert store.events[3].device == nbytes and store.events[3].host_total == 0


def test_the_backward_reads_the_reloaded_copy():
    """A host copy changed while offloaded changes the gradients: the backward reads what
    came back, not a device tensor left behind."""
    want = _reference()
    model, st, store = _managed(checkpoint=False)
    x = _input().requires_grad_()
    out = st.forward(0, x)
    store.offload(0, 0)
    for h in store._entries[(0, 0)].managed():
        h.host.mul_(2)
    store.reload(0, 0)
    out.sum().backward()
    assert not all(torch.equal(g, w) for g, w in zip(_grads(model, x), want, strict=True))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_checkpoint_and_recompute_give_the_plain_gradients(dropout):
    """A checkpointed forward keeps no activation; the recompute rebuilds them under the
    forward's RNG state (dropout draws the same mask though the RNG moved on in between):
    gradients equal the plain run's and ``torch.utils.checkpoint``'s bit for bit."""
    want = _reference(dropout)
    model, st, store = _managed(checkpoint=True, dropout=dropout)
    x = _input().requires_grad_()
    torch.manual_seed(11)
    out = st.forward(0, x)
    managed = store._entries[(0, 0)].managed()
    assert managed and all(h.tensor is None and h.host is None for h in managed)
    torch.rand(1000)  # the RNG moves on before the recompute
    store.recompute(0, 0)
    out.sum().backward()
    for g, w in zip(_grads(model, x), want, strict=True):
        assert torch.equal(g, w)
    # torch's own checkpoint, same seed.
    ref_model, ref_x = _model(dropout), _input().requires_grad_()
    torch.manual_seed(11)
    torch.utils.checkpoint.checkpoint(ref_model, ref_x, use_reentrant=False).sum().backward()
    for g, w in zip(_grads(model, x), _grads(ref_model, ref_x), strict=True):
        assert torch.equal(g, w)
    (f, r) = store.events
    assert (f.op, f.device, f.host) == ("fwd_checkpoint", 0, 0)
    assert r.op == "recompute" and r.device > 0 and r.host == 0


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_backward_before_its_reload_or_recompute_is_refused(checkpoint):
    _, st, store = _managed(checkpoint)
    out = st.forward(0, _input().requires_grad_())
    if not checkpoint:
        store.offload(0, 0)
    what = "dropped" if checkpoint else "in host memory"
    with pytest.raises(pipec.PipecError, match=what):
        out.sum().backward()


def test_steps_out_of_order_are_refused():
    _, st, store = _managed(checkpoint=False)
    with pytest.raises(pipec.PipecError, match=r"offload\(stage 0, mb 0\): no managed forward"):
        store.offload(0, 0)
    st.forward(0, _input().requires_grad_())
    with pytest.raises(pipec.PipecError, match=r"reload\(stage 0, mb 0\).*device, expected host"):
        store.reload(0, 0)
    with pytest.raises(pipec.PipecError, match="wait_offload.*no offload"):
        store.wait_offload(0, 0)
    with pytest.raises(pipec.PipecError, match="ran again before"):
        st.forward(0, _input().requires_grad_())


def test_a_recompute_that_differs_from_the_forward_is_refused():
    class Changing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x.tanh() if self.calls == 1 else x.tanh().tanh()

    st = _Stage(Changing())
    store = pt.SavedActivations([st], {(0, 0)}, set())
    store.attach()
    st.forward(0, _input().requires_grad_())
    with pytest.raises(pipec.PipecError, match="must do what the forward did"):
        store.recompute(0, 0)


def test_detach_frees_the_stage_for_another_runtime():
    """A second store on the same stage is refused until the first one detaches; after that
    its forward runs without hooks (nothing is managed)."""
    _, st, store = _managed(checkpoint=False)
    second = pt.SavedActivations([st], set(), {(0, 0)})
    with pytest.raises(pipec.PipecError, match="detach"):
        second.attach()
    store.detach()
    second.attach()
    st.forward(0, _input().requires_grad_())
    assert second.pending() == [(0, 0)] and store.pending() == []


def test_a_stage_with_its_own_forward_context_is_refused():
    st = _Stage(_model())
    st.register_forward_context(lambda info: None)
    with pytest.raises(pipec.PipecError, match="forward context"):
        pt.SavedActivations([st], {(0, 0)}, set()).attach()


# --------------------------------------------------------------------------- schedules


def _batch_boundary(ins: list[dict], x: int) -> bool:
    """Whether inserting before position ``x`` splits no comm batch (consecutive send/recv
    of one batch number)."""
    if x in (0, len(ins)):
        return True
    a, b = ins[x - 1], ins[x]
    return not ("batch" in a and "batch" in b and a["batch"] == b["batch"])


def _parts(rec: dict) -> list[tuple[str, int, int]]:
    if rec["op"] == "fwd_bwd":
        return [("fwd", rec["fwd_stage"], rec["fwd_mb"]), ("bwd", rec["bwd_stage"], rec["bwd_mb"])]
    if rec["op"] in ("fwd", "bwd", "bwd_D", "bwd_W"):
        return [(rec["op"], rec["stage"], rec["mb"])]
    return []


def with_memory_ops(ins: list[dict], mode: str, rng: random.Random) -> list[dict]:
    """``ins`` (one rank's records) with memory instructions: for each forward (plain or in a
    ``fwd_bwd``) with a backward (``bwd``, ``bwd_D`` or in a ``fwd_bwd``) later on the rank,
    by ``mode``:
    ``offload`` (posted anywhere between the forward and its backward, reloaded anywhere
    between that and the backward, waited for anywhere after it or not at all), ``checkpoint``
    (recomputed anywhere between the forward and its backward; plain forwards only), or
    ``mixed`` (either, or nothing, at random). Never inside a comm batch."""
    ins = [dict(r) for r in ins]
    adds: list[tuple[int, int, dict]] = []  # (position, order, record)
    n = len(ins)

    def pick(lo: int, hi: int) -> int:
        return rng.choice([x for x in range(lo, hi + 1) if _batch_boundary(ins, x)])

    for i, rec in enumerate(ins):
        fwd = [(s, m) for p, s, m in _parts(rec) if p == "fwd"]
        if not fwd:
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
        choice = mode if mode != "mixed" else rng.choice(["offload", "checkpoint", "none"])
        if rec["op"] == "fwd_bwd" and choice == "checkpoint":
            choice = "none"  # only a plain forward is checkpointed; an overlapped one offloads
        task = {"stage": t[0], "mb": t[1]}
        if choice == "offload":
            a = pick(i + 1, need)
            adds.append((a, len(adds), {"op": "offload", **task}))
            adds.append((pick(a, need), len(adds), {"op": "reload", **task}))
            if rng.random() < 0.5:
                adds.append((pick(a, n), len(adds), {"op": "wait_offload", **task}))
        elif choice == "checkpoint":
            rec["checkpoint"] = True
            adds.append((pick(i + 1, need), len(adds), {"op": "recompute", **task}))
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


def memory_schedule(path, compile_kwargs: dict, mode: str, seed: int) -> pipec.Schedule:
    """A compiled schedule with memory instructions on every rank (``with_memory_ops``),
    written into its JSON rank files, sealed and loaded (so verified)."""
    pipec.compile(**compile_kwargs).save(path)
    rng = random.Random(seed)
    for f in sorted(path.glob("rank-*.json")):
        doc = json.loads(f.read_text())
        doc["instructions"] = with_memory_ops(doc["instructions"], mode, rng)
        f.write_text(json.dumps(doc))
    pipec.seal(path)
    return pipec.load(path)


# (name, compile kwargs, mode, seed): pp=2 with 4 microbatches (test_torch_train's small size)
# unless the kwargs say otherwise.
MEMORY_CASES = [
    ("1f1b-offload", {"schedule": "1f1b"}, "offload", 1),
    ("1f1b-checkpoint", {"schedule": "1f1b"}, "checkpoint", 2),
    ("1f1b-combined-offload", {"schedule": "1f1b", "combined": True}, "offload", 3),
    ("1f1b-combined-mixed", {"schedule": "1f1b", "combined": True}, "mixed", 3),
    ("interleaved-1f1b-mixed", {"schedule": "interleaved-1f1b", "vpp": 2}, "mixed", 4),
    ("zb-h1-offload", {"schedule": "zb-h1"}, "offload", 5),
    ("zb-h1-checkpoint", {"schedule": "zb-h1"}, "checkpoint", 6),
    ("zb-v-mixed", {"schedule": "zb-v"}, "mixed", 7),
    ("gpipe-mixed", {"schedule": "gpipe"}, "mixed", 8),
    (
        "interleaved-1f1b-pp4-mixed",
        {"schedule": "interleaved-1f1b", "vpp": 2, "pp": 4, "microbatches": 8},
        "mixed",
        9,
    ),
]


def _size(kw: dict) -> dict:
    return {"pp": 2, "microbatches": 4, **kw}


def _counts(s: pipec.Schedule) -> dict[str, int]:
    c: dict[str, int] = {}
    for r in range(s.pp):
        for i in s.instructions(r):
            name = i.op.name + ("_checkpoint" if i.checkpoint else "")
            c[name] = c.get(name, 0) + 1
    return c


def test_the_cases_hold_what_they_test(tmp_path):
    """Each case's sealed schedule verifies with the memory instructions its mode asks for."""
    for name, kw, mode, seed in MEMORY_CASES:
        s = memory_schedule(tmp_path / name, _size(kw), mode, seed)
        c = _counts(s)
        if mode != "checkpoint":
            assert c.get("offload", 0) == c.get("reload", 0) > 0, (name, c)
        if mode != "offload":
            assert c.get("fwd_checkpoint", 0) == c.get("recompute", 0) > 0, (name, c)


def test_torch_csv_refuses_them_and_actions_carry_them(tmp_path):
    s = memory_schedule(
        tmp_path / "s", {"schedule": "1f1b", "pp": 2, "microbatches": 4}, "mixed", 3
    )
    with pytest.raises(pipec.TorchExportError, match="torch's schedule CSV has no action"):
        s.to_torch_csv()
    acts = pt.actions(s)
    for r in range(s.pp):
        mine = [a for a in acts[r] if isinstance(a.computation_type, pt.MemoryAction)]
        want = [
            (i.op.name.upper(), i.stage, i.mb)
            for i in s.instructions(r)
            if i.op.name in ("offload", "reload", "wait_offload", "recompute")
        ]
        got = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in mine]
        assert got == want
        # A checkpointed forward is torch's forward.
        fwds = [
            (a.stage_index, a.microbatch_index)
            for c in acts[r]
            for a in c.sub_actions or (c,)
            if a.computation_type == pt._ComputationType.FORWARD
        ]
        want_fwds = [
            (i.stage, i.mb) if i.op.name == "fwd" else (i.fwd.stage, i.fwd.mb)
            for i in s.instructions(r)
            if i.op.name in ("fwd", "fwd_bwd")
        ]
        assert fwds == want_fwds and any(i.checkpoint for i in s.instructions(r))


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained_dirs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("memdirs")
    dirs = {}
    for name, kw, mode, seed in MEMORY_CASES:
        dirs[name] = out / name
        memory_schedule(dirs[name], _size(kw), mode, seed)
    return dirs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trained_dirs):
    out = tmp_path_factory.mktemp("memtrain")
    pp = {name: _size(kw)["pp"] for name, kw, _, _ in MEMORY_CASES}
    configs = [
        {"name": name, "pp": pp[name], "tol": TOL, "dir": str(d), "deep": True}
        for name, d in trained_dirs.items()
    ]
    return launch.train_all(configs, WORLD, out, LAUNCH_TIMEOUT)


def _trace_holds(events: list[list], sched: pipec.Schedule, rank: int) -> None:
    """The rank's memory trace of the last step against its program: one event per memory
    instruction and managed forward, in program order; after an offload the activations are
    on the host and not on the device, after its reload back on the device with the host
    empty of them; a checkpointed forward leaves nothing, its recompute the activations."""
    ev = [pt.MemoryEvent(*e) for e in events]
    want = []
    managed = set()
    for i in sched.instructions(rank):
        if i.op.name in ("offload", "recompute"):
            managed.add((i.stage, i.mb))
    for i in sched.instructions(rank):
        n = i.op.name
        if n == "fwd" and (i.checkpoint or (i.stage, i.mb) in managed):
            want.append(("fwd_checkpoint" if i.checkpoint else "fwd", i.stage, i.mb))
        elif n == "fwd_bwd" and (i.fwd.stage, i.fwd.mb) in managed:
            want.append(("fwd", i.fwd.stage, i.fwd.mb))
        elif n in ("offload", "reload", "wait_offload", "recompute"):
            want.append((n, i.stage, i.mb))
    assert [(e.op, e.stage, e.mb) for e in ev] == want
    size = {}
    for e in ev:
        key = (e.stage, e.mb)
        if e.op == "fwd":
            assert e.device > 0 and e.host == 0, e
            size[key] = e.device
        elif e.op == "fwd_checkpoint":
            assert e.device == 0 and e.host == 0, e
        elif e.op == "offload":
            assert e.device == 0 and e.host == size[key] and e.host_total >= e.host, e
        elif e.op == "reload":
            assert e.device == size[key] and e.host == 0, e
        elif e.op == "recompute":
            assert e.device > 0 and e.host == 0, e
    assert ev[-1].host_total == 0 if ev else True
    # The host held activations at some point when the rank offloads.
    if any(e.op == "offload" for e in ev):
        assert max(e.host_total for e in ev) > 0


@pytest.mark.parametrize("name", [c[0] for c in MEMORY_CASES])
def test_memory_schedules_train_like_the_unpipelined_model(trained, trained_dirs, name):
    results = trained[0]
    sched = pipec.load(trained_dirs[name])
    for res in launch.rank_results(trained, name, sched.pp):
        assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL
        assert res["grads_compared"] > 0
    # Every stage's gradients, and the losses of every microbatch on the last stage.
    stages = sorted(s for r in range(sched.pp) for s in results[(name, r)]["stages"])
    assert stages == list(range(sched.num_stages))
    assert sum(results[(name, r)]["losses_compared"] for r in range(sched.pp)) > 0
    for r in range(sched.pp):
        _trace_holds(results[(name, r)].get("memory_events", []), sched, r)


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs
