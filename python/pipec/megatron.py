"""Run pipec's verified schedules inside Megatron-LM training (megatron-core 0.19.2).

:func:`forward_backward_func` returns a function with the signature of Megatron's
``forward_backward_func`` (what ``megatron.core.pipeline_parallel.get_forward_backward_func()``
returns) that executes this rank's pipec instruction stream with Megatron's own pieces:
``schedules.forward_step`` and ``schedules.backward_step`` (loss scaling, per-token loss,
``collect_non_loss_data``, forward-only, one data iterator per model chunk), Megatron's
``deallocate_output_tensor`` and grad-sync hooks, and P2P through ``torch.distributed`` with
exactly the communication pipec compiled and verified (a comm batch is one
``batch_isend_irecv``; Megatron's unbatched and overlapped P2P modes post every op on its own
and wait where the stream says ``wait``). :func:`stage_indices` says which global stages this
rank builds and in which order the ``model`` list holds them; :func:`stage_layers` says what
each stage holds, for building it with Megatron's own model code. Longer notes:
``docs/megatron.md``.

megatron-core and torch are imported only here; ``import pipec`` needs neither. Their private
parts are reached through :mod:`pipec._compat`, and importing this module checks that the
installed torch and megatron-core are in the tested series (:data:`pipec._compat.TESTED`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from . import (
    BatchStep,
    ComputeStep,
    Instruction,
    MemoryStep,
    Op,
    PipecError,
    Schedule,
    Step,
    WaitStep,
    _as_schedule,
    _compat,
)
from ._offload import ActivationStore, _kept_storages
from ._split_backward import split_input, split_weight

_compat.require("pipec.megatron", "torch")
_compat.require("pipec.megatron", "megatron-core")

__all__ = [
    "MEGATRON_CORE_VERSION",
    "StageLayers",
    "capture_order",
    "forward_backward_func",
    "stage_indices",
    "stage_layers",
]

#: The megatron-core release this module is written and tested against; importing it refuses
#: a release outside its series (``pipec._compat.accepted_range("megatron-core")``).
MEGATRON_CORE_VERSION = _compat.TESTED["megatron-core"]


def _manifest(s: Schedule) -> dict:
    """The manifest's ``layout`` and ``comm_policy``, and the program's NCCL stream rule
    ``streams`` (no rank file rendered)."""
    return json.loads(s._n.header_json())


def _refuse(s: Schedule, placement_only: bool = True) -> None:
    """Megatron's rule, asked of Rust (``Target::Megatron``, the one ``pipec tune --target
    megatron`` filters by): a model chunk lives on one rank, so every stage on one rank; and
    unless ``placement_only``, the memory instructions this executor runs. Forwards may enter
    in any microbatch order: Megatron's data iterators have no microbatch ids (the k-th
    ``next()`` of a chunk's iterator is microbatch k), so a chunk whose forwards are out of
    order draws through :class:`_ById`."""
    why = s._n.adapter_refusal("megatron", placement_only)
    if why is not None:
        raise PipecError(why)


def stage_indices(schedule: Schedule | str | os.PathLike, rank: int) -> list[int]:
    """The global stages pipeline rank ``rank`` must build, in the order the ``model`` list
    given to :func:`forward_backward_func` must hold them: ascending stage index.

    Looped placements (1f1b, interleaved-1f1b, zb-1p, ...) give Megatron's own order: chunk
    ``c`` of rank ``r`` is stage ``c * pp + r``. A V placement (zb-v, dualpipe-v, v-half,
    v-min) gives rank ``r`` the stages ``[r, 2 * pp - 1 - r]``: chunk 1 is *not* Megatron's
    ``pp + r``, so build it from :func:`stage_layers` rather than from Megatron's layer offsets.
    """
    s = _as_schedule(schedule)
    _refuse(s)
    return s.stages_of(rank)


@dataclass(frozen=True)
class StageLayers:
    """What one global stage holds, from the schedule's layout."""

    stage: int
    #: Global indices (0-based) of the decoder layers (``t``) of the stage, in model order.
    decoder_layers: tuple[int, ...]
    #: The stage holds the embedding (``E``): build it with ``pre_process=True``.
    pre_process: bool
    #: The stage holds the output layer and loss (``L``): ``post_process=True``.
    post_process: bool
    #: Global indices of the MTP layers (``m``) of the stage.
    mtp_layers: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)


def stage_layers(schedule: Schedule | str | os.PathLike) -> list[StageLayers]:
    """What every global stage holds (indexed by stage), from the schedule's layout: its
    decoder layers (global indices), whether it has the embedding (``pre_process``) and the
    output layer / loss (``post_process``). ``docs/megatron.md`` shows how to build a stage
    with Megatron's ``GPTModel`` from it (a ``TransformerBlockSubmodules`` with exactly
    ``num_layers`` layer specs), V placement included."""
    return _stage_layers(_manifest(_as_schedule(schedule)))


def _stage_layers(manifest: dict) -> list[StageLayers]:
    out, t, m = [], 0, 0
    for i, layers in enumerate(manifest["layout"]["stages"]):
        dec = tuple(range(t, t + layers.count("t")))
        mtp = tuple(range(m, m + layers.count("m")))
        t, m = t + len(dec), m + len(mtp)
        out.append(StageLayers(i, dec, "E" in layers, "L" in layers, mtp))
    return out


# --------------------------------------------------------------------------- CUDA graphs


def _graph_impl(config) -> str:
    """The config's CUDA-graph implementation: ``"none"``, ``"local"``, ``"transformer_engine"``
    or ``"full_iteration"`` (the deprecated ``enable_cuda_graph`` is ``"local"``)."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none" and getattr(config, "enable_cuda_graph", False):
        return "local"
    return impl


def capture_order(schedule: Schedule | str | os.PathLike, rank: int, config=None) -> list[int]:
    """The order in which pipeline rank ``rank`` captures its per-chunk CUDA graphs, as
    megatron-core's ``TECudaGraphHelper`` hands it to Transformer Engine's
    ``make_graphed_callables(..., _order=...)``: :meth:`pipec.Schedule.capture_order`, which
    for Megatron's own 1F1B and interleaved schedules is exactly megatron-core's
    ``convert_schedule_table_to_order`` (recorded: ``tests/golden/megatron/capture_order.txt.gz``).

    Refused, with the reason (:class:`pipec.PipecError`), where Megatron cannot capture the
    schedule this way: a split backward (a graphed layer's backward graph computes the input
    and the weight gradient together; Megatron captures a separate weight-gradient graph only
    under ``overlap_moe_expert_parallel_comm`` with ``delay_wgrad_compute``, in an order it
    derives itself), ``config.overlap_moe_expert_parallel_comm`` (Megatron re-pairs the order
    it is handed layer by layer for its combined 1F1B), and what the encoding cannot say
    (forward-only, a chunk whose backwards run its microbatches out of its forwards' order)."""
    s = _as_schedule(schedule)
    _refuse(s)
    if config is not None and getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise PipecError(
            "config.overlap_moe_expert_parallel_comm is set: Megatron re-pairs the capture order "
            "it is handed layer by layer for its combined 1F1B "
            "(get_overlap_moe_expert_parallel_comm_order), so pipec cannot hand it a schedule's "
            "order; capture without it"
        )
    order = s.capture_order(rank)
    split = next((abs(x) for x in order if x != int(x)), None)
    if split is not None:
        raise PipecError(
            f"rank {rank}: {s.kind} splits the backward (chunk {int(split)} has weight-gradient "
            "steps), but a graphed layer's backward graph computes the input and the weight "
            "gradient together; Megatron captures a separate weight-gradient graph only under "
            "overlap_moe_expert_parallel_comm with delay_wgrad_compute, in its own order. "
            "Use a schedule with a fused backward, or run without CUDA graphs"
        )
    return order


class _HandOver:
    """The schedule whose order megatron-core's ``TECudaGraphHelper`` captures in: the one of
    the last :func:`forward_backward_func` made under ``cuda_graph_impl="transformer_engine"``,
    and the orders it captured per rank (a later schedule must run in the same order: the
    graphs hold the captured microbatch order)."""

    schedule: ClassVar[Schedule | None] = None
    captured: ClassVar[dict[int, list]] = {}
    original: ClassVar[Callable | None] = None


def _hand_over(s: Schedule) -> None:
    """Make megatron-core's ``TECudaGraphHelper._get_cuda_graph_input_data`` (the method that
    computes the capture order with ``convert_schedule_table_to_order`` and captures) take this
    schedule's order. Megatron-LM's training loop builds that helper itself, so the method is
    wrapped once for the process; the helper's own code runs unchanged with the order handed in
    place of ``convert_schedule_table_to_order``'s result."""
    from megatron.core.transformer import cuda_graphs

    _HandOver.schedule = s
    if _HandOver.original is not None:
        return
    original = cuda_graphs.TECudaGraphHelper._get_cuda_graph_input_data
    _HandOver.original = original

    def _get_cuda_graph_input_data(self):
        sched = _HandOver.schedule
        # pp = 1: Megatron captures one microbatch ([1, -1]) and replays it for each.
        if sched is None or (
            self.pp_group.size() == 1
            and not getattr(self.config, "overlap_moe_expert_parallel_comm", False)
        ):
            return original(self)
        rank = self.pp_group.rank()
        order = capture_order(sched, rank, self.config)
        chunks = len(sched.stages_of(rank)) if sched.placement != "bidirectional" else None
        if chunks is not None and self.num_model_chunks != chunks:
            raise PipecError(
                f"rank {rank}: the CUDA-graph helper has {self.num_model_chunks} model chunks, "
                f"but {sched.kind} places {chunks} stages on this rank"
            )

        def handed(num_warmup_microbatches, num_model_chunks, schedule_table):
            if len(schedule_table) != sched.num_microbatches * num_model_chunks:
                raise PipecError(
                    f"rank {rank}: Megatron captures {len(schedule_table) // num_model_chunks} "
                    f"microbatches per chunk, but the schedule has {sched.num_microbatches}"
                )
            return list(order)

        saved = cuda_graphs.convert_schedule_table_to_order
        cuda_graphs.convert_schedule_table_to_order = handed
        try:
            out = original(self)
        finally:
            cuda_graphs.convert_schedule_table_to_order = saved
        _HandOver.captured[rank] = order
        return out

    cuda_graphs.TECudaGraphHelper._get_cuda_graph_input_data = _get_cuda_graph_input_data


def _check_graphs(s: Schedule, config, rank: int) -> None:
    """Before anything runs, under per-chunk Transformer Engine graphs
    (``cuda_graph_impl="transformer_engine"``, what ``TECudaGraphHelper`` captures): that
    Megatron can capture this schedule's order, and in the order it already captured. The
    other implementations have no order to hand over and are left as they are."""
    if _graph_impl(config) != "transformer_engine" or s.forward_only:
        return
    order = capture_order(s, rank, config)
    got = _HandOver.captured.get(rank)
    if got is not None and got != order:
        raise PipecError(
            f"rank {rank}: the CUDA graphs were captured in the order {got}, but {s.kind} runs "
            f"{order}: a captured schedule cannot change its order"
        )


# --------------------------------------------------------------------------- the executor


def _chunk_attr(chunk: torch.nn.Module, name: str):
    """An attribute of a (possibly DDP/Float16-wrapped) Megatron model chunk, or None."""
    m = chunk
    for _ in range(8):
        if hasattr(m, name):
            return getattr(m, name)
        if not hasattr(m, "module"):
            return None
        m = m.module
    return None


def _offloaded(s: Schedule, rank: int) -> set[tuple[int, int]]:
    """The forwards ``rank``'s program offloads (issue 30's ``offload``)."""
    return {(i.stage, i.mb) for i in s.instructions(rank) if i.op == Op.offload}


#: A send / receive, with or without the ``tokens`` the plan gives it (schema rows 13 and 14,
#: ``Op.sized_send`` / ``Op.sized_recv``: a schedule compiled with microbatch lengths, #38),
#: and with a buffer plan's ``slot`` (rows 15-18, #39; megatron-core allocates its own P2P
#: buffers, so the slot is not used here).
_SENDS = (Op.send, Op.sized_send, Op.slotted_send, Op.sized_slotted_send)
_RECVS = (Op.recv, Op.sized_recv, Op.slotted_recv, Op.sized_slotted_recv)


#: megatron-core 0.19.2's ``recompute_modules`` that use output-discarding checkpointing
#: (``tensor_parallel.CheckpointWithoutOutput``; TransformerConfig.recompute_modules says so).
_DISCARDING_RECOMPUTE = ("gdn_norm_out", "layernorm", "mla_up_proj", "moe_act")


def _refuse_offload_config(config, chunks: list, rank: int, offloaded: set) -> None:
    """What this executor cannot offload under: configurations in which the tensors a forward
    saves are not (only) in the hands of autograd's saved-tensor hooks, or are freed and
    refilled in place behind them. Checked before anything runs, on a rank that offloads."""
    if not offloaded:
        return
    st, mb = min(offloaded)
    at = f"rank {rank} offloads fwd(stage {st}, mb {mb}), but "
    why = None
    granularity = getattr(config, "recompute_granularity", None)
    discarding = set(getattr(config, "recompute_modules", None) or ()) & set(_DISCARDING_RECOMPUTE)
    if getattr(config, "fine_grained_activation_offloading", False) or getattr(
        config, "cpu_offloading", False
    ):
        flag = (
            "fine_grained_activation_offloading"
            if getattr(config, "fine_grained_activation_offloading", False)
            else "cpu_offloading"
        )
        why = (
            f"config.{flag} is set: Megatron's own activation offloading moves the same saved "
            "tensors with its own hooks; use one of the two"
        )
    elif getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(
        config, "enable_cuda_graph", False
    ):
        why = (
            "CUDA graphs are on (config.cuda_graph_impl / enable_cuda_graph): a graphed "
            "forward keeps what it saves in the graph's static buffers, which saved-tensor "
            "hooks do not see"
        )
    elif granularity == "selective" and discarding:
        mods = sorted(discarding)
        why = (
            f"config.recompute_modules has {mods}: Megatron's output-discarding checkpoint "
            "(CheckpointWithoutOutput) frees a saved tensor's storage after the forward and "
            "refills that same storage in the backward, which a copy moved to the host would miss"
        )
    elif granularity == "full" and getattr(config, "distribute_saved_activations", False):
        why = (
            "config.distribute_saved_activations is set: Megatron's checkpoint replaces the "
            "input it saved with this rank's slice after saving it"
        )
    else:
        for c, chunk in enumerate(chunks):
            ddp = _chunk_attr(chunk, "ddp_config")
            if ddp is not None and getattr(ddp, "use_megatron_fsdp", False):
                why = (
                    f"model chunk {c} is Megatron-FSDP-sharded (ddp_config.use_megatron_fsdp): "
                    "FSDP frees and refills the gathered parameters that the forward saves"
                )
                break
    if why is not None:
        raise PipecError(at + why + "; pipec.megatron refuses to offload under it")


def _checkpoint_flags(s: Schedule, n: int | None) -> bool:
    """Whether to pass ``checkpoint_activations_microbatch`` to ``forward_step``, as
    megatron-core 0.19.2 does: only when ``num_microbatches_with_partial_activation_checkpoints``
    (``n``) is set, and then for every forward, ``True`` where the schedule's forward is
    checkpointed (``Op.fwd_checkpoint``). The schedule's checkpointed forwards must be exactly
    the ones Megatron's own schedule checkpoints under ``n`` (``pipec compile
    --megatron-partial-recompute N`` writes those); anything else is refused, naming the first
    forward that differs. The recompute itself is the user's ``forward_step_func``'s (it
    checkpoints the model call, and torch runs the forward again inside the backward), so a
    ``recompute`` instruction needs no action here."""
    have = s._n.checkpointed_forwards()
    if n is None:
        for r, marks in enumerate(have):
            if marks:
                st, mb = marks[0]
                raise PipecError(
                    f"rank {r}: the schedule checkpoints fwd(stage {st}, mb {mb}) (compiled with "
                    "megatron_partial_recompute), but config."
                    "num_microbatches_with_partial_activation_checkpoints is None, so Megatron "
                    "would not pass checkpoint_activations_microbatch: set it to the N the "
                    "schedule was compiled with"
                )
        return False
    want = s._n.megatron_checkpoints(n)
    for r, (h, w) in enumerate(zip(have, want, strict=True)):
        if h != w:
            extra = [t for t in h if t not in w]
            missing = [t for t in w if t not in h]
            what = (
                f"checkpoints fwd(stage {extra[0][0]}, mb {extra[0][1]}), which Megatron does not"
                if extra
                else f"does not checkpoint fwd(stage {missing[0][0]}, mb {missing[0][1]}), "
                "which Megatron does"
            )
            raise PipecError(
                f"rank {r}: under num_microbatches_with_partial_activation_checkpoints={n} the "
                f"schedule {what}: compile it with megatron_partial_recompute={n}"
            )
    return True


def _seq_divisor(config, pg_collection) -> int:
    """What Megatron divides a microbatch's sequence length by for its P2P shape
    (``get_tensor_shapes``): the context-parallel size, times the tensor-parallel size under
    sequence parallelism."""
    d = pg_collection.cp.size()
    if config.sequence_parallel:
        d *= pg_collection.tp.size()
    return d


def _plan_tokens(s: Schedule) -> list[int] | None:
    """Each microbatch's token count from the schedule's lengths (``Schedule.lengths``: the
    sum of the lengths of the sequences packed into it), or None without lengths."""
    lengths = s.lengths
    if lengths is None:
        return None
    return [n if isinstance(n, int) else sum(n) for n in lengths]


def _check_lengths(s: Schedule, config, seq_length: int, pg_collection) -> None:
    """The plan's lengths against ``config.variable_seq_lengths`` (docs/megatron.md,
    "Microbatches of different lengths"). Megatron sizes every message from ``seq_length``
    unless ``variable_seq_lengths`` is set, and then asks the sender for each shape first;
    pipec sizes each from the plan's ``tokens``, so it needs a plan with lengths there, and
    refuses lengths that contradict the fixed ``seq_length`` otherwise."""
    tokens = _plan_tokens(s)
    if config.variable_seq_lengths:
        if tokens is None:
            raise PipecError(
                f"config.variable_seq_lengths=True, but the schedule ({s.kind}) carries no "
                "microbatch lengths: Megatron would exchange every message's shape before "
                "sending it; pipec.megatron exchanges none and sizes each receive from the "
                "plan's tokens, so it needs them. Compile the step's schedule with "
                "lengths=[...] (one per microbatch, this batch's)"
            )
        divisor = _seq_divisor(config, pg_collection)
        for mb, n in enumerate(tokens):
            if n % divisor:
                raise PipecError(
                    f"microbatch {mb} has {n} tokens, which do not split into {divisor} equal "
                    "parts (context parallelism, and tensor parallelism under "
                    "sequence_parallel): Megatron's P2P shape is tokens / cp (/ tp)"
                )
        return
    if tokens is None:
        return
    for mb, n in enumerate(tokens):
        if n != seq_length:
            raise PipecError(
                f"the schedule ({s.kind}) carries microbatch lengths (microbatch {mb}: {n} "
                f"tokens), but config.variable_seq_lengths=False: Megatron's shapes are then "
                f"seq_length={seq_length} tokens for every microbatch (and its components, "
                "such as the MoE allgather dispatcher, are configured for fixed lengths). Set "
                "config.variable_seq_lengths=True for batches of different lengths"
            )


class _ById:
    """A chunk's data iterator, handed out by microbatch id: Megatron's data iterators yield
    microbatch k at their k-th ``next()``, and a schedule whose forwards enter in another
    order (a tuned ``microbatch_order``) asks for microbatch ``want`` first. Items are drawn
    from the wrapped iterator only when ``forward_step_func`` asks (as many as it asks for in
    microbatch order, never ahead), and held until their microbatch's forward."""

    def __init__(self, it, rank: int, chunk: int):
        self.it, self.rank, self.chunk = it, rank, chunk
        self.held: dict[int, Any] = {}
        self.drawn = 0  # items drawn from ``it`` so far: microbatches 0 .. drawn-1
        self.want: int | None = None  # the microbatch of the forward running now

    def __iter__(self):
        return self

    def __next__(self):
        mb, self.want = self.want, None
        if mb is None:
            raise PipecError(
                f"rank {self.rank}, chunk {self.chunk}: forward_step_func called next() on "
                "its data iterator twice in one forward; under a schedule whose microbatches "
                "enter out of order, pipec.megatron hands each forward its own microbatch, "
                "one item per forward (as Megatron's get_batch takes)"
            )
        while self.drawn <= mb:
            self.held[self.drawn] = next(self.it)
            self.drawn += 1
        if mb not in self.held:
            raise PipecError(
                f"rank {self.rank}, chunk {self.chunk}: microbatch {mb}'s item was already "
                "taken (forward_step_func drew on the iterator outside a forward?)"
            )
        return self.held.pop(mb)

    def __getattr__(self, name):  # what the wrapped iterator offers beyond next()
        if name == "it":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.it, name)


def _feeds(data_iterator, steps: list[Step], chunk_of: dict[int, int], rank: int) -> list:
    """The iterator each chunk's forwards get: the user's, where the chunk's forwards run in
    microbatch order (Megatron's own use), else a :class:`_ById` over it."""
    n = len(set(chunk_of.values()))  # one iterator for several chunks is refused before
    its = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    order: dict[int, list[int]] = {c: [] for c in range(n)}
    for step in steps:
        if isinstance(step, ComputeStep):
            ins = step.instruction
            f = ins.fwd if ins.op == Op.fwd_bwd else ins
            if ins.op in (Op.fwd, Op.fwd_checkpoint, Op.fwd_bwd):
                order[chunk_of[f.stage]].append(f.mb)
    return [
        it if it is None or order[c] == sorted(order[c]) else _ById(it, rank, c)
        for c, it in enumerate(its)
    ]


class _Op:
    """One posted isend/irecv: its work, what it carries, and whether it was waited (a gloo
    work must not be waited twice: a second wait blocks for a completion that never comes)."""

    __slots__ = ("done", "key", "kind", "tensor", "work")

    def __init__(self, work, kind: str, key: tuple[int, int], tensor: torch.Tensor):
        self.work, self.kind, self.key, self.tensor, self.done = work, kind, key, tensor, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


class _Executor:
    """One call of the returned ``forward_backward_func`` on this rank."""

    def __init__(
        self, s, streams, model, config, pp_group, rank, kw, pg_collection, world_group, memory
    ):
        from megatron.core.pipeline_parallel import schedules as ms

        self.ms = ms
        self.s, self.model, self.config, self.kw = s, model, config, kw
        self.pp_group, self.rank, self.pgc = pp_group, rank, pg_collection
        self.world_group = world_group
        self.stages = stage_indices(s, rank)
        self.chunk_of = {st: c for c, st in enumerate(self.stages)}
        self.last = s.num_stages - 1
        self.forward_only = kw["forward_only"]
        # The verifier's stream rule for the program's communicator model: Megatron's unbatched
        # and overlapped calls post their isend/irecv one by one (_p2p_ops) in the even/odd
        # order pipec lowered, and at pp=2 send odd -> even over WORLD (a second communicator).
        self.ops_in_order = streams["ops_in_order"]
        self.odd_sends_on_world = streams["per_direction"]
        p = next(iter(model[0].parameters()), None)
        self.device = p.device if p is not None else torch.device("cpu")
        # Megatron's fixed P2P shape (get_tensor_shapes): [seq / cp (/ tp with sequence
        # parallelism), micro batch size, hidden]. Under variable_seq_lengths the first
        # dimension is each message's own: the plan's tokens for it, split the same way.
        self.seq_divisor = _seq_divisor(config, pg_collection)
        self.variable = bool(config.variable_seq_lengths)
        self.tensor_shape = [
            kw["seq_length"] // self.seq_divisor,
            kw["micro_batch_size"],
            config.hidden_size,
        ]
        # Live tensors, keyed by (stage, mb).
        self.inputs: dict[tuple[int, int], Any] = {}  # a stage's input (received or local)
        self.outputs: dict[tuple[int, int], Any] = {}  # a stage's output (loss on the last)
        self.out_grads: dict[tuple[int, int], Any] = {}  # grad of a stage's output
        self.in_grads: dict[tuple[int, int], Any] = {}  # grad of a stage's input, to send
        self.deferred: dict[tuple[int, int], tuple] = {}  # bwd_D -> bwd_W
        self.pending: dict[int, list[_Op]] = {}  # batches left in flight, by id
        self.sending: dict[tuple[int, int], _Op] = {}  # activations whose send is in flight
        self.forward_data_store: list = []
        # The forwards this rank offloads and the store of their saved tensors (issue 30).
        self.memory: ActivationStore | None = memory
        self.offloaded = _offloaded(s, rank) if memory is not None else set()
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        # Each chunk's data iterator, handed out by microbatch id where the chunk's forwards
        # are not in microbatch order (_ById); the k-th forward of each chunk (Megatron's
        # is_first_microbatch / current_microbatch count forwards, not ids).
        self.feeds: list = []
        self.forwards_done: dict[int, int] = {}
        # Where the last stage's forwards put their outputs in forward_data_store, by id.
        self.stored: list[tuple[int, int, int]] = []

    # ---- P2P
    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.pp_group, peer)

    def _group(self, sender: int):
        if self.odd_sends_on_world and sender % 2 == 1:
            return self.world_group
        return self.pp_group

    def _post(self, ops: tuple[Instruction, ...], in_flight: bool) -> list[_Op]:
        """Post one comm batch (a :class:`pipec.BatchStep`'s ops); returns its record for
        :meth:`_complete`."""
        p2p, what = [], []
        for ins in ops:
            key = (ins.stage, ins.mb)
            if ins.op in _SENDS:
                if ins.payload == "act":
                    t = self.outputs[key]
                else:
                    t = self.in_grads.pop(key)
                self._check_sent(ins, t)
                what.append(("send_" + ins.payload, key, t))
                op = dist.P2POp(dist.isend, t, self._global(ins.peer), self._group(self.rank))
            elif ins.op in _RECVS:
                t = torch.empty(
                    self._shape(ins),
                    requires_grad=True,
                    device=self.device,
                    dtype=self.config.pipeline_dtype,
                )
                what.append(("recv_" + ins.payload, key, t))
                op = dist.P2POp(dist.irecv, t, self._global(ins.peer), self._group(ins.peer))
            else:
                raise PipecError(f"rank {self.rank}: {ins.op} in a comm batch")
            p2p.append(op)
        if len(p2p) > 1 and not in_flight and not self.ops_in_order:
            works = dist.batch_isend_irecv(p2p)  # one comm batch = one NCCL group
        else:  # one op, a batch left in flight, or Megatron's op-by-op modes
            works = [
                (dist.isend if op.op is dist.isend else dist.irecv)(op.tensor, op.peer, op.group)
                for op in p2p
            ]
        posted = [_Op(w, *x) for w, x in zip(works, what, strict=True)]
        for op in posted:
            if op.kind == "send_act":
                self.sending[op.key] = op
        return posted

    def _shape(self, ins: Instruction) -> list[int]:
        """The shape of the tensor a send or receive moves: Megatron's fixed one, or under
        ``variable_seq_lengths`` the plan's ``tokens`` for it in place of ``seq_length`` (the
        rest as Megatron computes it). No shape is exchanged: the plan gave it."""
        if not self.variable:
            return self.tensor_shape
        return [ins.tokens // self.seq_divisor, *self.tensor_shape[1:]]

    def _check_sent(self, ins: Instruction, t: torch.Tensor) -> None:
        """The peer allocates the receive from the plan (no shape goes over the wire), so a
        tensor of another shape is refused here, before it is posted: over NCCL it would
        corrupt or hang, over gloo fail far from its cause."""
        want = self._shape(ins)
        if list(t.shape) == want:
            return
        what = "activation" if ins.payload == "act" else "gradient"
        if self.variable:
            plan = f"the plan's {ins.tokens} tokens for microbatch {ins.mb} give {want}"
            fix = "compile the step's schedule from this batch's lengths"
        else:
            plan = f"Megatron's fixed shape is {want} (seq_length {self.kw['seq_length']})"
            fix = "set config.variable_seq_lengths and give the schedule the lengths"
        raise PipecError(
            f"rank {self.rank}, #{ins.index}: the {what} of stage {ins.stage}, microbatch "
            f"{ins.mb} has shape {list(t.shape)}, but {plan}: the receiver allocates that "
            f"shape; {fix}"
        )

    def _sent(self, key: tuple[int, int]) -> None:
        """The send of the activation ``key`` completed: Megatron deallocates it then."""
        if self.sending.pop(key, None) is None:
            return
        if self.forward_only:
            self.outputs.pop(key, None)
        elif key in self.outputs:
            self.ms.deallocate_output_tensor(
                self.outputs[key], self.config.deallocate_pipeline_outputs
            )

    def _complete(self, posted: list[_Op]) -> None:
        for op in posted:
            op.wait()
        for op in posted:
            if op.kind == "recv_act":  # the input of the next stage
                self.inputs[(op.key[0] + 1, op.key[1])] = op.tensor
            elif op.kind == "recv_grad":  # the grad of the previous stage's output
                self.out_grads[(op.key[0] - 1, op.key[1])] = op.tensor
            elif op.kind == "send_act":
                self._sent(op.key)

    # ---- compute
    def _data(self, c: int, mb: int):
        feed = self.feeds[c]
        if isinstance(feed, _ById):
            feed.want = mb
        return feed

    def _forward_step(self, c: int, stage: int, mb: int, inp, checkpoint: bool):
        """Megatron's ``forward_step`` for one forward; (output, number of tokens)."""
        ms = self.ms
        # Megatron counts a chunk's forwards (``i == 0``, ``current_microbatch=i``); in
        # microbatch order that count is the id, in another order it is not.
        k = self.forwards_done.get(c, 0)
        self.forwards_done[c] = k + 1
        stored = len(self.forward_data_store)
        out = ms.forward_step(
            self.kw["forward_step_func"],
            self._data(c, mb),
            self.model[c],
            self.s.num_microbatches,
            inp,
            self.forward_data_store,
            self.config,
            self.pgc.cp.size(),
            collect_non_loss_data=self.kw["collect_non_loss_data"],
            # Megatron's partial recompute: the flag for every forward when N is set (False
            # included), None otherwise; forward_step hands it to forward_step_func as a third
            # positional argument, as Megatron's own schedules do (_checkpoint_flags).
            checkpoint_activations_microbatch=checkpoint if self.kw["checkpoint_flags"] else None,
            is_first_microbatch=ms.check_first_val_step(
                self.kw["first_val_step"], self.forward_only, k == 0
            ),
            current_microbatch=k,
            vp_stage=self.vp_stage[c],
            is_last_stage=stage == self.last,
        )
        if len(self.forward_data_store) > stored:
            self.stored.append((mb, stored, len(self.forward_data_store)))
        return out

    def fwd(self, stage: int, mb: int, checkpoint: bool = False) -> None:
        ms, c = self.ms, self.chunk_of[stage]
        if self.first_fwd.pop(c, False) and self.param_sync is not None:
            self.param_sync[c](self.model[c].parameters())
        inp = None if stage == 0 else self.inputs.get((stage, mb))
        if stage > 0 and inp is None:
            raise PipecError(f"rank {self.rank}: no input for stage {stage}, mb {mb}")
        entry, saving = None, contextlib.nullcontext()
        if (stage, mb) in self.offloaded:
            # What autograd saves in this forward (the loss function's too, on the last
            # stage) goes into the store's handles, for its offload and reload.
            entry = self.memory.open((stage, mb), checkpoint=False)
            saving = self.memory.saving(entry)
        with saving:
            out, num_tokens = self._forward_step(c, stage, mb, inp, checkpoint)
        if entry is not None:
            # The stage input and weights stay on the device whatever the schedule says:
            # this executor holds the input until the backward, the model its weights.
            self.memory.settle(entry, _kept_storages(inp, self.model[c]))
        self.total_num_tokens += num_tokens
        if stage != self.last and self.chunk_of.get(stage + 1) is not None:
            # A hand-off on this rank (the V turn): the next stage gets a fresh leaf, exactly
            # what a receive would give it.
            self.inputs[(stage + 1, mb)] = out.detach().requires_grad_()
            if not self.forward_only:
                ms.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)
        if self.forward_only:
            self.inputs.pop((stage, mb), None)
            if stage != self.last and self.chunk_of.get(stage + 1) is None:
                self.outputs[(stage, mb)] = out  # until its send completes
            return
        self.outputs[(stage, mb)] = out

    def _give_input_grad(self, stage: int, mb: int, grad) -> None:
        if stage == 0:
            return
        if self.chunk_of.get(stage - 1) is not None:
            self.out_grads[(stage - 1, mb)] = grad
        else:
            self.in_grads[(stage, mb)] = grad

    def _take(self, stage: int, mb: int):
        op = self.sending.get((stage, mb))
        if op is not None:
            # Its gradient came back, so the peer has received it: this op is complete (or
            # completing); wait for it alone, then deallocate as Megatron would have.
            op.wait()
            self._sent((stage, mb))
        inp = self.inputs.pop((stage, mb), None)
        out = self.outputs.pop((stage, mb))
        og = None if stage == self.last else self.out_grads.pop((stage, mb))
        return inp, out, og

    def bwd(self, stage: int, mb: int) -> None:
        c = self.chunk_of[stage]
        inp, out, og = self._take(stage, mb)
        with self._grad_sync(c, stage, mb):
            ig = self.ms.backward_step(inp, out, og, self.config)
        self._give_input_grad(stage, mb, ig)

    def bwd_d(self, stage: int, mb: int) -> None:
        """The input-gradient half of a split backward (``bwd_D``); see docs/megatron.md.

        megatron-core 0.19.2's own deferral (``delay_wgrad_compute``) needs Transformer
        Engine layers and combined 1F1B; this is the equivalent for any model: the zero-bubble
        split of :mod:`pipec._split_backward` (torch's, on public autograd API): a backward to
        the stage input only that records the gradients reaching the nodes which use the
        weights, from which :meth:`bwd_w` computes the weight gradients later (through the
        weights' accumulators, so Megatron's DDP hooks see them). Nothing runs twice through a
        node that destroys its saved tensors (Megatron's fused cross entropy does), so weights
        whose branch does not join the input-gradient chain are refused.
        """
        from torch.autograd.graph import get_gradient_edge

        c = self.chunk_of[stage]
        inp, out, og = self._take(stage, mb)
        if og is None and self.config.grad_scale_func is not None:
            out = self.config.grad_scale_func(out)  # as backward_step does on the last stage
        params = [p for p in self.model[c].parameters() if p.requires_grad]
        if inp is None or out.grad_fn is None:
            # No stage input (the first stage): the whole backward is the weight gradient.
            self.deferred[(stage, mb)] = ("full", out, og)
            return
        # Through the edge: the output may be deallocated (the loss's gradient is 1).
        edges = [get_gradient_edge(out)]
        grads = [torch.ones_like(out) if og is None else og]
        split = split_input(edges, grads, [inp], params)
        ig, inp.grad = inp.grad, None
        self.deferred[(stage, mb)] = ("split", split)
        rest = split[2]
        if rest is not None:
            raise PipecError(
                f"stage {stage}: {len(rest[2])} weights are not reached from the stage input; "
                "pipec.megatron cannot split this stage's backward"
            )
        self._give_input_grad(stage, mb, ig)

    def bwd_w(self, stage: int, mb: int) -> None:
        """The weight-gradient half of a split backward (``bwd_W``)."""
        from torch.autograd.graph import get_gradient_edge

        c = self.chunk_of[stage]
        d = self.deferred.pop((stage, mb))
        with self._grad_sync(c, stage, mb):
            if d[0] == "full":
                _, out, og = d
                if out.requires_grad:
                    # As backward_step, through the edge: the output may be deallocated.
                    root = out if og is None else get_gradient_edge(out)
                    torch.autograd.backward(root, og)
                return
            split_weight(*d[1])

    # ---- grad sync, as Megatron's schedules: reductions are held back (no_sync) except
    # during the last weight-gradient pass of each chunk.
    @contextlib.contextmanager
    def _grad_sync(self, c: int, stage: int, mb: int):
        last = self.last_wgrad.get(c) == (stage, mb)
        if last and self.config.grad_sync_func is None:
            self._enable_grad_sync()
        try:
            yield
        finally:
            if last and self.config.grad_sync_func is not None:
                gsf = self.config.grad_sync_func
                (gsf[c] if isinstance(gsf, list) else gsf)(self.model[c].parameters())
            if last:
                self.synced.add(c)
            self._disable_grad_sync()

    def _disable_grad_sync(self) -> None:
        if self.no_sync_ctx is None:
            self.no_sync_ctx = self.no_sync_func()
            self.no_sync_ctx.__enter__()

    def _enable_grad_sync(self) -> None:
        if self.no_sync_ctx is not None:
            self.no_sync_ctx.__exit__(None, None, None)
            self.no_sync_ctx = None

    def _compute(self, ins: Instruction) -> None:
        if self.memory is not None:
            where = f"rank {self.rank}, #{ins.index}: {ins}"
            self.memory.context = where  # named by a backward that finds an activation away
            back = ins.bwd if ins.op == Op.fwd_bwd else ins
            if ins.op in (Op.bwd, Op.bwd_D, Op.fwd_bwd) and (
                self.memory.where(back.stage, back.mb) == "host"
            ):
                raise PipecError(
                    f"{where}: the activations of fwd(stage {back.stage}, mb {back.mb}) are in "
                    "host memory (offloaded, not reloaded); the schedule must reload them "
                    "before the backward"
                )
        match ins.op:
            case Op.fwd:
                self.fwd(ins.stage, ins.mb)
            case Op.fwd_checkpoint:
                self.fwd(ins.stage, ins.mb, checkpoint=True)
            case Op.bwd:
                self.bwd(ins.stage, ins.mb)
            case Op.bwd_D:
                self.bwd_d(ins.stage, ins.mb)
            case Op.bwd_W:
                self.bwd_w(ins.stage, ins.mb)
            case Op.fwd_bwd:
                # Overlapped F&B pair: run as its forward, then its backward (the same math;
                # the overlap itself is a GPU-stream property, see docs/megatron.md).
                self.fwd(ins.fwd.stage, ins.fwd.mb)
                self.bwd(ins.bwd.stage, ins.bwd.mb)
            case _:
                raise PipecError(f"rank {self.rank}: pipec.megatron cannot run {ins!r}")

    def _copy(self, ins: Instruction) -> None:
        """``offload``, ``reload`` or ``wait_offload`` (docs/megatron.md, "Memory
        instructions"): the copies of the store, on its side stream on CUDA."""
        m = self.memory
        if m is None or ins.op not in (Op.offload, Op.reload, Op.wait_offload):
            raise PipecError(f"rank {self.rank}, #{ins.index}: pipec.megatron cannot run {ins}")
        do = {Op.offload: m.offload, Op.reload: m.reload, Op.wait_offload: m.wait_offload}
        try:
            do[ins.op](ins.stage, ins.mb)
        except PipecError as e:
            raise PipecError(f"rank {self.rank}, #{ins.index}: {e}") from None

    def run(self, steps: list[Step]) -> list:
        config, model = self.config, self.model
        nsf = config.no_sync_func
        if isinstance(nsf, list):

            def multi():
                stack = contextlib.ExitStack()
                for f in nsf:
                    stack.enter_context(f())
                return stack

            self.no_sync_func = multi
        else:
            self.no_sync_func = nsf if nsf is not None else contextlib.nullcontext
        self.no_sync_ctx = None
        self.synced: set[int] = set()
        self.vp_stage = [
            c if len(model) > 1 or _chunk_attr(m, "vp_stage") is not None else None
            for c, m in enumerate(model)
        ]
        # The last weight-gradient op of each chunk (bwd / bwd_W / the bwd half of fwd_bwd).
        self.last_wgrad: dict[int, tuple[int, int]] = {}
        for step in steps:
            if not isinstance(step, ComputeStep):
                continue
            ins = step.instruction
            if ins.op in (Op.bwd, Op.bwd_W):
                self.last_wgrad[self.chunk_of[ins.stage]] = (ins.stage, ins.mb)
            elif ins.op == Op.fwd_bwd:
                self.last_wgrad[self.chunk_of[ins.bwd.stage]] = (ins.bwd.stage, ins.bwd.mb)
        psf = config.param_sync_func
        self.param_sync = None
        if psf is not None and not self.forward_only:
            self.param_sync = psf if isinstance(psf, list) else [psf] * len(model)
        self.first_fwd = dict.fromkeys(range(len(model)), True)
        if config.finalize_model_grads_func is not None and not self.forward_only:
            embedding_module = self.ms.clear_embedding_activation_buffer(
                config, model, self.last in self.chunk_of
            )
        self.feeds = _feeds(self.kw["data_iterator"], steps, self.chunk_of, self.rank)
        self._disable_grad_sync()
        for step in steps:
            match step:
                case BatchStep(id=b, ops=ops, in_flight=in_flight):
                    posted = self._post(ops, in_flight)
                    if in_flight:  # completed at the wait that names it
                        self.pending[b] = posted
                    else:
                        self._complete(posted)
                case WaitStep(batch=b):
                    self._complete(self.pending.pop(b))
                case ComputeStep(instruction=ins):
                    self._compute(ins)
                case MemoryStep(instruction=ins) if ins.op == Op.recompute:
                    pass  # torch recomputes inside the backward (_checkpoint_flags)
                case MemoryStep(instruction=ins):
                    self._copy(ins)
        if self.pending:
            raise PipecError(f"rank {self.rank}: batches {sorted(self.pending)} never waited")
        if self.memory is not None:
            self.memory.context = None
            left = self.memory.pending()
            if left and not self.forward_only:
                raise PipecError(
                    f"rank {self.rank}: the step ended with the activations of {left} "
                    "(stage, microbatch) offloaded and never reloaded"
                )
        self._enable_grad_sync()
        if config.grad_sync_func is not None and not self.forward_only:
            gsf = config.grad_sync_func
            for c in range(len(model)):
                if c not in self.synced:
                    (gsf[c] if isinstance(gsf, list) else gsf)(model[c].parameters())
        if config.finalize_model_grads_func is not None and not self.forward_only:
            self.ms.finish_embedding_wgrad_compute(
                config, embedding_module, self.last in self.chunk_of, self.pgc.tp
            )
            config.finalize_model_grads_func(
                model,
                self.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pgc,
                force_all_reduce=self.kw["force_all_reduce"],
            )
        return self._in_microbatch_order()

    def _in_microbatch_order(self) -> list:
        """forward_data_store in microbatch order, what Megatron returns: the last stage's
        forwards add to it in the schedule's order, which a tuned order permutes."""
        store, spans = self.forward_data_store, self.stored
        if all(a[0] < b[0] for a, b in itertools.pairwise(spans)):
            return store
        out = []
        for _, lo, hi in sorted(spans):
            out.extend(store[lo:hi])
        return out


def forward_backward_func(schedule: Schedule | str | os.PathLike) -> Callable[..., list]:
    """A function with the signature of megatron-core 0.19.2's
    ``forward_backward_pipelining_with_interleaving`` that runs ``schedule`` (a
    :class:`pipec.Schedule`, or the path of a compiled directory, loaded with every
    ``pipec-run`` check) on this rank. Use it wherever Megatron's
    ``get_forward_backward_func()`` result is used; it returns what Megatron's returns (the
    loss-function outputs of every microbatch on the rank holding the last stage, in
    microbatch order; an empty list elsewhere).

    Before the first instruction it refuses, with a :class:`pipec.PipecError` naming both
    sides, a pipeline group of another size than the schedule's ``pp``, a ``model`` list of
    another length than :func:`stage_indices` of this rank, chunks whose ``pre_process`` /
    ``post_process`` / ``vp_stage`` disagree with the stages they are to run, another
    ``num_microbatches``, ``forward_only`` that disagrees with the schedule, and what the
    executor cannot do (``adjust_tensor_shapes_fn``). Megatron's P2P flags in the model config
    (``batch_p2p_comm``, ``overlap_p2p_comm``) are not used: the communication is the
    schedule's, as pipec verified it.

    Microbatches of different lengths (#38): under ``config.variable_seq_lengths`` the
    schedule must carry lengths (``pipec.compile(..., lengths=...)``, this step's batch); every
    receive is then allocated from its instruction's ``tokens`` and no shape is exchanged, so
    the messages are exactly the plan's (Megatron's own schedules send a shape before each).
    Without ``variable_seq_lengths`` a plan whose lengths are not all ``seq_length`` is
    refused (:func:`_check_lengths`). A sent tensor whose shape is not the plan's is refused
    before it is posted. The microbatches may enter in any order (a tuned
    ``microbatch_order``): each forward gets its own microbatch's item of the data iterator,
    and the losses come back in microbatch order. Plan per step by calling this function with
    each step's schedule: everything it prepares belongs to the returned function.

    Memory instructions (issue 30): checkpointed forwards and ``recompute`` are Megatron's
    partial recompute (:func:`_checkpoint_flags`); ``offload``, ``reload`` and ``wait_offload``
    move the saved tensors of the forwards they name to host memory and back through
    saved-tensor hooks (``pipec._offload``; refused under the Megatron settings that keep saved
    tensors out of the hooks' reach, see docs/megatron.md). The function's ``pipec_memory``
    is this rank's store of the last call (its ``events`` trace it), ``None`` when the rank
    offloads nothing.
    """
    s = _as_schedule(schedule)
    _refuse(s, placement_only=False)
    manifest = _manifest(s)
    layers = _stage_layers(manifest)
    steps_of: dict[int, list[Step]] = {}  # this process's rank, once known
    stores: dict[int, ActivationStore] = {}  # the rank's offload store, when it offloads
    flags_for: dict[int | None, bool] = {}  # _checkpoint_flags per N seen
    # The function itself, weakly: a strong reference from its own closure would be a cycle,
    # which only the cyclic collector frees. A job that plans every step makes a function per
    # step, and Megatron-LM's --manual-gc runs that collector rarely; without the cycle the
    # previous step's schedule, steps and offload store go when the caller drops the function.
    this: list[weakref.ref] = []

    def pipec_forward_backward(
        *,
        forward_step_func,
        data_iterator: Iterator | list[Iterator],
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
    ) -> list:
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        _compat.require_loaded("pipec.megatron", "megatron-core")

        model_list = model if isinstance(model, list) else [model]
        if p2p_communicator is not None:
            pp_group = p2p_communicator.pp_group
        else:
            pp_group = parallel_state.get_pipeline_model_parallel_group()
        if pg_collection is None:
            pg_collection = _compat.megatron_default_pg_collection()
        size, rank = pp_group.size(), pp_group.rank()
        if size != s.pp:
            raise PipecError(
                f"world size mismatch: the schedule ({s.kind}) is compiled for pp={s.pp} "
                f"pipeline ranks, but this pipeline-parallel group has {size}"
            )
        want = stage_indices(s, rank)
        if len(model_list) != len(want):
            raise PipecError(
                f"model chunk mismatch: {s.kind} places {len(want)} stages {want} on pipeline "
                f"rank {rank} (pipec.megatron.stage_indices(schedule, {rank})), but the model "
                f"list has {len(model_list)} chunk(s)"
            )
        if num_microbatches != s.num_microbatches:
            raise PipecError(
                f"microbatch mismatch: num_microbatches={num_microbatches}, but the schedule "
                f"is compiled for {s.num_microbatches} microbatches"
            )
        if forward_only != s.forward_only:
            raise PipecError(
                f"forward_only={forward_only}, but the schedule is "
                + (
                    "forward-only: compile a training schedule for training"
                    if s.forward_only
                    else "a training schedule (its sends and receives include gradients): "
                    "compile one with forward_only=True for evaluation"
                )
            )
        if isinstance(data_iterator, list) and len(data_iterator) != len(model_list):
            raise PipecError(
                f"data iterator mismatch: {len(data_iterator)} data iterators for "
                f"{len(model_list)} model chunks (give one per chunk, as Megatron's "
                "interleaved schedule wants)"
            )
        if data_iterator is None:
            data_iterator = [None] * len(model_list)
        if not isinstance(data_iterator, list) and len(model_list) > 1:
            raise PipecError(
                f"rank {rank} runs {len(model_list)} model chunks: give a list of one data "
                "iterator per chunk (each chunk draws its own microbatches)"
            )
        if adjust_tensor_shapes_fn is not None:
            raise PipecError("adjust_tensor_shapes_fn is not supported by pipec.megatron")
        for c, (chunk, st) in enumerate(zip(model_list, want, strict=True)):
            for attr, need in (
                ("pre_process", layers[st].pre_process),
                ("post_process", layers[st].post_process),
            ):
                got = _chunk_attr(chunk, attr)
                if got is not None and bool(got) != need:
                    raise PipecError(
                        f"model chunk {c} of pipeline rank {rank} runs stage {st}, which "
                        f"{'has' if need else 'does not have'} "
                        f"{'the embedding' if attr == 'pre_process' else 'the output layer'}"
                        f", but the chunk was built with {attr}={got}"
                    )
            vp = _chunk_attr(chunk, "vp_stage")
            if vp is not None and vp != c:
                raise PipecError(
                    f"model chunk {c} of pipeline rank {rank} was built with vp_stage={vp}; "
                    f"chunk c must be built with vp_stage=c (or None)"
                )
        config = get_model_config(model_list[0])
        n_ckpt = config.num_microbatches_with_partial_activation_checkpoints
        if n_ckpt not in flags_for:
            flags_for[n_ckpt] = _checkpoint_flags(s, n_ckpt)
        # Megatron's fixed P2P length (get_tensor_shapes): decoder_seq_length where given.
        seq_length = decoder_seq_length if decoder_seq_length is not None else seq_length
        _check_lengths(s, config, seq_length, pg_collection)
        steps = steps_of.get(rank)
        if steps is None:
            steps = steps_of[rank] = s.steps(rank)
            if _offloaded(s, rank):
                stores[rank] = ActivationStore()
        memory = stores.get(rank)
        if memory is not None:
            _refuse_offload_config(config, model_list, rank, _offloaded(s, rank))
            memory.begin_step()
        _check_graphs(s, config, rank)
        this[0]().pipec_memory = memory
        needs_dtype = any(
            isinstance(st, BatchStep) and any(o.op in _RECVS for o in st.ops) for st in steps
        )
        if needs_dtype and config.pipeline_dtype is None:
            raise PipecError("config.pipeline_dtype must be set (the dtype of received tensors)")
        kw = {
            "forward_step_func": forward_step_func,
            "data_iterator": data_iterator,
            "seq_length": seq_length,
            "micro_batch_size": micro_batch_size,
            "forward_only": forward_only,
            "collect_non_loss_data": collect_non_loss_data,
            "first_val_step": first_val_step,
            "force_all_reduce": force_all_reduce,
            "checkpoint_flags": flags_for[n_ckpt],
        }
        ex = _Executor(
            s,
            manifest["streams"],
            model_list,
            config,
            pp_group,
            rank,
            kw,
            pg_collection,
            dist.group.WORLD,
            memory,
        )
        return ex.run(steps)

    # Megatron-LM builds its TECudaGraphHelper itself and may capture before the first step:
    # hand the order over now (nothing changes unless a helper captures).
    _hand_over(s)
    pipec_forward_backward.pipec_schedule = s  # type: ignore[attr-defined]
    pipec_forward_backward.pipec_memory = None  # type: ignore[attr-defined]
    this.append(weakref.ref(pipec_forward_backward))
    return pipec_forward_backward
