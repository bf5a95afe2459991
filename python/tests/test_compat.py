"""pipec._compat: the version check of the adapters, and one contract test per private or
undocumented part of torch, megatron-core and DeepSpeed that they use (the attribute exists, the
signature has the parameters pipec passes, the returned dict has the keys pipec reads, the
message layout decodes). A release that moves one of them fails here, by name.

In-process and single-process (FSDP2 on a one-rank gloo group over a HashStore). A framework
that is not installed skips its tests, except under CI=true, where that fails.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pipec
import pytest
from pipec import _compat

REPO = Path(__file__).resolve().parents[2]
CI = os.environ.get("CI") == "true"


def _need(module: str):
    """Import ``module``, or skip (fail under CI=true) when it is not installed."""
    if CI:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def _source(obj) -> str:
    return inspect.getsource(obj)


def _params(f) -> list[str]:
    return list(inspect.signature(f).parameters)


def _sets(cls: type, attr: str) -> bool:
    """Whether the source of ``cls`` (any class of its MRO) assigns ``self.<attr>``: instance
    attributes exist only on instances, which these frameworks build only inside a process
    group."""
    pat = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=]*)?=[^=]")
    for c in cls.__mro__:
        if c is object:
            continue
        try:
            if pat.search(_source(c)):
                return True
        except (OSError, TypeError):
            continue
    return False


# --------------------------------------------------------------------------- the version check


def test_release_numbers():
    assert _compat.release("2.15.0") == (2, 15, 0)
    assert _compat.release("2.15.0+cu132") == (2, 15, 0)
    assert _compat.release("2.15.0a0+git1234567") == (2, 15, 0)  # NGC's builds
    assert _compat.release("0.19.2+00e7218") == (0, 19, 2)  # megatron-core's package_info
    assert _compat.release("0.19") == (0, 19, 0)
    assert _compat.release("unknown") is None


def test_tested_versions_are_test_sh_pins():
    """TESTED is exactly what test.sh installs: the check names the versions the suite ran."""
    text = (REPO / "test.sh").read_text()
    deps = re.search(r"py_deps=\((.*?)\)", text, re.DOTALL)
    assert deps, "test.sh lists py_deps"
    pins = dict(p.split("==") for p in deps.group(1).split())
    for name, version in _compat.TESTED.items():
        assert pins[name] == version, name


def test_accepted_ranges():
    assert _compat.accepted_range("torch") == ">=2.15.0,<2.16"
    assert _compat.accepted_range("megatron-core") == ">=0.19.2,<0.20"
    assert _compat.accepted_range("deepspeed") == ">=0.19.8,<0.20"
    for ok in ("2.15.0", "2.15.3", "2.15.0+cu132", "2.15.1a0+git"):
        _compat.check_version("torch", ok, "pipec.torch")
    for bad in ("2.14.9", "2.16.0", "3.0.0", "2.16.0.dev20261101", "unknown"):
        with pytest.raises(pipec.PipecError):
            _compat.check_version("torch", bad, "pipec.torch")
    with pytest.raises(pipec.PipecError):
        _compat.check_version("megatron-core", "0.19.1", "pipec.megatron")  # below the pin


def test_pyproject_extras_are_the_accepted_ranges():
    """pip installs what the import accepts: every extra bounds each framework above, by the
    same range the check applies."""
    text = (REPO / "python" / "pyproject.toml").read_text()
    table = text[text.index("[project.optional-dependencies]") :].split("\n[", 1)[0]
    extras = {
        k: re.findall(r'"([^"]+)"', v)
        for k, v in re.findall(r"^(\w+) = \[(.*)\]$", table, re.MULTILINE)
    }
    want = {name: f"{name}{_compat.accepted_range(name)}" for name in _compat.TESTED}
    assert want["torch"] in extras["torch"]
    assert {want["torch"], want["megatron-core"]} <= set(extras["megatron"])
    assert {want["torch"], want["deepspeed"]} <= set(extras["deepspeed"])


def test_installed_versions_are_accepted():
    """The environment the suite runs in is the tested one (so every other test means it)."""
    torch = _need("torch")
    assert _compat.release(torch.__version__) is not None
    _compat.check_version("torch", torch.__version__)
    for name in ("megatron-core", "deepspeed"):
        v = _compat.installed_version(name)
        if v is None:
            if CI:
                raise AssertionError(f"CI=true: {name} is not installed")
            continue
        _compat.check_version(name, v)


def _fresh(module: str) -> types.ModuleType:
    """Execute ``pipec.<module>``'s file as a new module under another name (the import-time
    check runs again): the imported adapter other tests use stays as it is."""
    name = f"pipec._fresh_{module}"
    path = Path(pipec.__file__).parent / f"{module}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "pipec"
    sys.modules[name] = mod  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


@pytest.fixture
def isolated(monkeypatch):
    """A clean override variable and fresh memory of what was checked and warned."""
    monkeypatch.delenv(_compat.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(_compat, "_verified", set())
    monkeypatch.setattr(_compat, "_warned", set())
    return monkeypatch


def _fake_metadata(monkeypatch, name: str, version: str | None) -> None:
    real = importlib.metadata.version

    def fake(dist):
        if dist == name:
            if version is None:
                raise importlib.metadata.PackageNotFoundError(dist)
            return version
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", fake)


def _refusal(module: str, name: str, fake: str) -> str:
    with pytest.raises(pipec.PipecError) as e:
        _fresh(module)
    msg = str(e.value)
    for part in (
        f"pipec.{module}",
        f"{name} {fake} is installed",
        f"tested with {name} {_compat.TESTED[name]}",
        _compat.accepted_range(name),
        f"{_compat.OVERRIDE_ENV}=1",
    ):
        assert part in msg, (part, msg)
    return msg


def test_untested_torch_is_refused_at_import(isolated):
    torch = _need("torch")
    isolated.setattr(torch, "__version__", "2.16.0")
    _refusal("torch", "torch", "2.16.0")
    _refusal("megatron", "torch", "2.16.0")


def test_untested_megatron_core_is_refused_at_import(isolated):
    _need("torch")
    _fake_metadata(isolated, "megatron-core", "0.20.0")
    _refusal("megatron", "megatron-core", "0.20.0")


def test_untested_deepspeed_is_refused_at_import(isolated):
    _need("torch")
    _fake_metadata(isolated, "deepspeed", "0.18.3")
    _refusal("deepspeed", "deepspeed", "0.18.3")


def test_the_override_runs_anyway_with_a_warning(isolated):
    torch = _need("torch")
    isolated.setattr(torch, "__version__", "2.16.0")
    _fake_metadata(isolated, "megatron-core", "0.20.0")
    isolated.setenv(_compat.OVERRIDE_ENV, "1")
    with pytest.warns(RuntimeWarning, match=_compat.OVERRIDE_ENV) as w:
        mod = _fresh("megatron")
    assert mod.MEGATRON_CORE_VERSION == _compat.TESTED["megatron-core"]
    assert {"torch", "megatron-core"} <= _compat._verified
    assert len(w) == 2  # one per framework
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fresh("megatron")  # warned once per framework: silent now
    isolated.setenv(_compat.OVERRIDE_ENV, "yes")  # only "1" overrides
    isolated.setattr(_compat, "_verified", set())
    with pytest.raises(pipec.PipecError):
        _fresh("megatron")


def test_without_metadata_the_loaded_module_is_checked(isolated):
    """A source checkout on PYTHONPATH has no distribution metadata: the adapter imports (its
    layout helpers need no megatron-core) and the module's own version is checked where the
    adapter first imports megatron-core."""
    _need("torch")
    _fake_metadata(isolated, "megatron-core", None)
    _fresh("megatron")
    assert "megatron-core" not in _compat._verified
    info = _need("megatron.core.package_info")
    isolated.setattr(info, "__version__", "0.20.0+abc")
    with pytest.raises(pipec.PipecError, match=r"megatron-core 0\.20\.0\+abc is installed"):
        _compat.require_loaded("pipec.megatron", "megatron-core")
    isolated.setattr(info, "__version__", "0.19.2+abc")
    _compat.require_loaded("pipec.megatron", "megatron-core")
    assert "megatron-core" in _compat._verified


def test_the_check_is_cheap():
    """Importing the adapters imports neither megatron-core nor DeepSpeed (their metadata is
    read), and pipec.megatron / pipec.deepspeed leave torch.distributed.pipelining unloaded."""
    _need("torch")
    code = (
        "import sys, pipec.megatron, pipec.deepspeed; "
        "print(sorted(m for m in ('megatron.core', 'deepspeed', 'torch.distributed.pipelining') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


# --------------------------------------------------------------------------- torch pipelining


@pytest.fixture(scope="module")
def ts():
    _need("torch")
    from torch.distributed.pipelining import schedules

    return schedules


def test_torch_action(ts):
    A = _compat.torch_action()
    assert A is ts._Action
    assert A._fields == ("stage_index", "computation_type", "microbatch_index", "sub_actions")
    T = _compat.torch_computation_type()
    a = A(1, T.FORWARD, 0)
    pair = A(-1, T.OVERLAP_F_B, None, (a, A(0, T.FULL_BACKWARD, 2)))
    assert (a.stage_index, a.computation_type, a.microbatch_index, a.sub_actions) == (
        1,
        T.FORWARD,
        0,
        None,
    )
    assert pair.sub_actions[1].microbatch_index == 2


def test_torch_computation_type(ts):
    T = _compat.torch_computation_type()
    assert T is ts._ComputationType
    for member in (
        "FORWARD",
        "FULL_BACKWARD",
        "BACKWARD_INPUT",
        "BACKWARD_WEIGHT",
        "UNSHARD",
        "RESHARD",
        "OVERLAP_F_B",
    ):
        assert isinstance(getattr(T, member), T), member
    # Every value pipec's exporter writes names a member (pipec.torch builds T(value)).
    seen = set()
    for s in (
        pipec.compile("zb-v", 2, 4),
        pipec.compile("1f1b", 2, 4, combined=True),
        pipec.compile("interleaved-1f1b", 2, 4, vpp=2),
        pipec.compile("1f1b", 2, 4, forward_only=True),
    ):
        for compute_only in (False, True):
            for line in s.torch_actions(compute_only):
                for cell in line:
                    cells = cell[1:] if cell[0] == "OVERLAP_F_B" else [cell]
                    seen.update(T(c[1]) for c in cells)
    assert {T.FORWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT, T.FULL_BACKWARD} <= seen


def test_torch_schedule_runtime(ts):
    R = _compat.torch_schedule_runtime()
    assert R is ts._PipelineScheduleRuntime
    assert issubclass(R, ts._PipelineSchedule)
    # pipec constructs it with these (through PipelineScheduleMulti.__init__).
    init = next(c.__init__ for c in R.__mro__ if "n_microbatches" in _params(c.__init__))
    assert {"n_microbatches", "loss_fn", "scale_grads"} <= set(_params(init))
    assert callable(R.step) and callable(R.eval)


def test_torch_has_backward(ts):
    assert _sets(ts._PipelineSchedule, "_has_backward")
    runtime = types.SimpleNamespace(_has_backward=True)
    assert _compat.torch_has_backward(runtime) is True


def test_torch_schedule_eval(ts):
    """``_PipelineSchedule.eval`` runs ``step`` with ``_has_backward`` off, which
    PipecScheduleRuntime.step reads to tell eval from a training step."""
    calls = []

    class Fake:
        _has_backward = True

        def step(self, *args, **kwargs):
            calls.append(self._has_backward)
            return "out"

    fake = Fake()
    assert _compat.torch_schedule_eval(fake, 1) == "out"
    assert calls == [False] and fake._has_backward is True


def test_torch_register_action(ts):
    """pipec's memory actions (issue 30) reach torch's runtime through the map that
    ``_step_microbatches`` consults for every action before its own dispatch; their type has
    the ``.value`` that ``_Action.__repr__`` (logging, profiler names) reads."""
    import pipec.torch as pt

    R = ts._PipelineScheduleRuntime
    assert _sets(R, "_comp_type_to_function_map")
    src = _source(R._step_microbatches)
    assert "action.computation_type in self._comp_type_to_function_map" in src
    assert "self._comp_type_to_function_map[action.computation_type](" in src
    runtime = types.SimpleNamespace(_comp_type_to_function_map={})
    _compat.torch_register_action(runtime, pt.MemoryAction.OFFLOAD, print)
    assert runtime._comp_type_to_function_map == {pt.MemoryAction.OFFLOAD: print}
    assert repr(ts._Action(0, pt.MemoryAction.OFFLOAD, 1)) == "0OFFLOAD1"


def test_torch_step_microbatches(ts, monkeypatch):
    """``step`` (and ``eval`` through it) splits the batch or takes it pre-split, then calls
    ``self._step_microbatches(args_split, kwargs_split, targets_split, losses, ...)``: the hook
    PipecScheduleRuntime overrides to relabel a reordered plan (#38). Microbatch m of the lists
    is action id m; the loss list is filled as the last stage's forwards run and read back by
    id, and the outputs are merged from ``stage.output_chunks`` after the hook returns."""
    R = ts._PipelineScheduleRuntime
    assert _params(R._step_microbatches)[:5] == [
        "self",
        "arg_mbs",
        "kwarg_mbs",
        "target_mbs",
        "losses",
    ]
    assert R.step is ts.PipelineScheduleMulti.step
    step = _source(R.step)
    assert "self._step_microbatches(" in step
    assert "self._merge_outputs(stage.output_chunks)" in step
    base = ts._PipelineSchedule
    assert "self._internal_losses.append(loss)" in _source(base._maybe_compute_loss)
    assert "self._internal_losses[mb_index]" in _source(base._maybe_get_loss)
    assert "losses.extend(self._internal_losses)" in _source(base._update_losses)
    assert "arg_mbs[mb_index]" in _source(R._step_microbatches)
    from torch.distributed.pipelining import stage as st

    assert "self.output_chunks.append(output)" in _source(st._PipelineStageBase.forward_one_chunk)
    calls = []
    monkeypatch.setattr(R, "_step_microbatches", lambda self, *a, **k: calls.append((a, k)))
    _compat.torch_step_microbatches("rt", [1], None, None, [], True, loss_kwargs=None)
    assert calls == [(([1], None, None, [], True), {"loss_kwargs": None})]
    assert _compat.torch_output_chunks(types.SimpleNamespace(output_chunks=[3])) == [3]


def test_torch_stage_forward_and_context():
    """``forward_one_chunk`` runs ``forward_maybe_with_nosync`` inside the stage's forward
    context, which receives a ``PipelineStageInfo`` naming the stage and microbatch (pipec's
    memory instructions rely on both: the context holds the saved-tensor hooks, the recompute
    calls the same forward again)."""
    _need("torch")
    import dataclasses

    from torch.distributed.pipelining import PipelineStageInfo
    from torch.distributed.pipelining import stage as st

    base = st._PipelineStageBase
    src = _source(base.forward_one_chunk)
    assert "self._call_with_forward_context(" in src and "self.forward_maybe_with_nosync" in src
    assert "microbatch_index=fwd_chunk_id" in src
    assert _params(base.register_forward_context) == ["self", "context_factory"]
    fields = {f.name for f in dataclasses.fields(PipelineStageInfo)}
    assert {"stage_index", "microbatch_index", "is_metadata_inference"} <= fields
    stage = types.SimpleNamespace(forward_maybe_with_nosync=len)
    assert _compat.torch_stage_forward(stage) is len
    assert "self.submod(*args, **kwargs)" in _source(base.forward_maybe_with_nosync)


def test_torch_recv_descriptors():
    """Receives are allocated per microbatch from a descriptor's ``tensor_meta`` when torch
    builds them (``get_fwd_recv_ops``/``get_bwd_recv_ops`` -> ``_get_recv_ops`` ->
    ``allocate_buffer``), which is what lets pipec size each microbatch's receive from its plan
    (``torch_recv_infos``, ``torch_resize_recv``)."""
    _need("torch")
    import torch
    from torch.distributed.pipelining import _recv_buffers as rb
    from torch.distributed.pipelining import _utils
    from torch.distributed.pipelining import stage as st

    base = st._PipelineStageBase
    assert "self.args_recv_info[fwd_chunk_id]" in _source(base.get_fwd_recv_ops)
    assert "self.grad_recv_info[bwd_chunk_id]" in _source(base.get_bwd_recv_ops)
    assert "info.allocate_buffer(self.device)" in _source(base._get_recv_ops)
    assert "_make_tensor_from_meta(self.tensor_meta" in _source(rb._RecvInfo.allocate_buffer)
    meta = _utils._TensorMeta.from_tensor(torch.zeros(3, 4, dtype=torch.float64))
    info = rb._RecvInfo("x", 0, meta)
    stage = types.SimpleNamespace(args_recv_info={1: (info,)}, grad_recv_info={})
    assert _compat.torch_recv_infos(stage, False, 1) == (info,)
    assert _compat.torch_recv_infos(stage, True, 1) == ()
    _compat.torch_resize_recv(info, 0, 7)
    buf = info.allocate_buffer("cpu")
    assert (tuple(buf.shape), buf.stride(), buf.dtype) == ((7, 4), (4, 1), torch.float64)
    assert meta.shape == (3, 4)  # the stage's own metadata is left as it was
    with pytest.raises(IndexError):
        _compat.torch_resize_recv(rb._RecvInfo("y", 0, meta), 2, 5)


def test_torch_recv_into_slots():
    """A buffer plan's receive lands in its slot (``torch_recv_into``: ``_get_recv_ops`` asks
    each descriptor to ``allocate_buffer`` and receives into what it returns and retains), the
    consuming pass takes it through ``_retrieve_recv_activations``/``_retrieve_recv_grads``
    (``take_buffer`` of ``_RecvInfo.buffer``) after the runtime's wait, and the runtime infers
    the stages' shapes in ``_initialize_stages`` before its first action."""
    _need("torch")
    import torch
    from torch.distributed.pipelining import _recv_buffers as rb
    from torch.distributed.pipelining import _utils
    from torch.distributed.pipelining import schedules as sc
    from torch.distributed.pipelining import stage as st

    base = st._PipelineStageBase
    src = _source(base._get_recv_ops)
    assert "buffer = info.allocate_buffer(self.device)" in src
    assert "dist.P2POp(dist.irecv, buffer" in src
    assert "self._retrieve_recv_activations(fwd_chunk_id)" in _source(base.forward_one_chunk)
    assert "self._retrieve_recv_grads(bwd_chunk_id)" in _source(base.backward_one_chunk)
    assert "info.take_buffer()" in _source(base._retrieve_recv_activations)
    assert "info.take_buffer()" in _source(base._retrieve_recv_grads)
    assert "self.buffer = None" in _source(rb._RecvInfo.take_buffer)
    run = _source(sc._PipelineScheduleRuntime._step_microbatches)
    assert run.index("self._initialize_stages(") < run.index("for time_step, action in")
    assert _params(sc.PipelineScheduleMulti._initialize_stages)[:3] == ["self", "args", "kwargs"]

    meta = _utils._TensorMeta.from_tensor(torch.zeros(2, 3))
    info, other = rb._RecvInfo("x", 0, meta), rb._RecvInfo("y", 0, meta)
    slot = torch.zeros(2, 3)
    with _compat.torch_recv_into((info,), lambda i: slot):
        assert info.allocate_buffer("cpu") is slot
    assert info.buffer is slot
    assert "allocate_buffer" not in vars(info)  # the class's method is back
    fresh = other.allocate_buffer("cpu")
    assert fresh is not slot and fresh.shape == (2, 3)
    copy = slot.clone()
    _compat.torch_replace_recv_buffer(info, slot, copy)
    _compat.torch_replace_recv_buffer(other, slot, copy)  # holds another tensor: unchanged
    assert info.take_buffer() is copy and other.buffer is fresh

    calls = []
    stage = types.SimpleNamespace(_retrieve_recv_grads=lambda mb: ("grads", mb))
    _compat.torch_before_retrieve(stage, True, calls.append)
    assert stage._retrieve_recv_grads(3) == ("grads", 3) and calls == [3]
    with pytest.raises(TypeError, match="_retrieve_recv_activations"):
        _compat.torch_before_retrieve(types.SimpleNamespace(), False, calls.append)


def test_torch_p2p_group():
    """Every send and receive torch's stage builds asks ``_get_p2p_group(source_stage,
    destination_stage)`` for its group (the receive side, both send sides), and ``_batch_p2p``
    splits a batch that spans groups into one batch per group: what ``torch_set_p2p_group``
    relies on to put each message on its ``p2p_groups`` group."""
    _need("torch")
    from torch.distributed.pipelining import schedules as sc
    from torch.distributed.pipelining import stage as st

    base = st._PipelineStageBase
    assert _params(base._get_p2p_group) == ["self", "source_stage", "destination_stage"]
    assert "self._get_p2p_group(info.source, self.stage_index)" in _source(base._get_recv_ops)
    assert "self._get_p2p_group(self.stage_index, dst)" in _source(base.get_fwd_send_ops)
    assert "self._get_p2p_group(self.stage_index, grad_recv_stage)" in _source(
        base.get_bwd_send_ops
    )
    assert "ops_by_group" in _source(sc._batch_p2p)

    def of(a, b):
        return (a, b)

    stage = types.SimpleNamespace(_get_p2p_group=lambda a, b: None)
    _compat.torch_set_p2p_group(stage, of)
    assert stage._get_p2p_group(0, 1) == (0, 1)
    with pytest.raises(TypeError, match="_get_p2p_group"):
        _compat.torch_set_p2p_group(types.SimpleNamespace(), of)


def test_torch_prepare_schedule_with_comms(ts):
    f = ts._PipelineScheduleRuntime._prepare_schedule_with_comms
    assert _params(f)[:3] == ["self", "actions", "format"]
    src = _source(f)
    assert '"compute_comms"' in src
    assert "pipeline_order_with_comms" in src
    assert "_validate_and_set_stage_mapping" in src


def test_torch_runtime_attributes(ts):
    """The attributes pipec installs a forward-only program through, and the stage placement it
    compares: the runtime reads and sets them under these names."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    assert _sets(ts.PipelineScheduleMulti, "pipeline_order")
    assert _sets(ts.PipelineScheduleMulti, "stage_index_to_group_rank")
    assert _sets(ts._PipelineScheduleRuntime, "pipeline_order_with_comms")
    assert "self.pipeline_order_with_comms" in _source(ts._PipelineScheduleRuntime)
    assert _sets(_PipelineStageBase, "stage_index_to_group_rank")
    rt = types.SimpleNamespace()
    stage = types.SimpleNamespace()
    _compat.torch_install_forward_only(rt, [stage], {0: []}, {0: ["c"]}, {0: 0})
    assert rt.pipeline_order == {0: []} and rt.pipeline_order_with_comms == {0: ["c"]}
    assert rt.stage_index_to_group_rank == stage.stage_index_to_group_rank == {0: 0}
    assert _compat.torch_stage_placement(rt) == {0: 0}


# --------------------------------------------------------------------------- torch FSDP2


@contextlib.contextmanager
def _one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_internals():
    """FSDPModule._get_fsdp_state, FSDPState._fsdp_param_groups / _auto_reshard_after_forward
    / _is_root and FSDPParamGroup.post_forward_mesh_info exist and mean what
    fsdp_reshards_after_forward reads (which counts missing ones as resharding, silently)."""
    torch = _need("torch")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    with _one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        got = {}
        for raf in (True, False, None):
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            fully_shard(m[0], mesh=mesh, reshard_after_forward=raf)
            fully_shard(m, mesh=mesh, reshard_after_forward=raf)
            assert isinstance(m, FSDPModule)
            state = m[0]._get_fsdp_state()
            assert isinstance(state._fsdp_param_groups, list) and state._fsdp_param_groups
            assert state._is_root is None  # set at lazy init, the first forward
            assert isinstance(state._auto_reshard_after_forward, bool)
            for g in state._fsdp_param_groups:
                assert hasattr(g, "post_forward_mesh_info")
            got[raf] = (
                _compat.fsdp_reshards_after_forward(m, True),
                _compat.fsdp_reshards_after_forward(m[0], False),
            )
    # (the stage's root, an inner module): None reshards except on the root.
    assert got == {True: (True, True), False: (False, False), None: (False, True)}
    assert _compat.fsdp_reshards_after_forward(object(), True) is True  # unknown: reshard


# --------------------------------------------------------------------------- megatron-core


@pytest.fixture(scope="module")
def ms():
    _need("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Transformer Engine / Apex here
        _need("megatron.core")
        from megatron.core.pipeline_parallel import schedules
    return schedules


def test_megatron_build_default_pg_collection(ms):
    f = ms._build_default_pg_collection
    assert not [
        p for p in inspect.signature(f).parameters.values() if p.default is inspect.Parameter.empty
    ]
    src = _source(f)
    for group in ("tp", "cp", "pp"):  # what pipec.megatron reads from it
        assert f"pg_collection.{group} =" in src, group


def test_megatron_version_is_the_tested_one(ms):
    from megatron.core import package_info

    assert _compat.release(package_info.__version__) == _compat.release(
        _compat.TESTED["megatron-core"]
    )


def test_megatron_schedule_helpers(ms):
    """The schedule helpers pipec.megatron calls positionally (public names, undocumented
    signatures)."""
    assert _params(ms.forward_step) == [
        "forward_step_func",
        "data_iterator",
        "model",
        "num_microbatches",
        "input_tensor",
        "forward_data_store",
        "config",
        "cp_group_size",
        "collect_non_loss_data",
        "checkpoint_activations_microbatch",
        "is_first_microbatch",
        "current_microbatch",
        "vp_stage",
        "is_last_stage",
    ]
    assert _params(ms.backward_step) == [
        "input_tensor",
        "output_tensor",
        "output_tensor_grad",
        "config",
    ]
    assert _params(ms.deallocate_output_tensor) == ["out", "deallocate_pipeline_outputs"]
    assert _params(ms.check_first_val_step) == ["first_val_step", "forward_only", "cond"]
    assert _params(ms.clear_embedding_activation_buffer) == ["config", "model", "is_last_stage"]
    assert _params(ms.finish_embedding_wgrad_compute) == [
        "config",
        "embedding_module",
        "is_last_stage",
        "tp_group",
    ]


def test_megatron_forward_backward_signature(ms):
    import pipec.megatron as pm

    f = pm.forward_backward_func(pipec.compile("1f1b", 2, 4))
    assert set(_params(f)) == set(_params(ms.forward_backward_pipelining_with_interleaving))


def test_megatron_config_fields(ms):
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    read = {
        "hidden_size",
        "sequence_parallel",
        "pipeline_dtype",
        "deallocate_pipeline_outputs",
        "grad_scale_func",
        "no_sync_func",
        "grad_sync_func",
        "param_sync_func",
        "finalize_model_grads_func",
        "calculate_per_token_loss",
        "num_microbatches_with_partial_activation_checkpoints",
        "variable_seq_lengths",
    }
    assert read <= fields, sorted(read - fields)


# --------------------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def ds():
    _need("torch")
    _need("deepspeed")
    from deepspeed.runtime.pipe import engine, p2p, schedule

    return types.SimpleNamespace(engine=engine, schedule=schedule, p2p=p2p)


def test_deepspeed_instruction_map(ds):
    PE, S = ds.engine.PipelineEngine, ds.schedule
    m = _compat.ds_instruction_map(PE.__new__(PE))  # an engine object, never initialized
    assert m is PE._INSTRUCTION_MAP and isinstance(m, dict)
    for instr in (
        S.LoadMicroBatch,
        S.ForwardPass,
        S.BackwardPass,
        S.SendActivation,
        S.RecvActivation,
        S.SendGrad,
        S.RecvGrad,
        S.ReduceGrads,
        S.ReduceTiedGrads,
        S.OptimizerStep,
    ):
        assert instr in m, instr.__name__
    assert _params(m[S.LoadMicroBatch])[:2] == ["self", "buffer_id"]
    # _exec_schedule looks the map up through self (pipec's per-instance map is seen) and calls
    # the handler bound to the engine with the instruction's kwargs.
    src = _source(PE._exec_schedule)
    assert "self._INSTRUCTION_MAP[type(cmd)]" in src and "**cmd.kwargs" in src
    assert S.ForwardPass(buffer_id=3).kwargs == {"buffer_id": 3}


def test_deepspeed_exec_passes(ds):
    PE = ds.engine.PipelineEngine
    assert _params(PE._exec_forward_pass) == ["self", "buffer_id"]
    assert _params(PE._exec_backward_pass) == ["self", "buffer_id"]
    assert "self.loss" in _source(PE._exec_forward_pass)  # the last stage's loss
    assert "self.grad_layer" in _source(PE._exec_backward_pass)


def test_deepspeed_running_engine_backward(ds):
    PE = ds.engine.PipelineEngine
    assert "self._running_engine_backward = True" in _source(PE._exec_backward_pass)
    eng = types.SimpleNamespace()
    with pytest.raises(KeyError), _compat.ds_engine_backward(eng):
        assert eng._running_engine_backward is True
        raise KeyError
    assert eng._running_engine_backward is False


def test_deepspeed_tensor_meta_round_trip(ds, monkeypatch):
    """DeepSpeed's _send_tensor_meta message, decoded by ds_recv_tensor_meta."""
    import torch

    PE = ds.engine.PipelineEngine
    assert _params(PE._send_tensor_meta) == ["self", "buffer", "recv_stage"]
    assert isinstance(ds.engine.TENSOR_META_SIZE, int)
    sent = []
    monkeypatch.setattr(ds.p2p, "send", lambda t, dest: sent.append((t.clone(), dest)))

    def recv(t, src):
        buf, _ = sent.pop(0)
        t.copy_(buf)

    monkeypatch.setattr(ds.p2p, "recv", recv)
    eng = types.SimpleNamespace(
        device=torch.device("cpu"),
        DTYPE_TO_ID=PE.DTYPE_TO_ID,
        ID_TO_DTYPE=PE.ID_TO_DTYPE,
        prev_stage=0,
    )
    one = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    PE._send_tensor_meta(eng, one, 1)
    assert sent[0][1] == 1
    assert _compat.ds_recv_tensor_meta(eng) == (True, [([2, 3, 5], torch.bfloat16)])
    two = (torch.zeros(4), torch.zeros(1, 7, dtype=torch.float16))
    eng._send_tensor_meta = lambda buffer, stage: PE._send_tensor_meta(eng, buffer, stage)
    _compat.ds_send_tensor_meta(eng, two, 1)
    assert _compat.ds_recv_tensor_meta(eng) == (
        False,
        [([4], torch.float32), ([1, 7], torch.float16)],
    )


def test_deepspeed_schedule_methods(ds):
    PE = ds.engine.PipelineEngine
    assert _params(PE._train_schedule) == ["self"]
    assert _params(PE._inference_schedule) == ["self", "micro_batches"]
    assert _params(PE._exec_schedule) == ["self", "pipe_schedule"]
    assert "self._train_schedule()" in _source(PE.train_batch)
    assert "self._inference_schedule(" in _source(PE.eval_batch)
    assert "self._exec_schedule(" in _source(PE.train_batch)
    assert "self._exec_schedule(" in _source(PE.eval_batch)
    eng = types.SimpleNamespace(_train_schedule=1, _inference_schedule=2, _exec_schedule=3)
    assert _compat.ds_schedule_methods(eng) == (1, 2, 3)
    _compat.ds_install(eng, {"m": 0}, 4, 5, 6)
    assert (eng._INSTRUCTION_MAP, eng._train_schedule, eng._inference_schedule) == ({"m": 0}, 4, 5)
    assert eng._exec_schedule == 6


def test_deepspeed_engine_state(ds):
    """The engine state pipec.deepspeed reads by name (unprefixed, undocumented): settings it
    refuses (read with getattr, so a rename would silently let them through), the buffers and
    the values the handlers exchange with DeepSpeed's forward and backward."""
    import deepspeed.runtime.engine as de_base

    PE = ds.engine.PipelineEngine
    for attr in (
        "is_pipe_partitioned",
        "is_grad_partitioned",
        "has_attention_mask",
        "has_bool_tensors",
        "using_bf16_optimizer",
        "dynamic_shape",
        "grad_layer",
        "pipe_buffers",
        "loss",
        "num_stages",
        "micro_batches",
        "stage_id",
    ):
        assert _sets(PE, attr), attr
    assert _sets(de_base.DeepSpeedEngine, "torch_autocast_z0_gradscaler")
    init = _source(PE.__init__)
    for key in ("inputs", "labels", "outputs", "output_tensors"):
        assert f"'{key}'" in init or f'"{key}"' in init, key
    assert isinstance(PE.ID_TO_DTYPE, list)
    for m in ("is_first_stage", "is_last_stage", "fp16_enabled"):
        assert callable(getattr(PE, m)), m


def test_deepspeed_schedule_classes(ds):
    S = ds.schedule
    assert _params(S.PipeSchedule.__init__) == ["self", "micro_batches", "stages", "stage_id"]
    assert _sets(S.PipeSchedule, "micro_batches")
    for name in ("steps", "num_pipe_buffers"):
        assert callable(getattr(S.PipeSchedule, name))
    for cls in (S.ForwardPass, S.BackwardPass, S.SendActivation, S.RecvGrad):
        assert issubclass(cls, S.BufferOpInstruction)
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    assert issubclass(DualPipeVEngine, ds.engine.PipelineEngine)
