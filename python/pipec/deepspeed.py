"""Run pipec's verified schedules on DeepSpeed's ``PipelineEngine`` (DeepSpeed 0.19.8).

:func:`use` installs this rank's pipec instruction stream on an engine made by
``deepspeed.initialize(model=PipelineModule(...), ...)``: ``engine.train_batch`` then runs a
training schedule and ``engine.eval_batch`` a forward-only one, with DeepSpeed's own forward,
backward, data loading, gradient reduction, optimizer step and loss reporting. What the adapter
changes, it changes on the instance (``_INSTRUCTION_MAP``, the two schedule factories and
``_exec_schedule``, through :mod:`pipec._compat`), as DeepSpeed's own ``DualPipeVEngine`` does on
its class:

- Sends and receives run one at a time, blocking (DeepSpeed's ``p2p.send``/``recv``; gloo's send
  waits for its receive), in the order :meth:`pipec.Schedule.blocking_order` computes by running
  the verified program under exactly that rule; a program that would stall there is refused.
- Every microbatch has its own received activations, received gradients and loss (the stock
  engine keeps one ``self.loss`` and one receive buffer, so gpipe, looped-bfs, zb-h2 and zb-1p
  would break it or train silently wrong).
- ``bwd_D`` and ``bwd_W`` are instructions of their own, split as torch's zero-bubble schedules
  split them (``torch.distributed.pipelining._backward``): ``bwd_D`` computes only the input
  gradient and keeps the gradients that reach the weights' nodes; ``bwd_W`` computes only the
  weight gradients from those, into ``.grad``, before DeepSpeed's ``ReduceGrads`` and
  ``OptimizerStep``. Together they do the work of one whole backward. In bf16 (DeepSpeed's
  ``BF16_Optimizer``) each ``bwd_W`` hands its microbatch's gradient to the optimizer's
  accumulator as DeepSpeed's own backward does; fp16's loss scaler is not reproduced (refused).

Whatever DeepSpeed cannot run as pipec verified it is refused before the first step, on every
rank alike, with :class:`pipec.PipecError`. Longer notes: ``docs/deepspeed.md``. DeepSpeed and
torch are imported only here. DeepSpeed's private parts are reached through :mod:`pipec._compat`,
and importing this module checks that the installed DeepSpeed is in the tested series
(:data:`pipec._compat.TESTED`; torch is used through public API only).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from . import Op, PipecError, Schedule, _as_schedule, _compat
from ._split_backward import split_input, split_weight

_compat.require("pipec.deepspeed", "deepspeed")

__all__ = ["DEEPSPEED_VERSION", "check", "eligible", "parts", "pipeline_module", "use"]

#: The DeepSpeed release this module is written and tested against; importing it refuses a
#: release outside its series (``pipec._compat.accepted_range("deepspeed")``).
DEEPSPEED_VERSION = _compat.TESTED["deepspeed"]


def eligible(schedule: Schedule | str | os.PathLike) -> str | None:
    """``None`` when the schedule's shape runs on DeepSpeed's ``PipelineEngine``, else why not.

    The rule (``pipec tune --target deepspeed`` uses the same): exactly one stage per rank,
    stage ``s`` on rank ``s`` (``num_stages == pp``, not V-shaped, not bidirectional). Every
    kind with that placement runs: gpipe, 1f1b, zb-h1, zb-h2, zb-1p, looped-bfs at vpp=1, tuned
    plans with one stage per rank, forward-only schedules (through ``eval_batch``).
    """
    # The one rule, in Rust: what `pipec tune --target deepspeed` filters by.
    return _as_schedule(schedule).refusal("deepspeed")


def check(
    schedule: Schedule | str | os.PathLike,
    pp: int,
    microbatches: int,
    split_backward: bool = True,
) -> Schedule:
    """Raise :class:`pipec.PipecError`, naming both sides, when ``schedule`` cannot run on a
    DeepSpeed pipeline of ``pp`` stages with ``gradient_accumulation_steps == microbatches``
    (``split_backward``: whether the engine can take ``bwd_D``/``bwd_W``, see :func:`use`).
    The verdict depends only on the schedule and the engine's configuration, so every rank
    reaches the same one. Returns the schedule."""
    s = _as_schedule(schedule)
    why = eligible(s)
    if why is not None:
        raise PipecError(f"{why}. Refusing to run it")
    if s.pp != pp:
        raise PipecError(
            f"the schedule is compiled for pp={s.pp} ranks, but the DeepSpeed engine's pipeline "
            f"has {pp} stages (PipelineModule num_stages / topology)"
        )
    if s.num_microbatches != microbatches:
        raise PipecError(
            f"the schedule is compiled for {s.num_microbatches} microbatches, but the DeepSpeed "
            f"engine runs {microbatches} (gradient_accumulation_steps), which also scales the "
            "loss: the two must be equal"
        )
    for r in range(s.pp):
        for i, ins in enumerate(s.instructions(r)):
            match ins.op:
                case Op.send | Op.recv:
                    want = r + 1 if (ins.op == Op.send) == (ins.payload == "act") else r - 1
                    if ins.peer != want:
                        raise PipecError(
                            f"rank {r}, #{i}: {ins.op} of the {ins.payload} of stage {ins.stage} "
                            f"with rank {ins.peer}; DeepSpeed's p2p sends activations only to "
                            "the next stage and gradients only to the previous one"
                        )
                case Op.bwd_D | Op.bwd_W if not split_backward:
                    raise PipecError(
                        f"{s.kind} splits the backward (rank {r}, #{i}: {ins.op}), but this "
                        "engine scales the loss (fp16's loss scaler or torch autocast's "
                        "GradScaler), which DeepSpeed applies only in its whole-backward path; "
                        "compile a kind without split backward (1f1b, gpipe) or train in bf16 "
                        "or fp32"
                    )
                case Op.sized_send | Op.sized_recv:
                    # `eligible` refuses plans with lengths first; a file that sizes its
                    # messages without them is refused here, by name.
                    raise PipecError(
                        f"rank {r}, #{i}: {ins.op.name} carries {ins.tokens} tokens; DeepSpeed's "
                        "engine sizes its receive buffers once and cannot run microbatches of "
                        "different lengths"
                    )
                case Op.fwd | Op.bwd | Op.bwd_D | Op.bwd_W | Op.fwd_bwd | Op.wait:
                    pass  # waits are left out of the blocking order (every batch blocks)
                case Op.fwd_checkpoint | Op.offload | Op.reload | Op.wait_offload | Op.recompute:
                    raise PipecError(
                        f"rank {r}, #{i}: {ins.op.name}"
                        f"{' (checkpoint)' if ins.checkpoint else ''}: offload, reload, "
                        "wait_offload, recompute and checkpointed forwards are not supported by "
                        "pipec.deepspeed yet"
                    )
                case (
                    Op.slotted_send
                    | Op.slotted_recv
                    | Op.sized_slotted_send
                    | Op.sized_slotted_recv
                ):
                    raise PipecError(
                        f"rank {r}, #{i}: {ins.op.name} names a buffer slot; DeepSpeed's engine "
                        "allocates its own pipe buffers: compile without buffer_plan"
                    )
                case _:
                    raise PipecError(f"rank {r}, #{i}: DeepSpeed has no instruction for `{ins.op}`")
    s.blocking_order()  # raises when blocking one-at-a-time P2P would stall
    return s


def parts(schedule: Schedule | str | os.PathLike) -> list[int]:
    """The schedule's layer split as DeepSpeed's ``PipelineModule.parts``: stage ``s`` holds
    layers ``parts[s]`` to ``parts[s + 1] - 1``, counting one layer per letter of the layout
    (``E``, each ``t`` or ``m``, ``L``), in order. ``"Ett|ttL"`` gives ``[0, 3, 6]``."""
    s = _as_schedule(schedule)
    out = [0]
    for stage in json.loads(s._n.header_json())["layout"]["stages"]:
        out.append(out[-1] + len(stage))
    return out


def pipeline_module(schedule: Schedule | str | os.PathLike, layers, **kwargs):
    """A DeepSpeed ``PipelineModule`` of ``layers`` split as the schedule's layout.

    DeepSpeed's ``partition_method`` (``uniform``, ``parameters``, ``type:REGEX``) balances a
    count or a weight and has no way to name an uneven split such as the one ``pipec tune``
    chooses; this builds the module with its ``parts`` set to :func:`parts` instead
    (``PipelineModule._partition_layers`` replaced on a subclass, through
    :mod:`pipec._compat`). ``layers``: one ``LayerSpec`` (or module, or callable) per letter of
    the layout, in order: the embedding for ``E``, a decoder layer for each ``t``, the final
    norm and output head as one for ``L``. ``kwargs`` go to ``PipelineModule`` (``loss_fn``,
    ``topology``, ...); ``num_stages`` is the schedule's ``pp`` unless a topology is given.
    Refused with :class:`pipec.PipecError` when the layer count is not the layout's or the
    schedule does not run on DeepSpeed (:func:`eligible`)."""
    s = _as_schedule(schedule)
    why = eligible(s)
    if why is not None:
        raise PipecError(f"{why}. Refusing to build a PipelineModule for it")
    bounds = parts(s)
    layers = list(layers)
    if len(layers) != bounds[-1]:
        raise PipecError(
            f"the schedule's layout has {bounds[-1]} layers ({s.layout}: one per letter), but "
            f"{len(layers)} were given: pass one LayerSpec per letter (E the embedding, t a "
            "decoder layer, L the final norm and head)"
        )
    if "partition_method" in kwargs:
        raise PipecError(
            "pipeline_module splits the layers as the schedule's layout; partition_method "
            "would split them otherwise: leave it out"
        )
    if "topology" not in kwargs:
        kwargs.setdefault("num_stages", s.pp)
    return _compat.ds_pipeline_module_with_parts(layers, bounds, **kwargs)


# --------------------------------------------------------------------------- instructions


def _instructions():
    """DeepSpeed instruction classes for pipec's ops (made on first use: DeepSpeed is imported
    only when an engine is given)."""
    global _INSTR
    if _INSTR is not None:
        return _INSTR
    from deepspeed.runtime.pipe import schedule as ds

    class PipecForward(ds.ForwardPass):
        """``fwd``: load the microbatch's data if this stage reads it, then DeepSpeed's forward."""

    class PipecBackward(ds.BackwardPass):
        """``bwd``: DeepSpeed's whole backward of one microbatch."""

    class PipecBackwardInput(ds.BufferOpInstruction):
        """``bwd_D``: the input gradient of one microbatch only (the weight gradients wait)."""

    class PipecBackwardWeight(ds.BufferOpInstruction):
        """``bwd_W``: the deferred weight gradients of one microbatch, into ``.grad``."""

    class PipecSendActivation(ds.SendActivation):
        pass

    class PipecRecvActivation(ds.RecvActivation):
        pass

    class PipecSendGrad(ds.SendGrad):
        pass

    class PipecRecvGrad(ds.RecvGrad):
        pass

    _INSTR = {
        Op.fwd: PipecForward,
        Op.bwd: PipecBackward,
        Op.bwd_D: PipecBackwardInput,
        Op.bwd_W: PipecBackwardWeight,
        (Op.send, "act"): PipecSendActivation,
        (Op.recv, "act"): PipecRecvActivation,
        (Op.send, "grad"): PipecSendGrad,
        (Op.recv, "grad"): PipecRecvGrad,
    }
    return _INSTR


_INSTR: dict | None = None


def _program(s: Schedule, rank: int) -> list[Any]:
    """This rank's DeepSpeed instructions, in the blocking order (one per step)."""
    cls = _instructions()
    stream = s.instructions(rank)
    out = []
    for i in s.blocking_order()[rank]:
        ins = stream[i]
        match ins.op:
            case Op.fwd_bwd:  # an overlapped pair runs as its forward, then its backward
                out.append(cls[Op.fwd](buffer_id=ins.fwd.mb))
                out.append(cls[Op.bwd](buffer_id=ins.bwd.mb))
            case Op.send | Op.recv:
                out.append(cls[(ins.op, ins.payload)](buffer_id=ins.mb))
            case _:  # fwd, bwd, bwd_D, bwd_W (check refused anything else)
                out.append(cls[ins.op](buffer_id=ins.mb))
    return out


def _schedule_class():
    from deepspeed.runtime.pipe import schedule as ds

    class PipecSchedule(ds.PipeSchedule):
        """One rank's pipec program as a DeepSpeed schedule: one instruction per step, then
        DeepSpeed's own gradient reduction and optimizer step (training)."""

        def __init__(self, program, micro_batches, stages, stage_id, train):
            super().__init__(micro_batches, stages, stage_id)
            self.program, self.train = program, train

        def num_pipe_buffers(self):
            return self.micro_batches  # one slot per microbatch: buffer_id is the microbatch

        def steps(self):
            for cmd in self.program:
                yield [cmd]
            if self.train:
                yield [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]

    return PipecSchedule


# --------------------------------------------------------------------------- handlers
# Methods of the engine (bound with MethodType by DeepSpeed's _exec_schedule).


def _tensors(x) -> list[torch.Tensor]:
    return [x] if torch.is_tensor(x) else list(x)


def _float(x) -> list[torch.Tensor]:
    return [t for t in _tensors(x) if t.is_floating_point()]


def _state(engine) -> dict:
    return engine._pipec


def _load_up_to(engine, mb: int) -> None:
    """DeepSpeed's LoadMicroBatch for every microbatch up to ``mb``, in microbatch order (the
    data iterator has no ids: its k-th item is microbatch k)."""
    st = _state(engine)
    while st["loaded"] <= mb:
        _compat.ds_instruction_map(engine)[_ds_schedule().LoadMicroBatch](engine, st["loaded"])
        st["loaded"] += 1


def _ds_schedule():
    from deepspeed.runtime.pipe import schedule as ds

    return ds


def _exec_forward(self, buffer_id):
    st = _state(self)
    if self.is_first_stage() or self.is_last_stage():
        _load_up_to(self, buffer_id)
    st["trace"].append(("fwd", self.stage_id, buffer_id))
    _compat.ds_exec_forward_pass(self, buffer_id)
    if self.is_last_stage():
        st["losses"][buffer_id] = self.loss
        if torch.is_tensor(self.loss):
            st["loss_values"][buffer_id] = self.loss.detach().clone()
        self.pipe_buffers["labels"][buffer_id] = None
    if not torch.is_grad_enabled():
        # No backward follows: the input is done with; the output lives until it is sent.
        self.pipe_buffers["inputs"][buffer_id] = None
        if self.is_last_stage():
            self.pipe_buffers["outputs"][buffer_id] = None


def _roots(self, buffer_id):
    """What a backward of this microbatch starts from: the loss on the last stage (DeepSpeed's
    output hook divides its gradient by gradient_accumulation_steps there), else the outputs
    with the received gradients."""
    st = _state(self)
    if self.is_last_stage():
        return [st["losses"][buffer_id]], None
    outputs = self.pipe_buffers["outputs"][buffer_id]
    return _float(outputs), _tensors(st["grads"][buffer_id])


def _free_after_backward(self, buffer_id):
    st = _state(self)
    st["losses"].pop(buffer_id, None)
    st["grads"].pop(buffer_id, None)
    self.pipe_buffers["outputs"][buffer_id] = None
    self.pipe_buffers["output_tensors"][buffer_id] = None
    if self.is_first_stage():
        self.pipe_buffers["inputs"][buffer_id] = None


def _exec_backward(self, buffer_id):
    st = _state(self)
    st["trace"].append(("bwd", self.stage_id, buffer_id))
    if self.is_last_stage():
        self.loss = st["losses"][buffer_id]
    else:
        g = st["grads"][buffer_id]
        self.grad_layer = g
    _compat.ds_exec_backward_pass(self, buffer_id)
    self.grad_layer = None
    _free_after_backward(self, buffer_id)


def _root_edges(self, buffer_id):
    """The backward's roots as gradient edges and their gradients (ones for the loss:
    DeepSpeed's output hook, registered by its forward, divides the gradient of the last
    stage's output by gradient_accumulation_steps, as its whole backward divides the loss)."""
    from torch.autograd.graph import get_gradient_edge

    roots, grads = _roots(self, buffer_id)
    if grads is None:
        grads = [torch.ones_like(t) for t in roots]
    pairs = [(get_gradient_edge(t), g) for t, g in zip(roots, grads) if t.requires_grad]
    return [e for e, _ in pairs], [g for _, g in pairs]


def _exec_backward_input(self, buffer_id):
    """``bwd_D``: the input gradient only (:func:`pipec._split_backward.split_input`)."""
    st = _state(self)
    st["trace"].append(("bwd_D", self.stage_id, buffer_id))
    inputs = self.pipe_buffers["inputs"][buffer_id]
    leaves = [] if inputs is None else [t for t in _float(inputs) if t.requires_grad]
    if not leaves:
        # No input gradient to send (the first stage): all of the backward is the weight pass.
        st["deferred"][buffer_id] = None
        return
    edges, grads = _root_edges(self, buffer_id)
    params = [p for p in self.module.parameters() if p.requires_grad]
    with _compat.ds_engine_backward(self):  # as DeepSpeed's own _exec_backward_pass
        st["deferred"][buffer_id] = split_input(edges, grads, leaves, params)
    # The graph from the roots down to the recorded nodes is done with (torch's split detaches
    # the outputs for the same reason): only the weights' branches live until bwd_W.
    del edges, grads
    _free_after_backward(self, buffer_id)


def _exec_backward_weight(self, buffer_id):
    """``bwd_W``: the weight gradients only (:func:`pipec._split_backward.split_weight`), into
    ``.grad`` before DeepSpeed's ReduceGrads and OptimizerStep.

    With DeepSpeed's ``BF16_Optimizer`` (bf16 training) the weight pass does what DeepSpeed's
    own backward of one microbatch does around it (``PipelineEngine._exec_backward_pass``, and
    ``engine.backward``'s prologue and epilogue on the last stage): the bf16 ``.grad`` is zeroed
    first, and afterwards added into the optimizer's fp32 master gradients
    (``update_hp_grads``; a no-op with ``immediate_grad_update``, whose hooks on ``.grad``
    accumulate it as it is written, which ``split_weight`` does through the weights'
    AccumulateGrad nodes). So every microbatch's gradient reaches the fp32 sum alone, in bf16
    exactly as the whole backward makes it, as the stock engine accumulates."""
    st = _state(self)
    st["trace"].append(("bwd_W", self.stage_id, buffer_id))
    deferred = st["deferred"].pop(buffer_id)
    bf16 = _compat.ds_bf16_optimizer(self)
    if bf16 is not None:
        bf16.clear_lp_grads()
    with _compat.ds_engine_backward(self):
        if deferred is None:
            edges, grads = _root_edges(self, buffer_id)
            params = [p for p in self.module.parameters() if p.requires_grad]
            if edges and params:
                torch.autograd.backward(edges, grads, inputs=params)
        else:
            split_weight(*deferred)
    if bf16 is not None:
        bf16.update_hp_grads(clear_lp_grads=False)
    _free_after_backward(self, buffer_id)


def _exec_send_activation(self, buffer_id):
    from deepspeed.runtime.pipe import p2p

    st = _state(self)
    outputs = self.pipe_buffers["outputs"][buffer_id]
    if self.dynamic_shape or st["first_send"]:
        st["first_send"] = False
        _compat.ds_send_tensor_meta(self, outputs, self.next_stage)
    for t in _tensors(outputs):
        p2p.send(t.contiguous(), self.next_stage)
    if not torch.is_grad_enabled():
        self.pipe_buffers["outputs"][buffer_id] = None


def _exec_recv_activation(self, buffer_id):
    from deepspeed.runtime.pipe import p2p

    st = _state(self)
    if self.dynamic_shape or st["recv_spec"] is None:
        st["recv_spec"] = _compat.ds_recv_tensor_meta(self)
    single, specs = st["recv_spec"]
    got = []
    for shape, dtype in specs:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        p2p.recv(t, self.prev_stage)
        t.requires_grad_(t.is_floating_point())
        got.append(t)
    self.pipe_buffers["inputs"][buffer_id] = got[0] if single else tuple(got)


def _exec_send_grad(self, buffer_id):
    from deepspeed.runtime.pipe import p2p

    inputs = self.pipe_buffers["inputs"][buffer_id]
    for t in _float(inputs):
        if t.grad is None:
            raise PipecError(
                f"stage {self.stage_id}, microbatch {buffer_id}: the input has no gradient to "
                "send (does the stage's output depend on its input?)"
            )
        p2p.send(t.grad, self.prev_stage)
    self.pipe_buffers["inputs"][buffer_id] = None


def _exec_recv_grad(self, buffer_id):
    from deepspeed.runtime.pipe import p2p

    outputs = self.pipe_buffers["outputs"][buffer_id]
    grads = [torch.empty_like(t) for t in _float(outputs)]
    for g in grads:
        p2p.recv(g, self.next_stage)
    _state(self)["grads"][buffer_id] = grads[0] if torch.is_tensor(outputs) else grads


_HANDLERS = {
    Op.fwd: _exec_forward,
    Op.bwd: _exec_backward,
    Op.bwd_D: _exec_backward_input,
    Op.bwd_W: _exec_backward_weight,
    (Op.send, "act"): _exec_send_activation,
    (Op.recv, "act"): _exec_recv_activation,
    (Op.send, "grad"): _exec_send_grad,
    (Op.recv, "grad"): _exec_recv_grad,
}


# --------------------------------------------------------------------------- use


def _engine_side(engine) -> tuple[int, int, bool]:
    """(pp, microbatches, split backward possible) of a PipelineEngine, refusing settings the
    adapter does not carry over."""
    try:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError as e:  # pragma: no cover - only without DeepSpeed
        raise PipecError(f"pipec.deepspeed needs DeepSpeed {DEEPSPEED_VERSION}: {e}") from e
    _compat.require_loaded("pipec.deepspeed", "deepspeed")
    if not isinstance(engine, PipelineEngine):
        raise PipecError(
            f"pipec.deepspeed.use needs the PipelineEngine that deepspeed.initialize returns for "
            f"a PipelineModule, got {type(engine).__name__}"
        )
    if isinstance(engine, DualPipeVEngine):
        raise PipecError(
            "this is a DualPipeVEngine (two stages per rank, DeepSpeed's own DualPipeV); "
            "pipec.deepspeed runs one-stage-per-rank schedules on a PipelineEngine"
        )
    for flag, what in (
        ("is_pipe_partitioned", "pipe_partitioned activations"),
        ("is_grad_partitioned", "grad_partitioned gradients"),
        ("has_attention_mask", "a boolean attention mask sent between stages"),
        ("has_bool_tensors", "boolean tensors sent between stages"),
    ):
        if getattr(engine, flag, False):
            raise PipecError(
                f"the DeepSpeed engine uses {what} ({flag}); pipec.deepspeed sends whole "
                "floating-point tensors only"
            )
    # bf16 (DeepSpeed's BF16_Optimizer) scales no loss: the weight pass feeds its fp32 master
    # gradients as DeepSpeed's own backward does (see _exec_backward_weight). fp16's dynamic
    # loss scaler and torch autocast's GradScaler scale the loss in DeepSpeed's whole-backward
    # path only (engine.backward); pipec's split does not reproduce that.
    scaled = bool(engine.fp16_enabled())
    scaled = scaled or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
    return engine.num_stages, engine.micro_batches, not scaled


def use(engine, schedule: Schedule | str | os.PathLike) -> None:
    """Run ``schedule`` (a :class:`pipec.Schedule` or a compiled directory) on ``engine``.

    ``engine`` is the ``PipelineEngine`` that ``deepspeed.initialize(model=PipelineModule(...),
    ...)`` returned on this rank. A training schedule is run by ``engine.train_batch(data_iter)``
    (which returns what DeepSpeed's returns: the mean loss of the batch, on every rank); a
    forward-only one (``pipec.compile(..., forward_only=True)``) by ``engine.eval_batch``. Call
    ``use`` once for each; the other method keeps DeepSpeed's own schedule.

    Refused with :class:`pipec.PipecError` before anything runs, on every rank alike (see
    :func:`check` and :func:`eligible`): more than one stage per rank, a V or bidirectional
    placement, a pp or microbatch count (``gradient_accumulation_steps``) other than the
    engine's, split backward on an engine that scales the loss (fp16's loss scaler, torch
    autocast's GradScaler; bf16 through DeepSpeed's ``BF16_Optimizer`` runs it), and
    engine settings the adapter does not carry over (partitioned or boolean activations).

    After a step, ``engine.pipec_trace`` holds the compute ops this rank ran, in order, as
    ``(op, stage, microbatch)``, and ``engine.pipec_losses`` (last stage) each microbatch's loss.
    """
    pp, microbatches, split_ok = _engine_side(engine)
    s = check(schedule, pp, microbatches, split_backward=split_ok)
    rank = engine.stage_id
    program = _program(s, rank)
    if not hasattr(engine, "_pipec"):
        _install(engine)
    engine._pipec_plans["eval" if s.forward_only else "train"] = (s, program)


def _install(engine) -> None:
    cls = _instructions()
    engine._pipec = _fresh_state()
    engine._pipec_plans = {}
    engine.pipec_trace = []
    engine.pipec_losses = []
    instruction_map = {
        **_compat.ds_instruction_map(engine),
        **{cls[k]: fn for k, fn in _HANDLERS.items()},
    }
    sched_cls = _schedule_class()
    stock_train, stock_eval, stock_exec = _compat.ds_schedule_methods(engine)

    def begin(plan, micro_batches, train):
        _, program = plan
        engine._pipec = _fresh_state(engine._pipec)
        engine.pipec_trace = engine._pipec["trace"]
        return sched_cls(program, micro_batches, engine.num_stages, engine.stage_id, train)

    def train_schedule():
        plan = engine._pipec_plans.get("train")
        if plan is None:
            return stock_train()
        if engine.micro_batches != plan[0].num_microbatches:
            raise PipecError(
                f"gradient_accumulation_steps is now {engine.micro_batches}, but the pipec "
                f"schedule is compiled for {plan[0].num_microbatches} microbatches"
            )
        return begin(plan, engine.micro_batches, True)

    def inference_schedule(micro_batches):
        plan = engine._pipec_plans.get("eval")
        if plan is None:
            return stock_eval(micro_batches)
        if micro_batches != plan[0].num_microbatches:
            raise PipecError(
                f"eval_batch runs {micro_batches} microbatches, but the forward-only pipec "
                f"schedule is compiled for {plan[0].num_microbatches}"
            )
        return begin(plan, micro_batches, False)

    def exec_schedule(pipe_schedule):
        stock_exec(pipe_schedule)
        if isinstance(pipe_schedule, sched_cls) and engine.is_last_stage():
            vals = engine._pipec["loss_values"]
            engine.pipec_losses = [vals[m] for m in sorted(vals)]

    _compat.ds_install(engine, instruction_map, train_schedule, inference_schedule, exec_schedule)


def _fresh_state(old: dict | None = None) -> dict:
    """Per-step state; the activation shape learned from the first receive is kept."""
    return {
        "loaded": 0,
        "losses": {},
        "loss_values": {},
        "grads": {},
        "deferred": {},
        "trace": [],
        "first_send": True if old is None else old["first_send"],
        "recv_spec": None if old is None else old["recv_spec"],
    }
