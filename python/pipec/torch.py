"""Run pipec's verified schedules on torch.distributed.pipelining's own runtime.

:func:`build_schedule` turns the verified instruction stream of this rank (compute,
communication and memory instructions, in the order pipec proved deadlock-free) into torch
``_Action`` objects and hands them, as written, to torch's ``_PipelineScheduleRuntime``: the actions come from the Rust
exporter as structured data, with no CSV in between. torch is imported only here; its private
parts are reached through :mod:`pipec._compat`, and importing this module checks that the
installed torch is in the tested series (:data:`pipec._compat.TESTED`).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import Op, PipecError, Schedule, TorchExportError, _as_schedule, _compat, _torch_slots
from ._offload import ActivationStore, MemoryEvent, _Entry, _kept_storages
from ._torch_slots import SlotPool

_compat.require("pipec.torch", "torch")

_Action = _compat.torch_action()
_ComputationType = _compat.torch_computation_type()

__all__ = [
    "MemoryAction",
    "MemoryEvent",
    "PipecScheduleRuntime",
    "SavedActivations",
    "SlotPool",
    "actions",
    "build_schedule",
    "p2p_groups",
    "regather_for_split_backward",
    "reshards_after_forward",
    "stage_indices",
]


def _refuse(s: Schedule, placement_only: bool = True) -> None:
    """torch's rule, asked of Rust (``Target::Torch``, the one ``pipec tune --target torch``
    filters by): every stage on one rank (else :class:`TorchExportError`), and unless
    ``placement_only`` the rest of the rule (else :class:`PipecError`). The last stage may run
    its forwards in any microbatch order: :func:`build_schedule` relabels the microbatches for
    torch (:func:`_torch_order`)."""
    why = s._n.adapter_refusal("torch", placement_only)
    if why is not None:
        raise (TorchExportError if placement_only else PipecError)(why)


def stage_indices(schedule: Schedule | str | os.PathLike, rank: int) -> list[int]:
    """The stages ``rank`` must build (as ``PipelineStage``s), in the order
    :func:`build_schedule` expects them: ascending stage index, for every placement pipec
    generates (looped ``s % pp``, V-shaped, custom)."""
    s = _as_schedule(schedule)
    _refuse(s)
    return s.stages_of(rank)


class MemoryAction(str, enum.Enum):
    """pipec's memory instructions as action types of torch's runtime (issue 30).

    They are not torch's ``_ComputationType`` members: :func:`build_schedule` has its runtime run
    them (:class:`SavedActivations`) where the rank's program has them. A checkpointed forward
    (``fwd`` with ``"checkpoint": true``) is torch's ``FORWARD``, run under
    :class:`SavedActivations`' hooks."""

    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    WAIT_OFFLOAD = "WAIT_OFFLOAD"
    RECOMPUTE = "RECOMPUTE"


#: The exporter's name of a checkpointed forward (not torch's: it runs as ``FORWARD``).
_F_CHECKPOINT = "F_CHECKPOINT"


def _action(cell: Any, checkpointed: set[tuple[int, int]] | None = None) -> _Action | None:
    """The torch action of one exported cell; a checkpointed forward becomes ``FORWARD`` and
    its (stage, microbatch) goes into ``checkpointed``."""
    if cell is None:
        return None
    if cell[0] == "OVERLAP_F_B":
        fwd, bwd = (_action(c) for c in cell[1:])
        return _Action(-1, _ComputationType.OVERLAP_F_B, None, (fwd, bwd))
    stage, ty, mb = cell
    if ty == _F_CHECKPOINT:
        if checkpointed is not None:
            checkpointed.add((stage, mb))
        return _Action(stage, _ComputationType.FORWARD, mb)
    if ty in MemoryAction.__members__:
        return _Action(stage, MemoryAction(ty), mb)
    return _Action(stage, _ComputationType(ty), mb)


def _actions(s: Schedule, compute_only: bool = False):
    """(every rank's actions, every rank's checkpointed forwards as (stage, microbatch))."""
    _refuse(s)
    lines, checkpointed = {}, {}
    for r, line in enumerate(s.torch_actions(compute_only)):
        checkpointed[r] = set()
        lines[r] = [_action(c, checkpointed[r]) for c in line]
    return lines, checkpointed


def actions(
    schedule: Schedule | str | os.PathLike, compute_only: bool = False
) -> dict[int, list[_Action]]:
    """Every rank's actions as torch ``_Action`` objects (compute+comms unless
    ``compute_only``), built from pipec's exporter without a CSV round trip. Memory
    instructions are actions of a :class:`MemoryAction` type (compute+comms only); a
    checkpointed forward is a ``FORWARD``."""
    return _actions(_as_schedule(schedule), compute_only)[0]


def _torch_order(compute: dict[int, list[_Action]], last_stage: int) -> list[int]:
    """The user's microbatch ids in the order the last stage runs their forwards (every rank's
    compute-only actions; an ``OVERLAP_F_B``'s forward counts where the pair runs).

    torch's runtime appends each loss to its ``_internal_losses`` as the last stage's forward
    runs, reads microbatch m's loss back from position m for its backward
    (``_maybe_get_loss``) and returns the list as the step's losses; the step's inputs are
    handed out by action id (``arg_mbs[m]`` for microbatch m). So torch runs a plan correctly
    only when its last stage's forwards come in id order 0, 1, 2, ... A plan reordered by
    ``microbatch_order`` (the k-th microbatch the schedule runs is the user's ``order[k]``)
    keeps the user's ids in its rank files; :func:`build_schedule` gives torch the id ``k`` for
    the user's microbatch ``order[k]`` (this list) and permutes inputs and losses to match."""
    T = _ComputationType
    order = []
    for r in sorted(compute):
        for a in compute[r]:
            for sub in a.sub_actions or (a,):
                if sub.computation_type == T.FORWARD and sub.stage_index == last_stage:
                    order.append(sub.microbatch_index)
    return order


def _relabel(a: _Action | None, torch_of: Sequence[int]) -> _Action | None:
    """``a`` with its microbatch (and its sub-actions') renamed ``torch_of[mb]``."""
    if a is None:
        return None
    subs = a.sub_actions
    if subs is not None:
        subs = tuple(_relabel(x, torch_of) for x in subs)
    mb = a.microbatch_index
    return _Action(a.stage_index, a.computation_type, None if mb is None else torch_of[mb], subs)


# --------------------------------------------------------------------------- memory instructions


def _detach_like(x: Any) -> Any:
    """``x`` with every tensor detached, keeping whether it requires grad (a recompute must
    build the same graph: which tensors an op saves depends on which inputs require grad)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_detach_like(v) for v in x)
    if isinstance(x, dict):
        return {k: _detach_like(v) for k, v in x.items()}
    return x


class SavedActivations(ActivationStore):
    """The activations of one rank's forwards that its memory instructions act on.

    Every forward of a (stage, microbatch) that the rank offloads or checkpoints runs inside
    ``torch.autograd.graph.saved_tensors_hooks`` (entered by the stage's forward context,
    ``PipelineStage.register_forward_context``): each tensor autograd saves for the backward
    is packed into a handle here, and the backward unpacks it from the handle. Tensors whose
    storage the stage keeps anyway (its inputs, parameters and buffers) stay where they are;
    the others are the forward's activations, which the memory instructions move:

    - ``offload``: copied to host memory, the device copy released (on CUDA into pinned
      memory on a side stream, which first waits for the compute stream; on CPU into a
      separate host copy);
    - ``reload``: copied back (CUDA: on the same side stream; the backward's compute stream
      waits for the copy when it unpacks the tensor);
    - ``wait_offload``: the compute stream waits for the offload (CUDA; on CPU the copy has
      ended already);
    - checkpointed forward: its activations are dropped when it ends (its inputs stay: the
      stage keeps them for the backward), with the RNG and autocast state it ran under;
    - ``recompute``: the stage's forward runs again on the kept inputs under that state, and
      the tensors it saves fill the dropped handles, in order (torch's non-reentrant
      ``checkpoint`` matches them the same way); the recomputed graph itself is discarded.
      So the activations are rebuilt where the program has the ``recompute``, not inside the
      backward as ``torch.utils.checkpoint`` would.

    A handle lives as long as the autograd graph that holds it: after the backward the
    activations are freed as without pipec. :attr:`events` records each step of the current
    training step (:class:`MemoryEvent`). The offload store itself is shared with
    :mod:`pipec.megatron` (``pipec._offload``)."""

    def __init__(self, stages: Sequence[Any], checkpointed: set, offloaded: set):
        super().__init__()
        self._stages = {st.stage_index: st for st in stages}
        self._checkpointed = set(checkpointed)
        self._managed = set(checkpointed) | set(offloaded)
        self._armed: _Entry | None = None
        self._hooks: list[Any] = []  # what attach registered, for detach

    def attach(self) -> None:
        """Register the forward context and the input recorder on every stage with a managed
        forward."""
        for idx in sorted({s for s, _ in self._managed}):
            st = self._stages[idx]
            try:
                self._hooks.append(st.register_forward_context(self._forward_context))
            except RuntimeError as e:
                self.detach()
                raise PipecError(
                    f"stage {idx}: {e}; pipec runs its memory instructions through the stage's "
                    "forward context and needs it free (a runtime built earlier on this stage "
                    "releases it with runtime.pipec_memory.detach())"
                ) from None
            self._hooks.append(
                st.submod.register_forward_pre_hook(self._record_inputs, with_kwargs=True)
            )

    def detach(self) -> None:
        """Remove what :meth:`attach` registered: the stages run their forwards as without
        pipec (and a runtime with no memory instructions left to run)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- the forward

    def _record_inputs(self, module, args, kwargs):
        entry = self._armed
        if entry is not None and entry.inputs is None:
            entry.inputs = (args, kwargs)

    @contextlib.contextmanager
    def _forward_context(self, info: Any) -> Iterator[None]:
        key = (info.stage_index, info.microbatch_index)
        if info.is_metadata_inference or key not in self._managed:
            yield
            return
        entry = self.open(key, key in self._checkpointed)
        stage = self._stages[key[0]]
        if entry.checkpoint:
            entry.rng = _rng_state(stage.device)
            dev = torch.device(stage.device).type
            entry.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self._armed = entry
        try:
            with self.saving(entry):
                yield
        finally:
            self._armed = None
        self.settle(entry, _kept_storages(entry.inputs, stage.submod))
        if not entry.checkpoint:
            entry.inputs = None  # only a recompute needs them

    def recompute(self, stage: int, mb: int) -> None:
        entry = self._entry("recompute", stage, mb, "dropped")
        st = self._stages[stage]
        if entry.inputs is None:
            raise PipecError(f"recompute(stage {stage}, mb {mb}): its forward recorded no inputs")
        args, kwargs = _detach_like(entry.inputs)
        fresh: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            fresh.append(t.detach())

        def unpack(_: None) -> torch.Tensor:
            raise PipecError("the recomputed graph is not for backward")

        dev = torch.device(st.device)
        kind, enabled, dtype = entry.autocast
        with (
            torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []),
            torch.enable_grad(),
            torch.autocast(kind, dtype=dtype, enabled=enabled),
        ):
            _set_rng_state(entry.rng, dev)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                _compat.torch_stage_forward(st)(*args, **kwargs)
        if len(fresh) != len(entry.saved) or any(
            (t.shape, t.dtype) != h.meta for t, h in zip(fresh, entry.saved, strict=True)
        ):
            raise PipecError(
                f"recompute(stage {stage}, mb {mb}): the forward saved "
                f"{[tuple(h.meta[0]) for h in entry.saved]} for the backward, the recompute "
                f"{[tuple(t.shape) for t in fresh]}; a recomputed forward must do what the "
                "forward did (same operations on the same inputs)"
            )
        for h, t in zip(entry.saved, fresh, strict=True):
            if h.tensor is None:
                h.tensor = t
        entry.where = "device"
        self._event("recompute", entry)
        del self._entries[(stage, mb)]

    def run(self, action: _Action, ctx: Any = None) -> None:
        """Execute a :class:`MemoryAction` (what the runtime calls for each)."""
        {
            MemoryAction.OFFLOAD: self.offload,
            MemoryAction.RELOAD: self.reload,
            MemoryAction.WAIT_OFFLOAD: self.wait_offload,
            MemoryAction.RECOMPUTE: self.recompute,
        }[action.computation_type](action.stage_index, action.microbatch_index)


def _rng_state(device: Any) -> tuple:
    dev = torch.device(device)
    cuda = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, dev: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, dev)


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def _fsdp_modules(module: Any, fsdp: type, under: bool = False):
    """(FSDP module, whether it is a root: no FSDP ancestor) for every FSDP module inside."""
    here = isinstance(module, fsdp)
    if here:
        yield module, not under
    for child in module.children():
        yield from _fsdp_modules(child, fsdp, under or here)


def reshards_after_forward(stage: Any) -> bool:
    """Whether ``stage.submod`` is FSDP2-sharded (``fully_shard``) with parameters that are
    resharded after forward: ``reshard_after_forward`` true (or an int) on it or on any FSDP
    module inside it, as FSDP2 will apply it after its lazy init.

    Such a stage swaps its sharded parameters back into the module after every forward, so a
    later ``I`` or ``W`` of torch's split backward (``stage_backward_input`` and
    ``stage_backward_weight`` look the weights up through ``submod.parameters()``) finds
    parameters that are not in the forward's autograd graph and drops or misplaces the weight
    gradients. Raises :class:`pipec.PipecError` when such FSDP modules sit inside a stage whose
    submodule is not an FSDP module itself: torch's runtime then issues no ``UNSHARD`` for the
    stage and the repair cannot be expressed."""
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return False
    reshards = any(
        _compat.fsdp_reshards_after_forward(m, root)
        for m, root in _fsdp_modules(stage.submod, fsdp)
    )
    if reshards and not isinstance(stage.submod, fsdp):
        raise PipecError(
            f"stage {stage.stage_index}: FSDP modules inside its submodule reshard after "
            "forward, but the submodule itself is not fully_shard-ed; torch's pipeline "
            "runtime gathers only stages whose submodule is an FSDPModule, so the split "
            "backward (I/W) of this schedule cannot be repaired. Apply fully_shard to the "
            "stage's submodule too, or use reshard_after_forward=False"
        )
    return reshards


def regather_for_split_backward(
    line: Sequence[_Action], stages: set[int] | Sequence[int]
) -> list[_Action]:
    """``line`` (one rank's compute+comms actions) with ``RESHARD`` + ``UNSHARD`` of stage s
    inserted before each ``I``/``W`` of s that would otherwise run on s's sharded parameters,
    for the stages in ``stages`` (those that reshard after forward).

    Tracked per stage, as FSDP2 leaves it: a forward reshards; ``UNSHARD``, and a full backward
    (FSDP's pre-backward hook; torch's stage turns reshard-after-backward off) leave it
    gathered; ``I`` and ``W`` need it gathered and keep it so; ``RESHARD`` frees it. So a run
    of ``I``/``W`` with no forward of the stage in between costs one all-gather, which
    replaces the one FSDP's own pre-backward hook would issue in the ``I``: the only
    all-gathers added to what torch issues are those before a ``W`` whose ``I`` was followed by
    a forward of the same stage. The ``RESHARD`` is torch's bookkeeping (its runtime refuses to
    ``UNSHARD`` a stage it still counts as gathered); on a stage FSDP has already resharded it
    frees nothing."""
    watched = set(stages)
    gathered = dict.fromkeys(watched, True)  # the exporter starts each line with UNSHARDs
    T = _ComputationType
    after = {
        T.FORWARD: False,
        T.FULL_BACKWARD: True,
        T.BACKWARD_INPUT: True,
        T.BACKWARD_WEIGHT: True,
        T.UNSHARD: True,
        T.RESHARD: False,
    }
    out: list[_Action] = []
    for a in line:
        for sub in a.sub_actions or (a,):
            s, ty = sub.stage_index, sub.computation_type
            if s not in watched:
                continue
            if ty in (T.BACKWARD_INPUT, T.BACKWARD_WEIGHT) and not gathered[s]:
                out.append(_Action(s, T.RESHARD, None))
                out.append(_Action(s, T.UNSHARD, None))
            if ty in after:
                gathered[s] = after[ty]
        out.append(a)
    return out


class PipecScheduleRuntime(_compat.torch_schedule_runtime()):
    """torch's ``_PipelineScheduleRuntime`` executing a pipec schedule's actions as written.

    ``step`` and ``eval`` are torch's. ``eval`` needs a forward-only pipec schedule: the
    actions of a training schedule contain backwards, which torch cannot skip without changing
    the send/receive order pipec verified, so that is refused rather than silently changed.
    """

    pipec_schedule: Schedule
    #: The user's microbatch ids in torch's order (torch's microbatch k is the user's
    #: ``pipec_microbatch_order[k]``), when the plan's last stage runs its forwards out of id
    #: order; ``None`` when torch's ids are the user's.
    pipec_microbatch_order: list[int] | None = None
    #: This rank's last stage, if it has it (whose outputs a relabelled step puts back).
    pipec_last_stages: Sequence[Any] = ()
    #: The rank's offloaded and checkpointed activations, when its program has memory
    #: instructions (else ``None``).
    pipec_memory: SavedActivations | None = None
    #: The rank's receive slots, when the schedule has a buffer plan (else ``None``).
    pipec_slots: SlotPool | None = None

    def _initialize_stages(self, *args, **kwargs):
        """torch's stage initialisation (shape inference, receive descriptors; a no-op once
        done), then a buffer plan's slots, allocated once, before the first action."""
        _compat.torch_initialize_stages(self, *args, **kwargs)
        if self.pipec_slots is not None:
            self.pipec_slots.allocate()

    def step(self, *args, **kwargs):
        # eval() comes through here with backward off; a direct step() would run backwards.
        if self.pipec_schedule.forward_only and _compat.torch_has_backward(self):
            raise PipecError(
                "this pipec schedule is forward-only (compiled with forward_only=True): "
                "call .eval(...), or compile a training schedule for .step(...)"
            )
        if self.pipec_memory is None:
            out = super().step(*args, **kwargs)
            self._check_slots()
            return out
        self.pipec_memory.begin_step()
        out = super().step(*args, **kwargs)
        self._check_slots()
        left = self.pipec_memory.pending()
        if left and _compat.torch_has_backward(self):
            raise PipecError(
                f"the step ended with the activations of {left} (stage, microbatch) neither "
                "reloaded nor recomputed"
            )
        return out

    def _check_slots(self) -> None:
        held = self.pipec_slots.pending() if self.pipec_slots is not None else {}
        if held:
            raise PipecError(
                f"the step ended with buffer slots {sorted(held)} holding messages no pass "
                f"consumed: {held}"
            )

    def _step_microbatches(
        self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, *args, **kwargs
    ):
        """torch's step over the split microbatch lists (``_compat.torch_step_microbatches``),
        with a reordered plan's lists relabelled: the caller's microbatch ``i`` (``arg_mbs[i]``,
        ``kwarg_mbs[i]``, ``target_mbs[i]``, chunk ``i`` of a whole batch) is handed to torch
        under its torch id, and the losses and outputs torch collects in torch's order are put
        back in the caller's. A list of another length is passed on as it is, for torch to
        refuse in its own words."""
        order = self.pipec_microbatch_order
        if order is None:
            return _compat.torch_step_microbatches(
                self, arg_mbs, kwarg_mbs, target_mbs, losses, *args, **kwargs
            )
        m = len(order)

        def to_torch(mbs):
            if isinstance(mbs, list) and len(mbs) == m:
                return [mbs[u] for u in order]
            return mbs

        out = _compat.torch_step_microbatches(
            self,
            to_torch(arg_mbs),
            to_torch(kwarg_mbs),
            to_torch(target_mbs),
            losses,
            *args,
            **kwargs,
        )
        at = [0] * m  # the caller's microbatch u is torch's at[u]
        for k, u in enumerate(order):
            at[u] = k
        if isinstance(losses, list) and len(losses) == m:
            losses[:] = [losses[at[u]] for u in range(m)]
        for st in self.pipec_last_stages:
            chunks = _compat.torch_output_chunks(st)
            if len(chunks) == m:
                chunks[:] = [chunks[at[u]] for u in range(m)]
        return out

    def eval(self, *args, **kwargs):
        if not self.pipec_schedule.forward_only:
            raise PipecError(
                f"{self.pipec_schedule.kind} is a training schedule: its verified actions "
                "include backwards and the sends/receives that go with them, which torch's "
                "eval() would have to drop. Build a second schedule from "
                "pipec.compile(..., forward_only=True) for evaluation"
            )
        return _compat.torch_schedule_eval(self, *args, **kwargs)


def _memory_plan(line: list[_Action], checkpointed: set) -> tuple[set, set] | None:
    """(checkpointed, offloaded) forwards of a rank's actions, or ``None`` without memory
    instructions."""
    offloaded = {
        (a.stage_index, a.microbatch_index)
        for a in line
        if a.computation_type == MemoryAction.OFFLOAD
    }
    if not offloaded and not checkpointed:
        return None
    return set(checkpointed), offloaded


def _refuse_fsdp_memory(stages: Sequence[Any], plan: tuple[set, set]) -> None:
    fsdp = _fsdp_module_class()
    managed = {s for s, _ in plan[0] | plan[1]}
    for st in stages:
        if fsdp is None or st.stage_index not in managed:
            continue
        if any(isinstance(m, fsdp) for m in st.submod.modules()):
            raise PipecError(
                f"stage {st.stage_index} is FSDP2-sharded and this rank offloads or "
                "checkpoints its activations; pipec.torch does not run memory instructions "
                "on FSDP stages (FSDP2 frees and refills the gathered parameters that the "
                "forward saves)"
            )


def _message_tokens(s: Schedule, rank: int) -> dict[tuple[str, str, int, int], int]:
    """``(op, payload, stage, mb) -> tokens`` of every send and receive of ``rank`` (``stage``
    is the producer's, as the rank file names it): the sizes the plan gives its messages."""
    return {
        (i.op.name, i.payload, i.stage, i.mb): i.tokens
        for i in s.instructions(rank)
        if i.op in (Op.sized_send, Op.sized_recv, Op.sized_slotted_send, Op.sized_slotted_recv)
    }


def _size_messages(
    s: Schedule,
    stages: Sequence[Any],
    rank: int,
    token_dim: int,
    user_of: Sequence[int] | None = None,
) -> None:
    """Size every receive of this rank's stages from the plan, per microbatch.

    torch's runtime allocates a receive buffer from the stage's metadata, inferred once from
    the first microbatch (or given), so every microbatch would be received at that size
    (pytorch #159942, #126600). torch 2.15 keeps one receive descriptor per microbatch and
    allocates its buffer only when the receive is built (``get_fwd_recv_ops(mb)``,
    ``get_bwd_recv_ops(mb)``): wrapping those two methods of each stage, the descriptors of
    microbatch ``mb`` get the plan's ``tokens`` along ``token_dim`` just before torch
    allocates from them. No shape is exchanged. The send side is held to the same sizes:
    a tensor whose size along ``token_dim`` is not its send's ``tokens`` raises
    :class:`pipec.PipecError` naming the rank, stage and microbatch, before it is posted.

    ``user_of``: when :func:`build_schedule` relabelled the microbatches for torch, the user's
    id of torch's microbatch k is ``user_of[k]``; torch calls the wrapped methods with its own
    ids, the plan (and every message here) names the user's."""
    plan = _message_tokens(s, rank)

    def user(mb: int) -> int:
        return mb if user_of is None else user_of[mb]

    def tokens(op: str, payload: str, producer: int, mb: int, stage: int) -> int:
        t = plan.get((op, payload, producer, mb))
        if t is None:
            raise PipecError(
                f"rank {rank}, stage {stage}: the plan has no {op} of the {payload} of stage "
                f"{producer}, microbatch {mb}, so it gives that message no size"
            )
        return t

    def resize(st: Any, grad: bool, mb: int, n: int) -> None:
        for info in _compat.torch_recv_infos(st, grad, mb):
            try:
                _compat.torch_resize_recv(info, token_dim, n)
            except (TypeError, IndexError) as e:
                raise PipecError(
                    f"rank {rank}, stage {st.stage_index}, microbatch {user(mb)}: {e} "
                    f"(token_dim={token_dim})"
                ) from None

    def check_sends(st: Any, ops: list, payload: str, mb: int) -> list:
        if not ops:
            return ops
        n = tokens("send", payload, st.stage_index, user(mb), st.stage_index)
        for op in ops:
            t = op.tensor
            if t.dim() <= token_dim or t.shape[token_dim] != n:
                raise PipecError(
                    f"rank {rank}, stage {st.stage_index}, microbatch {user(mb)}: the {payload} to "
                    f"send has shape {tuple(t.shape)}, but the plan sends {n} tokens along "
                    f"dimension {token_dim} (lengths={s.lengths!r})"
                )
        return ops

    for st in stages:
        idx = st.stage_index
        fwd_recv, bwd_recv = st.get_fwd_recv_ops, st.get_bwd_recv_ops
        fwd_send, bwd_send = st.get_fwd_send_ops, st.get_bwd_send_ops

        def get_fwd_recv_ops(mb, st=st, idx=idx, orig=fwd_recv):
            if not st.is_first:
                resize(st, False, mb, tokens("recv", "act", idx - 1, user(mb), idx))
            return orig(mb)

        def get_bwd_recv_ops(mb, st=st, idx=idx, orig=bwd_recv):
            if not st.is_last and _compat.torch_recv_infos(st, True, mb):
                resize(st, True, mb, tokens("recv", "grad", idx + 1, user(mb), idx))
            return orig(mb)

        def get_fwd_send_ops(mb, st=st, orig=fwd_send):
            return check_sends(st, orig(mb), "act", mb)

        def get_bwd_send_ops(mb, st=st, orig=bwd_send):
            return check_sends(st, orig(mb), "grad", mb)

        st.get_fwd_recv_ops = get_fwd_recv_ops
        st.get_bwd_recv_ops = get_bwd_recv_ops
        st.get_fwd_send_ops = get_fwd_send_ops
        st.get_bwd_send_ops = get_bwd_send_ops


def _edges(s: Schedule) -> list[tuple[int, int]]:
    """The directed (source rank, destination rank) pairs of the schedule's messages, in
    sorted order: an activation from each stage's rank to the next stage's, and, in training,
    a gradient back. Every rank computes the same list, so every rank creates the groups in
    one global order (what ``new_group(use_local_synchronization=True)`` needs)."""
    rank_of = s.stage_to_rank
    edges = set()
    for a, b in itertools.pairwise(rank_of):
        if a != b:
            edges.add((a, b))
            if not s.forward_only:
                edges.add((b, a))
    return sorted(edges)


def _rounds(edges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``edges`` in rounds of rank-disjoint edges (each edge in the first round where neither
    of its ranks is taken yet), the same on every rank: one ``split_group`` call per round
    creates a round's groups."""
    rounds: list[tuple[set, list]] = []
    for a, b in edges:
        for used, members in rounds:
            if a not in used and b not in used:
                break
        else:
            used, members = set(), []
            rounds.append((used, members))
        used.update((a, b))
        members.append((a, b))
    return [m for _, m in rounds]


def p2p_groups(s: Schedule, stages: Sequence[Any]) -> Callable[[int, int], Any] | None:
    """The process group of each message of ``s`` (:attr:`pipec.Schedule.p2p_groups`), as a
    function of its (source stage, destination stage); ``None`` under ``pair``, torch's own
    communicators (the stages' group, whose backend keeps one lazily made communicator per pair
    of ranks for point-to-point ops).

    ``direction`` makes two groups over the whole pipeline group, one for the downstream
    messages (activations, stage ``s`` to ``s + 1``, a looped schedule's wrap-around from the
    last rank to rank 0 included) and one for the upstream ones (gradients): pytorch #186173.
    ``edge`` makes one two-rank group per directed edge (source rank, destination rank):
    pytorch #196666. They are split from the stages' group (``torch.distributed.split_group``,
    one call per round of rank-disjoint edges, :func:`_rounds`), as torch 2.15's own per-edge
    groups are: a collective of the pipeline group only, which :func:`build_schedule` runs on
    every rank of it. torch names a split group from its ranks salted with the number of groups
    the calling process has created, so the pipeline's ranks must have created equally many
    before (as for any group torch makes).
    """
    kind = s.p2p_groups
    if kind == "pair":
        return None
    dist = torch.distributed
    parent = stages[0].group
    if parent is None:
        parent = dist.distributed_c10d._get_default_group()
    glob = [dist.get_global_rank(parent, r) for r in range(s.pp)]
    rank_of = s.stage_to_rank
    if kind == "direction":
        down = dist.split_group(parent_pg=parent, split_ranks=[glob], group_desc="pipec_down")
        up = dist.split_group(parent_pg=parent, split_ranks=[glob], group_desc="pipec_up")
        return lambda src, dst: down if src < dst else up
    if kind != "edge":
        raise PipecError(f"unknown p2p_groups {kind!r} (expected pair, direction, edge)")
    me = stages[0].group_rank
    edges = {}
    for k, rnd in enumerate(_rounds(_edges(s))):
        g = dist.split_group(
            parent_pg=parent,
            split_ranks=[sorted((glob[a], glob[b])) for a, b in rnd],
            group_desc=f"pipec_edges_{k}",
        )
        for a, b in rnd:
            if me in (a, b):
                edges[(a, b)] = g

    def of(src: int, dst: int) -> Any:
        key = (rank_of[src], rank_of[dst])
        if key not in edges:
            raise PipecError(
                f"no edge group for a message from stage {src} (rank {key[0]}) to stage {dst} "
                f"(rank {key[1]}): this rank is not on that edge, or the stages are not adjacent"
            )
        return edges[key]

    return of


def _use_groups(s: Schedule, stages: Sequence[Any]) -> None:
    """Post each message of ``stages`` on its group (:func:`p2p_groups`): torch's stages ask
    ``_get_p2p_group(source_stage, destination_stage)`` for the group of every send and
    receive they build, and torch's ``_batch_p2p`` issues a batch that spans groups as one
    batch per group, in group-name order on every rank."""
    of = p2p_groups(s, stages)
    if of is None:
        return
    for st in stages:
        _compat.torch_set_p2p_group(st, of)


def build_schedule(
    schedule: Schedule | str | os.PathLike,
    stages: Sequence[Any],
    loss_fn: Callable[..., torch.Tensor] | None,
    n_microbatches: int | None = None,
    scale_grads: bool = True,
    token_dim: int = 0,
) -> PipecScheduleRuntime:
    """A torch pipeline schedule that runs ``schedule`` (a :class:`pipec.Schedule` or the path
    of a compiled directory, loaded with every ``pipec-run`` check) on this rank.

    ``stages`` are this rank's ``torch.distributed.pipelining.PipelineStage``s in the order of
    :func:`stage_indices`. The result has torch's schedule interface (``.step(*args,
    target=..., losses=...)``, ``.eval(...)`` for forward-only schedules) and executes pipec's
    instruction stream for this rank on torch's ``_PipelineScheduleRuntime``: every compute,
    send and receive in pipec's order, with torch's ``WAIT_SEND_*`` actions for the sends
    (pipec's own ``wait`` instructions are left to torch, which waits for a receive right before
    the compute that uses it); overlapped forward/backward pairs as ``OVERLAP_F_B``. Whatever
    torch cannot run as pipec verified it is refused with :class:`pipec.PipecError`, never
    changed.

    FSDP2 (``fully_shard``) stages that reshard after forward and run split backward (``I``,
    ``W``) get a ``RESHARD`` + ``UNSHARD`` before each ``I``/``W`` that would otherwise find
    their sharded parameters (:func:`regather_for_split_backward`): without it torch drops or
    corrupts their weight gradients, in its own zero-bubble classes too. Nothing else changes.

    Memory instructions (``offload``, ``reload``, ``wait_offload``, ``recompute``, checkpointed
    forwards) run where the rank's program has them, as actions of :class:`MemoryAction` types the runtime
    hands to a :class:`SavedActivations` (``runtime.pipec_memory``), which manages the saved
    tensors of the forwards they name through the stages' forward contexts (so those stages
    must have none of their own, and must not be FSDP-sharded).

    A schedule with microbatch lengths (``pipec.compile(..., lengths=...)``) sizes every
    receive from the plan: the tensors between stages hold each microbatch's tokens along
    ``token_dim`` (0 for packed ``[tokens, hidden]``; 1 for ``[1, tokens, hidden]``), and
    torch's receive buffers, sized once per stage by torch itself, are resized per microbatch
    before each receive (docs/torch.md, "Microbatches of different lengths"). Pass each
    microbatch's inputs with ``step(arg_mbs=..., target_mbs=...)`` (torch cannot split a
    batch unevenly); for the per-token mean loss over the step use ``scale_grads=False`` and
    a ``loss_fn`` that divides the microbatch's summed loss by the step's tokens.

    A schedule with a buffer plan (``pipec.compile(..., buffer_plan=True)``) receives into its
    slots: each rank allocates one tensor per slot that holds a receive, once, right after
    torch's shape inference at the first step, as large as the largest message the plan puts
    there; every receive lands in a view of its slot, and the pass that consumes it copies it
    out, freeing the slot as the plan does (``runtime.pipec_slots``, a :class:`SlotPool`;
    docs/torch.md, "Buffer plan: receives in fixed slots").
    """
    s = _as_schedule(schedule)
    _refuse(s)
    stages = list(stages)
    if not stages:
        raise PipecError("build_schedule needs this rank's PipelineStages (got none)")
    group_size, rank = stages[0].group_size, stages[0].group_rank
    if group_size != s.pp:
        raise PipecError(
            f"world size mismatch: the schedule is compiled for pp={s.pp} ranks, but the "
            f"pipeline group of these stages has {group_size} ranks"
        )
    for st in stages:
        if st.num_stages != s.num_stages:
            raise PipecError(
                f"stage {st.stage_index} was built for a model of {st.num_stages} stages, "
                f"but the schedule has {s.num_stages}"
            )
        if (st.group_size, st.group_rank) != (group_size, rank):
            raise PipecError("all stages given to build_schedule must be on one rank and group")
    want = stage_indices(s, rank)
    got = [st.stage_index for st in stages]
    if got != want:
        raise PipecError(
            f"rank {rank} must build stages {want} of {s.kind} "
            f"(pipec.torch.stage_indices(schedule, {rank})), in that order; got {got}"
        )
    m = s.num_microbatches
    if n_microbatches is not None and n_microbatches != m:
        raise PipecError(
            f"n_microbatches={n_microbatches}, but the schedule is compiled for {m} microbatches"
        )
    if loss_fn is None and not s.forward_only:
        raise PipecError("a training schedule needs a loss_fn (torch runs backward from it)")
    comms, checkpointed = _actions(s)
    _refuse(s, placement_only=False)
    compute = actions(s, compute_only=True)
    order = _torch_order(compute, s.num_stages - 1)
    if sorted(order) != list(range(m)):
        raise PipecError(
            f"{s.kind}: the last stage runs the forwards of microbatches {order}, not each of "
            f"0..{m - 1} once; torch's runtime needs one loss per microbatch"
        )
    relabelled = order != list(range(m))
    if relabelled:
        # torch's id k is the user's microbatch order[k] (_torch_order): the last stage's
        # forwards then come in torch's id order, as its loss list needs.
        torch_of = [0] * m
        for k, u in enumerate(order):
            torch_of[u] = k
        comms = {r: [_relabel(a, torch_of) for a in line] for r, line in comms.items()}
        compute = {r: [_relabel(a, torch_of) for a in line] for r, line in compute.items()}
        checkpointed = {r: {(st, torch_of[mb]) for st, mb in c} for r, c in checkpointed.items()}
    split = {
        a.stage_index
        for c in comms[rank]
        for a in c.sub_actions or (c,)
        if a.computation_type in (_ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT)
    }
    resharding = [
        st.stage_index for st in stages if st.stage_index in split and reshards_after_forward(st)
    ]
    if resharding:
        comms[rank] = regather_for_split_backward(comms[rank], resharding)
    runtime = PipecScheduleRuntime(
        stages,
        n_microbatches=m,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
    )
    runtime.pipec_schedule = s
    _use_groups(s, stages)
    if relabelled:
        runtime.pipec_microbatch_order = order
        runtime.pipec_last_stages = [st for st in stages if st.is_last]
    if _torch_slots.has_plan(s):
        # Installed before the lengths wrappers, which then run first: a slot's view of a
        # receive is cut from the descriptors already resized to the plan's tokens.
        runtime.pipec_slots = SlotPool(s, stages, rank, token_dim, order if relabelled else None)
        _torch_slots.install(runtime.pipec_slots, stages)
    if s.lengths is not None:
        if isinstance(token_dim, bool) or not isinstance(token_dim, int) or token_dim < 0:
            raise PipecError(
                f"token_dim must be a dimension index (an int >= 0), not {token_dim!r}"
            )
        _size_messages(s, stages, rank, token_dim, order if relabelled else None)
    memory = _memory_plan(comms[rank], checkpointed[rank])
    if memory is not None:
        _refuse_fsdp_memory(stages, memory)
        runtime.pipec_memory = SavedActivations(stages, *memory)
        runtime.pipec_memory.attach()
        for ty in MemoryAction:
            _compat.torch_register_action(runtime, ty, runtime.pipec_memory.run)
    mapping = dict(enumerate(s.stage_to_rank))
    if s.forward_only:
        # torch's validation counts backwards for training; a forward-only program is installed
        # as written with pipec's placement.
        _compat.torch_install_forward_only(runtime, stages, compute, comms, mapping)
    else:
        _compat.torch_install_actions(runtime, compute, comms)
        placed = _compat.torch_stage_placement(runtime)
        if placed != mapping:
            raise PipecError(
                f"torch placed the stages as {placed}, pipec as {mapping}; refusing to run"
            )
    return runtime
