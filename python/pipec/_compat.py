"""Every private or undocumented part of torch, megatron-core and DeepSpeed that pipec's
adapters use, and the version check that guards them.

The adapters (:mod:`pipec.torch`, :mod:`pipec.megatron`, :mod:`pipec.deepspeed`) reach what
these frameworks do not publish (underscored classes, methods, attributes and modules, the
layout of dicts they return, a wire format) only through the small functions below. Each names
the upstream object and the release it is tested with; ``python/tests/test_compat.py`` holds one
contract test per touchpoint (the attribute exists, the signature has the parameters pipec
passes, the returned dict has the keys pipec reads), so a release that moves one fails there,
by name, rather than deep inside a training step.

An adapter calls :func:`require` for the frameworks it touches when it is imported: a release
outside :data:`TESTED`'s series raises :class:`pipec.PipecError` naming the installed and the
tested versions, unless the environment variable :data:`OVERRIDE_ENV` is ``1`` (then it warns
once and goes on). Nothing here imports torch, megatron-core or DeepSpeed at import time: each
function imports what it touches when called, so ``import pipec`` stays light and
:mod:`pipec.deepspeed` never loads ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ._native import PipecError

# --------------------------------------------------------------------------- versions

#: The releases the adapters are written and tested against: exactly the pins of ``test.sh``
#: (``torch==2.15.0``, ``megatron-core==0.19.2``, ``deepspeed==0.19.8``).
TESTED = {"torch": "2.15.0", "megatron-core": "0.19.2", "deepspeed": "0.19.8"}

#: Set to ``1`` to run an adapter on a release outside the tested series, at your own risk.
OVERRIDE_ENV = "PIPEC_ALLOW_UNTESTED_VERSIONS"

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")
_verified: set[str] = set()  # frameworks whose installed release was checked (or allowed)
_warned: set[str] = set()


def release(version: str) -> tuple[int, int, int] | None:
    """The release number ``(major, minor, patch)`` of a version string, or ``None`` when it
    has none. Pre-release, dev and local suffixes are ignored: NGC's ``2.15.0a0+git…`` builds
    and megatron-core's ``0.19.2+3370bb4`` count as 2.15.0 and 0.19.2."""
    m = _RELEASE.match(str(version))
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def accepted(name: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(lowest, first refused)``: the tested release up to, not including, the next minor
    release. Patch releases of these projects fix bugs and keep the internals pipec uses; their
    minor releases are where such internals move (torch reworked ``_PipelineScheduleRuntime``
    and ``_backward`` from 2.5 to 2.15; megatron-core's ``schedules`` signatures and DeepSpeed's
    ``PipelineEngine`` change between minors). Older patches than the tested one are refused:
    pipec may rely on their fixes."""
    lo = release(TESTED[name])
    assert lo is not None
    return lo, (lo[0], lo[1] + 1, 0)


def accepted_range(name: str) -> str:
    """The accepted releases of ``name`` as a requirement: ``>=2.15.0,<2.16``."""
    lo, hi = accepted(name)
    return f">={'.'.join(map(str, lo))},<{hi[0]}.{hi[1]}"


def check_version(name: str, installed: str, adapter: str = "pipec") -> None:
    """Raise :class:`pipec.PipecError` unless ``installed`` (a version string of ``name``) is
    in the tested series, or :data:`OVERRIDE_ENV` is ``1`` (then warn, once per framework).
    ``adapter`` is the module that needs it, for the message."""
    lo, hi = accepted(name)
    r = release(installed)
    if r is not None and lo <= r < hi:
        _verified.add(name)
        return
    what = (
        f"{adapter} is tested with {name} {TESTED[name]} and accepts {name}"
        f"{accepted_range(name)}, but {name} {installed} is installed"
    )
    if os.environ.get(OVERRIDE_ENV) == "1":
        _verified.add(name)
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"{what}; running anyway because {OVERRIDE_ENV}=1. It uses private parts of "
                f"{name} (pipec/_compat.py) that may have changed",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    raise PipecError(
        f"{what}. {adapter} uses private parts of {name} (listed in pipec/_compat.py) that "
        f"change between releases, so it refuses to run on an untested one: install "
        f"{name}{accepted_range(name)}, or set {OVERRIDE_ENV}=1 to run anyway at your own risk"
    )


def installed_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` from its metadata (about a
    millisecond; nothing is imported), or ``None`` when it is not installed as a distribution."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(adapter: str, name: str) -> None:
    """The check ``adapter`` makes at import for a framework whose internals it uses.

    torch is imported by every adapter anyway: its ``torch.__version__`` is checked. megatron-core
    and DeepSpeed are not imported (seconds each): their distribution metadata is read; when
    there is none (not installed, or a source checkout on ``PYTHONPATH``) the adapter still
    imports (its layout helpers need neither) and :func:`require_loaded` checks the module's
    own version when the adapter first imports the framework."""
    if name == "torch":
        import torch

        check_version(name, torch.__version__, adapter)
        return
    v = installed_version(name)
    if v is not None:
        check_version(name, v, adapter)


def require_loaded(adapter: str, name: str) -> None:
    """Check ``name``'s imported module version unless :func:`require` already checked it
    (called where ``adapter`` imports the framework; free after the first time)."""
    if name in _verified:
        return
    if name == "megatron-core":
        from megatron.core import package_info

        check_version(name, package_info.__version__, adapter)
    elif name == "deepspeed":
        import deepspeed

        check_version(name, deepspeed.__version__, adapter)
    else:
        require(adapter, name)


# --------------------------------------------------------------------------- torch pipelining
# torch.distributed.pipelining.schedules (torch 2.15.0): pipec hands its verified actions to
# torch's own runtime for compute+comms schedules, which torch only exposes privately.


def _schedules():
    from torch.distributed.pipelining import schedules

    return schedules


def torch_action() -> type:
    """``torch.distributed.pipelining.schedules._Action`` (torch 2.15): the NamedTuple
    ``(stage_index, computation_type, microbatch_index, sub_actions)`` of one action;
    ``sub_actions`` holds the forward and backward of an ``OVERLAP_F_B``."""
    return _schedules()._Action


def torch_computation_type() -> type:
    """``torch.distributed.pipelining.schedules._ComputationType`` (torch 2.15): the action
    kinds, a ``str`` enum built from pipec's names (``"FORWARD"`` is ``"F"``, ``"UNSHARD"``...);
    pipec uses ``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT``,
    ``UNSHARD``, ``RESHARD``, ``OVERLAP_F_B`` and construction from the exporter's values."""
    return _schedules()._ComputationType


def torch_schedule_runtime() -> type:
    """``torch.distributed.pipelining.schedules._PipelineScheduleRuntime`` (torch 2.15): the
    runtime that executes an explicit compute+comms action list. pipec subclasses it."""
    return _schedules()._PipelineScheduleRuntime


def torch_has_backward(runtime: Any) -> bool:
    """``_PipelineSchedule._has_backward`` (torch 2.15): whether this call runs backwards
    (``eval`` turns it off around ``step``)."""
    return runtime._has_backward


def torch_schedule_eval(runtime: Any, *args, **kwargs):
    """``_PipelineSchedule.eval`` (torch 2.15), called on ``runtime``: ``step`` with
    ``_has_backward`` off."""
    return _schedules()._PipelineSchedule.eval(runtime, *args, **kwargs)


def torch_install_actions(runtime: Any, compute: dict, comms: dict) -> None:
    """Install a training program on ``runtime``: ``pipeline_order`` (the compute-only actions,
    per rank) and, through ``_PipelineScheduleRuntime._prepare_schedule_with_comms(actions,
    format="compute_comms")`` (torch 2.15), the compute+comms actions, which torch validates and
    stores as written in ``pipeline_order_with_comms``; it also sets
    ``stage_index_to_group_rank`` from them."""
    runtime.pipeline_order = compute
    runtime._prepare_schedule_with_comms(comms, format="compute_comms")


def torch_install_forward_only(
    runtime: Any, stages: list, compute: dict, comms: dict, mapping: dict[int, int]
) -> None:
    """Install a forward-only program as written (torch's validation counts backwards for
    training): the attributes ``_prepare_schedule_with_comms`` would set (torch 2.15:
    ``pipeline_order``, ``pipeline_order_with_comms``, and ``stage_index_to_group_rank`` on the
    runtime and on each stage), with pipec's stage placement."""
    runtime.pipeline_order = compute
    runtime.stage_index_to_group_rank = mapping
    for st in stages:
        st.stage_index_to_group_rank = mapping
    runtime.pipeline_order_with_comms = comms


def torch_stage_placement(runtime: Any) -> dict[int, int]:
    """``runtime.stage_index_to_group_rank`` (torch 2.15): the stage -> rank map torch derived
    from the installed actions."""
    return runtime.stage_index_to_group_rank


def torch_register_action(runtime: Any, computation_type: Any, fn: Callable) -> None:
    """Have ``runtime`` run ``fn(action, ctx)`` for every action of ``computation_type``:
    ``_PipelineScheduleRuntime._comp_type_to_function_map`` (torch 2.15), which
    ``_step_microbatches`` consults for each action before its own dispatch. Its public filler,
    ``register_custom_function``, accepts only torch's own types; pipec's memory actions are
    not among them."""
    runtime._comp_type_to_function_map[computation_type] = fn


def torch_step_microbatches(runtime: Any, *args, **kwargs) -> Any:
    """``_PipelineScheduleRuntime._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses,
    return_outputs, loss_kwargs=...)`` (torch 2.15), called on ``runtime``: one step over the
    already-split microbatch lists (``step`` and ``eval`` split or take them pre-split, then
    call it), microbatch ``i`` of each list being the action id ``i``; on the last stage it
    fills ``losses`` in the order of its ``_internal_losses`` (appended as the forwards run).
    :class:`pipec.torch.PipecScheduleRuntime` overrides it under this name to relabel a
    reordered plan's microbatches."""
    return _schedules()._PipelineScheduleRuntime._step_microbatches(runtime, *args, **kwargs)


def torch_output_chunks(stage: Any) -> list:
    """``_PipelineStageBase.output_chunks`` (torch 2.15): the last stage's outputs, appended
    by ``forward_one_chunk`` as its forwards run; ``step`` merges them after
    ``_step_microbatches`` returns."""
    return stage.output_chunks


def torch_stage_forward(stage: Any) -> Callable:
    """``_PipelineStageBase.forward_maybe_with_nosync`` (torch 2.15) of ``stage``: the call
    ``forward_one_chunk`` makes to run the stage's module on its inputs (``submod(*args,
    **kwargs)``, under ``no_sync`` when the module is DDP-wrapped). A recompute runs the
    forward through it again."""
    return stage.forward_maybe_with_nosync


def torch_set_p2p_group(stage: Any, of: Callable[[int, int], Any]) -> None:
    """Make ``stage`` post every send and receive on the group ``of(source_stage,
    destination_stage)`` names: torch 2.15's ``_PipelineStageBase._get_p2p_group`` (added with
    its per-edge communicators, pytorch #196666) is what ``_get_recv_ops``, ``get_fwd_send_ops``,
    ``get_bwd_send_ops`` and the metadata exchange ask for each message's group; it is replaced
    on this stage only."""
    if not callable(getattr(stage, "_get_p2p_group", None)):
        raise TypeError(
            "this torch's PipelineStage has no _get_p2p_group (added in torch 2.15): "
            "p2p_groups other than 'pair' need it"
        )
    stage._get_p2p_group = of


def torch_recv_infos(stage: Any, grad: bool, mb: int) -> tuple:
    """The receive descriptors (``_RecvInfo``, torch 2.15 ``_recv_buffers.py``) of microbatch
    ``mb`` on ``stage``: ``args_recv_info[mb]`` (activations) or ``grad_recv_info[mb]``
    (gradients). torch keeps one descriptor per microbatch, each holding the ``tensor_meta``
    its buffer is allocated from (``allocate_buffer``, called by ``_get_recv_ops`` right
    before the ``irecv`` is built); a descriptor with ``is_root_arg`` or no ``tensor_meta``
    receives nothing."""
    return (stage.grad_recv_info if grad else stage.args_recv_info).get(mb, ())


def torch_resize_recv(info: Any, dim: int, size: int) -> None:
    """Set the size of dimension ``dim`` of the buffer ``info`` (a ``_RecvInfo``) will
    allocate: its ``tensor_meta`` (torch 2.15 ``_utils._TensorMeta``, a frozen dataclass of
    ``shape``, ``stride``, ``dtype``, ``requires_grad``) replaced by one with that size and
    contiguous strides. A DTensor's metadata (``_DTensorMeta``, a subclass with the global
    shape too) is refused: its local and global sizes along ``dim`` would both change."""
    import dataclasses

    from torch.distributed.pipelining._utils import _TensorMeta

    meta = info.tensor_meta
    if meta is None or getattr(info, "is_root_arg", False):
        return
    if type(meta) is not _TensorMeta:
        raise TypeError(f"a receive of {type(meta).__name__} cannot be resized per microbatch")
    if not 0 <= dim < len(meta.shape):
        raise IndexError(f"the received tensor has shape {tuple(meta.shape)}: no dimension {dim}")
    shape = list(meta.shape)
    if shape[dim] == size:
        return
    shape[dim] = size
    stride, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        stride[d] = acc
        acc *= shape[d]
    info.tensor_meta = dataclasses.replace(
        meta, shape=type(meta.shape)(shape), stride=tuple(stride)
    )


@contextlib.contextmanager
def torch_recv_into(infos: tuple, buffer_of: Callable[[Any], Any]) -> Iterator[None]:
    """While active, each descriptor of ``infos`` (``_RecvInfo``, torch 2.15) that torch asks
    to ``allocate_buffer(device)`` (``_get_recv_ops``, right before it builds the ``irecv``)
    retains ``buffer_of(info)`` instead (``_RecvInfo.set_buffer``, which refuses a descriptor
    that still holds a buffer, as ``allocate_buffer`` does) and returns it: the receive lands
    there. The descriptors' own method is back afterwards."""

    def retain(info: Any) -> Callable[[Any], Any]:
        def allocate_buffer(device: Any) -> Any:
            t = buffer_of(info)
            info.set_buffer(t)
            return t

        return allocate_buffer

    hooked = []
    try:
        for info in infos:
            info.allocate_buffer = retain(info)
            hooked.append(info)
        yield
    finally:
        for info in hooked:
            info.__dict__.pop("allocate_buffer", None)


def torch_replace_recv_buffer(info: Any, old: Any, new: Any) -> None:
    """Make the received tensor ``info`` (a ``_RecvInfo``) hands the stage ``new`` instead of
    ``old``, if it still holds ``old``: ``_RecvInfo.buffer`` (torch 2.15), retained from the
    receive until ``_retrieve_recv_activations``/``_retrieve_recv_grads`` take it
    (``take_buffer``)."""
    if info.buffer is old:
        info.buffer = new


def torch_before_retrieve(stage: Any, grad: bool, fn: Callable[[int], None]) -> None:
    """Have ``stage`` call ``fn(mb)`` right before it takes microbatch ``mb``'s received
    tensors: ``_PipelineStageBase._retrieve_recv_activations(fwd_chunk_id)`` (``grad`` false;
    ``forward_one_chunk`` calls it for a stage that is not the first) or
    ``_retrieve_recv_grads(bwd_chunk_id)`` (``backward_one_chunk``, a stage that is not the
    last), torch 2.15, both after the runtime waited for the receive. Replaced on this stage
    only."""
    name = "_retrieve_recv_grads" if grad else "_retrieve_recv_activations"
    orig = getattr(stage, name, None)
    if not callable(orig):
        raise TypeError(f"this torch's PipelineStage has no {name} (torch 2.15 has)")

    def retrieve(mb: int) -> Any:
        fn(mb)
        return orig(mb)

    setattr(stage, name, retrieve)


def torch_initialize_stages(runtime: Any, *args, **kwargs) -> None:
    """``PipelineScheduleMulti._initialize_stages(args, kwargs, target, loss_kwargs)`` (torch
    2.15), called on ``runtime``: the shape inference and receive descriptors of every stage,
    done (once; later calls return) by ``_step_microbatches`` before the first action.
    :class:`pipec.torch.PipecScheduleRuntime` overrides it under this name to allocate a
    buffer plan's slots right after."""
    _schedules().PipelineScheduleMulti._initialize_stages(runtime, *args, **kwargs)


# --------------------------------------------------------------------------- torch FSDP2


def fsdp_reshards_after_forward(module: Any, is_root: bool) -> bool:
    """Whether FSDP2 frees this ``FSDPModule``'s gathered parameters after each forward.

    FSDP2's internals (torch 2.15): ``FSDPModule._get_fsdp_state()``, its
    ``FSDPState._fsdp_param_groups``, ``_auto_reshard_after_forward`` and ``_is_root``, and each
    ``FSDPParamGroup.post_forward_mesh_info``, set exactly when the group reshards after forward
    (``FSDPParamGroup._reshard_after_forward``). ``reshard_after_forward=None`` (the default) is
    turned off at lazy init for a root only (``FSDPState._lazy_init``), and an FSDP module with
    no FSDP ancestor in the stage is the root of the stage's forward. Unknown internals count as
    resharding: the repair then costs an all-gather but stays exact."""
    try:
        state = module._get_fsdp_state()
        groups = list(state._fsdp_param_groups)
        auto_root = bool(state._auto_reshard_after_forward) and (
            state._is_root if state._is_root is not None else is_root
        )
        return not auto_root and any(g.post_forward_mesh_info is not None for g in groups)
    except AttributeError:
        return True


# --------------------------------------------------------------------------- megatron-core


def megatron_default_pg_collection() -> Any:
    """``megatron.core.pipeline_parallel.schedules._build_default_pg_collection()``
    (megatron-core 0.19.2): the ``ProcessGroupCollection`` Megatron's own schedules fall back to
    when the caller passes no ``pg_collection`` (tp, cp, pp, dp... from ``parallel_state``)."""
    from megatron.core.pipeline_parallel import schedules

    return schedules._build_default_pg_collection()


# --------------------------------------------------------------------------- DeepSpeed
# deepspeed.runtime.pipe.engine.PipelineEngine (DeepSpeed 0.19.8). pipec changes what it changes
# on the engine instance, as DeepSpeed's own DualPipeVEngine does on its class.


def _engine_class() -> type:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return PipelineEngine


def ds_instruction_map(engine: Any) -> dict:
    """``PipelineEngine._INSTRUCTION_MAP`` (DeepSpeed 0.19.8) of the engine's class: instruction
    class -> handler, which ``_exec_schedule`` binds to the engine and calls with the
    instruction's kwargs (``buffer_id``)."""
    return type(engine)._INSTRUCTION_MAP


def ds_exec_forward_pass(engine: Any, buffer_id: int) -> None:
    """``PipelineEngine._exec_forward_pass(buffer_id)`` (DeepSpeed 0.19.8): DeepSpeed's forward
    of one buffer, which sets ``engine.loss`` on the last stage."""
    _engine_class()._exec_forward_pass(engine, buffer_id)


def ds_exec_backward_pass(engine: Any, buffer_id: int) -> None:
    """``PipelineEngine._exec_backward_pass(buffer_id)`` (DeepSpeed 0.19.8): DeepSpeed's whole
    backward of one buffer, from ``engine.loss`` (last stage) or ``engine.grad_layer``."""
    _engine_class()._exec_backward_pass(engine, buffer_id)


@contextlib.contextmanager
def ds_engine_backward(engine: Any):
    """``engine._running_engine_backward`` set while a backward runs, as DeepSpeed 0.19.8's own
    ``_exec_backward_pass`` sets it (its post-backward hooks refuse a backward without it)."""
    engine._running_engine_backward = True
    try:
        yield
    finally:
        engine._running_engine_backward = False


def ds_pipeline_module_with_parts(layers: list, parts: list[int], **kwargs: Any) -> Any:
    """A ``PipelineModule(layers, **kwargs)`` (DeepSpeed 0.19.8) whose split is ``parts``:
    its ``__init__`` calls ``self._partition_layers(method=partition_method)``, which sets
    ``self.parts`` (stage boundaries) and this rank's ``self._set_bounds(start, stop)`` from
    ``self._topo.get_coord(self.global_rank).pipe``; the subclass does the same with the
    given boundaries."""
    from deepspeed.runtime.pipe.module import PipelineModule

    class PipecPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            if len(parts) != self.num_stages + 1:
                raise ValueError(
                    f"{len(parts) - 1} stages in the split, {self.num_stages} in the pipeline"
                )
            self.parts = list(parts)
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    return PipecPipelineModule(layers=layers, **kwargs)


def ds_bf16_optimizer(engine: Any) -> Any:
    """The engine's ``BF16_Optimizer`` when it trains in bf16 through it, else ``None``
    (DeepSpeed 0.19.8: ``PipelineEngine.using_bf16_optimizer``; its ``clear_lp_grads()`` zeroes
    the bf16 ``.grad`` of every parameter, ``update_hp_grads(clear_lp_grads=False)`` adds them
    into the fp32 master gradients, as ``PipelineEngine._exec_backward_pass`` calls them)."""
    return engine.optimizer if getattr(engine, "using_bf16_optimizer", False) else None


def ds_send_tensor_meta(engine: Any, outputs: Any, recv_stage: int) -> None:
    """``PipelineEngine._send_tensor_meta(buffer, recv_stage)`` (DeepSpeed 0.19.8): the message
    announcing the shapes and dtypes of the activations that follow."""
    engine._send_tensor_meta(outputs, recv_stage)


def ds_recv_tensor_meta(engine: Any) -> tuple[bool, list[tuple[list[int], Any]]]:
    """The message of ``_send_tensor_meta`` from the previous stage, decoded without the
    engine's shared receive buffer (``_recv_tensor_meta`` allocates into it): ``(single tensor,
    [(shape, dtype), ...])``. The layout (DeepSpeed 0.19.8): ``TENSOR_META_SIZE`` int32s,
    ``[0, dtype id, ndims, *shape]`` for a tensor, ``[2, count, (dtype id, ndims, *shape)...]``
    for a tuple; dtype ids index ``PipelineEngine.ID_TO_DTYPE``."""
    import torch
    from deepspeed.runtime.pipe import engine as de
    from deepspeed.runtime.pipe import p2p

    buf = torch.empty(de.TENSOR_META_SIZE, dtype=torch.int32, device=engine.device)
    p2p.recv(buf, engine.prev_stage)
    meta = buf.tolist()
    if meta[0] == 0:
        dtype, ndims = engine.ID_TO_DTYPE[meta[1]], meta[2]
        return True, [(meta[3 : 3 + ndims], dtype)]
    specs, off = [], 2
    for _ in range(meta[1]):
        dtype, ndims = engine.ID_TO_DTYPE[meta[off]], meta[off + 1]
        specs.append((meta[off + 2 : off + 2 + ndims], dtype))
        off += 2 + ndims
    return False, specs


def ds_schedule_methods(engine: Any) -> tuple[Callable, Callable, Callable]:
    """The engine's ``_train_schedule()``, ``_inference_schedule(micro_batches)`` and
    ``_exec_schedule(pipe_schedule)`` (DeepSpeed 0.19.8): ``train_batch`` and ``eval_batch``
    build their schedule with the first two and run it with the third."""
    return engine._train_schedule, engine._inference_schedule, engine._exec_schedule


def ds_install(
    engine: Any,
    instruction_map: dict,
    train_schedule: Callable,
    inference_schedule: Callable,
    exec_schedule: Callable,
) -> None:
    """Replace, on this engine instance only, ``_INSTRUCTION_MAP`` (read through ``self`` by
    ``_exec_schedule``) and the three methods of :func:`ds_schedule_methods` (DeepSpeed
    0.19.8)."""
    engine._INSTRUCTION_MAP = instruction_map
    engine._train_schedule = train_schedule
    engine._inference_schedule = inference_schedule
    engine._exec_schedule = exec_schedule
