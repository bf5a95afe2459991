"""pipec: the pipeline-parallel schedule compiler, from Python.

The same Rust core as the ``pipec`` CLI and ``pipec-run``: :func:`compile` generates, lowers and
verifies a schedule; :func:`load` reads a compiled directory with every check ``pipec-run``
makes. Nothing is compiled, loaded or verified in Python. torch is needed only by
:mod:`pipec.torch` and :mod:`pipec.megatron` (which also needs megatron-core); ``import pipec``
works without either.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import _native
from ._native import (
    BatchStep,
    ComputeStep,
    FileError,
    Instruction,
    InvalidSchedule,
    LayoutError,
    MemoryStep,
    PipecError,
    SpecError,
    Task,
    TorchExportError,
    WaitStep,
)
from ._op import Op

# An instruction reads as the read-only dict of its record (rank-<r>.json's line).
Mapping.register(Instruction)

#: One unit of a rank's stream, as :meth:`Schedule.steps` returns them.
Step = ComputeStep | BatchStep | WaitStep | MemoryStep

__version__ = _native.__version__

__all__ = [
    "BatchStep",
    "ComputeStep",
    "FileError",
    "Instruction",
    "InvalidSchedule",
    "LayoutError",
    "MemoryStep",
    "Op",
    "PipecError",
    "Report",
    "Schedule",
    "SpecError",
    "Step",
    "Task",
    "TorchExportError",
    "WaitStep",
    "compile",
    "cost_model",
    "kinds",
    "load",
    "seal",
    "tune",
]

#: Megatron's P2P modes (``megatron_p2p=``), as Rust names them (``MegatronP2p``).
_MEGATRON_P2P: tuple[str, ...] = _native.MEGATRON_P2P_MODES


def _limit_text(limit) -> str | None:
    """A memory limit as the CLI reads it: ``"80GiB"``, or a plain number."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float, str)):
        raise SpecError(f"memory_limit must be a size such as '80GiB' or a number, not {limit!r}")
    return limit if isinstance(limit, str) else repr(limit)


def _count(n: int, noun: str) -> str:
    """``1 rank``, ``4 ranks`` (the CLI's rule)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_count(name: str, v, alternative: str = "") -> None:
    """A size such as pp: an integer of at least 1, refused in the words the CLI uses
    (``pp must be at least 1``) whether it is 0 or negative."""
    if isinstance(v, bool) or not isinstance(v, int):
        alt = f" {alternative}" if alternative else ""
        raise SpecError(f"{name} must be an integer{alt}, not {v!r}")
    if v < 1:
        raise SpecError(f"{name} must be at least 1, not {v}")


@dataclass(frozen=True)
class Report:
    """The verifier's verdict (``Schedule.check``)."""

    valid: bool
    #: Every violation in words, each prefixed with its class (``[deadlock] ...``).
    violations: list[str] = field(default_factory=list)
    #: Peak live activations per rank (the verifier's rule, without the parameters), in
    #: ``memory_unit``: the CLI's ``peak_activations`` (``simulate --json``), ``check --json``'s
    #: ``memory[r].peak - memory[r].params``.
    peak_activations: list[float] = field(default_factory=list)
    #: Valid-but-fragile findings (NCCL risks); not violations.
    risks: list[str] = field(default_factory=list)
    #: The one-line verdict the CLI prints.
    verdict: str = ""
    #: ``"bytes"`` or ``"layer-activations"``: the unit of ``peak_activations`` and
    #: ``peak_memory``.
    memory_unit: str = "layer-activations"
    #: Peak memory per rank: parameters + live activations, what ``memory_limit`` bounds (the
    #: CLI's ``peak_memory``, ``check --json``'s ``memory[r].peak``).
    peak_memory: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.valid


class Schedule:
    """A verified, compiled schedule: per-rank instruction streams with their placement.

    Made by :func:`compile` or :func:`load`; never constructed directly.
    """

    __slots__ = ("_n",)

    def __init__(self, native: _native.NativeSchedule):
        if not isinstance(native, _native.NativeSchedule):
            raise TypeError("use pipec.compile(...) or pipec.load(path) to make a Schedule")
        self._n = native

    # --- shape ---
    @property
    def pp(self) -> int:
        """Number of pipeline ranks (the world size the schedule is compiled for)."""
        return self._n.pp

    @property
    def num_stages(self) -> int:
        return self._n.num_stages

    @property
    def num_microbatches(self) -> int:
        return self._n.num_microbatches

    @property
    def vpp(self) -> int | None:
        """Chunks (stages) per rank: the kind's, or for a tuned plan or an import its stages
        over its ranks (``None`` when they do not divide)."""
        return self._n.vpp

    @property
    def layout(self) -> str:
        """The Megatron layout string of the layer split (``"Et*3|tL"``): as given or tuned,
        else one ``t`` per stage with ``E`` first and ``L`` last."""
        return self._n.layout

    @property
    def plan(self) -> str | None:
        """The name ``pipec tune`` gives a plan no kind generates as is (``"tuned loop vpp=2"``,
        ``"1f1b + offload 3"``; the manifest's ``plan``), else ``None``."""
        return self._n.plan

    @property
    def kind(self) -> str:
        """The schedule kind (``"1f1b"``, ``"zb-v"``, ...), or ``"torch-csv"`` for an import."""
        return self._n.kind

    @property
    def forward_only(self) -> bool:
        return self._n.forward_only

    @property
    def p2p_groups(self) -> str:
        """Which communicator carries each send and receive (the manifest's ``p2p_groups``):
        ``"pair"`` (one per pair of ranks, torch's lazy default), ``"direction"`` (one for
        activations, one for gradients, pytorch #186173) or ``"edge"`` (one per directed pair
        of ranks, pytorch #196666). :func:`pipec.torch.build_schedule` creates them."""
        return self._n.p2p_groups

    @property
    def lengths(self) -> list[int] | list[list[int]] | None:
        """The microbatch lengths the plan carries (the manifest's ``microbatch_lengths``),
        by the user's microbatch index: a list of ints when every microbatch is one sequence,
        else one list of sequence lengths per microbatch; ``None`` without lengths. Every
        ``send``/``recv`` then carries its ``tokens`` (:attr:`Instruction.tokens`)."""
        return json.loads(self._n.lengths_json())

    @property
    def placement(self) -> str:
        """``"looped"``, ``"v"``, ``"custom"``, or ``"bidirectional"`` (DualPipe: then
        :attr:`stage_to_rank` is the first direction's table)."""
        return self._n.placement

    @property
    def stage_to_rank(self) -> list[int]:
        """The rank of each stage, indexed by stage."""
        return list(self._n.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages placed on ``rank``, in stage order."""
        self._check_rank(rank)
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def capture_order(self, rank: int) -> list[int | float]:
        """Rank ``rank``'s CUDA-graph capture order in Transformer Engine's ``_order`` encoding,
        what megatron-core hands ``te.make_graphed_callables(..., _order=...)``: the forward of
        the rank's model chunk ``c`` (1-based, its stages in ascending order) is ``c``, its
        backward (or input-gradient backward) ``-c``, its weight gradient the half step
        ``-(c + 0.5)`` (on a chunk that splits any backward, a fused one is ``-c, -(c + 0.5)``); an
        overlapped pair is its forward then its backward. Exactly
        megatron-core's own order for its 1F1B and interleaved schedules. Raises
        :class:`PipecError` where the encoding cannot say the program (forward-only; a chunk
        whose backwards run its microbatches in another order than its forwards, as
        ``looped-bfs``'s do). ``docs/format.md``, "Capture order"."""
        self._check_rank(rank)
        return self._n.capture_order(rank)

    def refusal(self, target: str) -> str | None:
        """Why ``target`` (``"megatron"``, ``"torch"``, ``"torchtitan"``, ``"pipec-run"``,
        ``"deepspeed"``, ``"any"``) cannot run this schedule, or ``None``: the rule
        ``pipec tune --target`` filters by, the one the adapters apply."""
        return self._n.target_refusal(target)

    def __repr__(self) -> str:
        # The title already names the sizes (pp and vpp, or ranks and stages when imported);
        # a tuned plan's title names its plan (chunks per rank included), and its split,
        # which no kind implies, is added.
        if self.plan is not None:
            return f"<pipec.Schedule {self._n.title_line}, layout {self.layout}>"
        return f"<pipec.Schedule {self._n.title_line}>"

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.pp:
            raise ValueError(
                f"rank {rank!r} is out of range for a schedule of {_count(self.pp, 'rank')}"
            )

    # --- files ---
    def save(self, path: str | os.PathLike, format: str = "json") -> None:
        """Write the compiled directory (``format`` ``"json"`` or ``"bin"``), atomically."""
        self._n.save(os.fspath(path), format)

    def instructions(self, rank: int) -> list[Instruction]:
        """The instructions of ``rank``'s file (``rank-<r>.json``), in order, as typed
        :class:`Instruction` objects made in Rust from that rank alone: ``.op`` (an
        :class:`Op`), ``.stage``, ``.mb``, ``.peer``, ``.payload``, ``.batch``, ``.fwd`` /
        ``.bwd`` (a ``fwd_bwd``'s two :class:`Task`), ``.checkpoint``, ``.index``. Each also reads as the
        record's dict did before (``ins["op"] == "fwd"``, ``ins.get``, ``dict(ins)``,
        ``ins.to_dict()``, equal to that dict)."""
        self._check_rank(rank)
        return self._n.instructions(rank)

    def steps(self, rank: int) -> list[Step]:
        """``rank``'s stream as the units it executes, cut in Rust as every pipec consumer
        cuts it (``pipec_ir::ir::steps``): a :class:`ComputeStep` (``.instruction``), a
        :class:`BatchStep` (``.id``, ``.ops``: the sends and receives posted together,
        ``.in_flight``: a later ``wait`` completes it, else it completes where it stands), a
        :class:`WaitStep` (``.batch``), a :class:`MemoryStep` (``.instruction``: an
        ``offload``, ``reload``, ``wait_offload`` or ``recompute``). Reads that rank only."""
        self._check_rank(rank)
        return self._n.steps(rank)

    def blocking_order(self) -> list[list[int]]:
        """For every rank, the indices of its instructions (into :meth:`instructions`) in an
        order that cannot deadlock when each send and receive is posted alone and blocks until
        its partner is posted (DeepSpeed's ``p2p.send``/``recv``; gloo's send waits for its
        receive): compute ops keep their places, the ops of each comm batch are reordered,
        waits are left out. Computed in Rust by running the verified program under exactly that
        rule; raises :class:`PipecError` naming the stuck ops when it would stall."""
        return [list(r) for r in self._n.blocking_order()]

    # --- analysis ---
    def check(self, memory_limit: float | str | None = None, cost: str | None = None) -> Report:
        """Verify again, as ``pipec check`` does: memory per rank is counted under ``cost``
        (the ``--cost`` text; ``K.act``/``K.param`` in bytes make it bytes, else
        layer-activations) and checked against ``memory_limit`` (``"80GiB"``, or a number in the
        report's unit)."""
        d = json.loads(self._n.check(_limit_text(memory_limit), cost))
        return Report(
            valid=d["valid"],
            violations=d["violations"],
            peak_activations=d["peak_activations"],
            risks=d["risks"],
            verdict=d["verdict"],
            memory_unit=d["memory_unit"],
            peak_memory=d["peak_memory"],
        )

    def simulate(self, cost: str | None = None) -> dict:
        """What ``pipec simulate --json`` prints, under the cost model ``cost``
        (e.g. ``"f=1,b=1,w=1,p2p=0.05"``; defaults as the CLI's)."""
        return json.loads(self._n.simulate(cost))

    # --- torch ---
    def to_torch_csv(self, compute_only: bool = False) -> str:
        """torch.distributed.pipelining's schedule CSV: compute+comms (run as written by
        ``_PipelineScheduleRuntime``), or compute-only (torch adds the communication)."""
        return self._n.to_torch_csv(compute_only)

    def torch_actions(self, compute_only: bool = False) -> list[list]:
        """The same actions as :meth:`to_torch_csv`, structured, one list per rank:
        ``[stage, "TYPE", mb or None]``, or ``["OVERLAP_F_B", fwd, bwd]``, or ``None`` for an
        idle cell. Memory instructions, which the CSV refuses, are pipec's own types
        (``OFFLOAD``, ``RELOAD``, ``WAIT_OFFLOAD``, ``RECOMPUTE``, ``F_CHECKPOINT``; docs/torch.md,
        "Memory instructions")."""
        return self._n.torch_actions(compute_only)


def _lengths_lists(lengths) -> list[list[int]]:
    """``lengths=`` as one list of sequence lengths per microbatch: a list of ints (one
    sequence each) or a list of lists (the sequences packed into each). The values are
    checked in Rust (``Lengths::from_lists``), whose errors name ``lengths[i]``; only the
    shape of the argument is checked here."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)):
        raise SpecError(
            f"lengths must be a list of ints or a list of lists of ints, not {lengths!r}"
        )

    def length(i: int, v) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(
                f"microbatch lengths, lengths[{i}]: `{v!r}` is not a length in tokens "
                "(a whole number above 0)"
            )
        # Beyond i128 (which Rust reads) the value is refused anyway: keep its sign.
        return max(min(v, 2**100), -(2**100))

    out = []
    for i, row in enumerate(lengths):
        if isinstance(row, (list, tuple)):
            out.append([length(i, v) for v in row])
        else:
            out.append([length(i, row)])
    return out


def compile(
    schedule: str,
    pp: int,
    microbatches: int | None = None,
    vpp: int | None = None,
    layout: str | None = None,
    group_size: int | None = None,
    forward_only: bool = False,
    combined: bool = False,
    memory_limit: float | str | None = None,
    megatron_p2p: str | None = None,
    cost: str | None = None,
    megatron_partial_recompute: int | None = None,
    lengths: list[int] | list[list[int]] | None = None,
    microbatch_order: list[int] | None = None,
    megatron_variable_seq_lengths: bool = False,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    p2p_groups: str = "pair",
    buffer_plan: bool = False,
) -> Schedule:
    """Generate, lower and verify a schedule, as ``pipec compile`` does before it writes.

    ``buffer_plan=True`` is ``--buffer-plan``: every ``send``/``recv`` of a tensor gets a
    ``slot`` of its rank's message-buffer pool (as few slots as the most messages live at once
    on the rank), sized by ``cost``'s message size; the pools count in the memory figures.

    ``num_layers`` / ``mtp_num_layers`` are ``--num-layers`` / ``--mtp-num-layers``: the
    decoder layers split evenly over the stages (MTP layers on the last), as Megatron splits
    them; with ``layout`` they must be the layout's counts (a :class:`LayoutError` otherwise).

    ``lengths`` is ``--microbatch-lengths``: one entry per microbatch, an int (one sequence
    of that many tokens) or a list of ints (the sequences packed into it). Its count is the
    number of microbatches (``microbatches`` may then be left out; one that disagrees is an
    error), every ``send``/``recv`` carries its ``tokens``, and :attr:`Schedule.lengths`
    returns them. ``microbatch_order`` is the order in which the microbatches enter the
    pipeline (a permutation of their indices, as ``pipec tune --json`` reports
    ``microbatch_order``); the instructions keep the user's microbatch indices.

    ``memory_limit`` and ``cost`` mean what ``Schedule.check``'s do (``"80GiB"`` needs
    ``K.act``/``K.param`` in bytes in ``cost``). ``megatron_partial_recompute=N`` is
    ``--megatron-partial-recompute N``: the forwards megatron-core checkpoints under
    ``num_microbatches_with_partial_activation_checkpoints = N`` (1f1b, interleaved-1f1b)
    become checkpointed forwards (``Op.fwd_checkpoint``) with a ``recompute`` before their
    backward. ``megatron_variable_seq_lengths=True`` is ``--megatron-variable-seq-lengths``:
    the program has the shape messages (``act_shape`` / ``grad_shape``) megatron-core's
    ``_communicate_shapes`` posts before every P2P call under ``variable_seq_lengths`` (1f1b,
    interleaved-1f1b); where Megatron's handshake deadlocks or crosses shapes this raises
    :class:`InvalidSchedule` naming where. Such a schedule models Megatron; it is not one to run.
    ``p2p_groups`` is ``--p2p-groups``: ``"pair"`` (default), ``"direction"`` or ``"edge"``,
    the communicators the schedule is verified under and :func:`pipec.torch.build_schedule`
    creates (:attr:`Schedule.p2p_groups`).

    Raises :class:`LayoutError` (the message echoes the layout with a caret),
    :class:`SpecError`, or :class:`InvalidSchedule` (``.violations``), all
    :class:`PipecError` (a ``ValueError``).
    """
    if megatron_p2p is not None and megatron_p2p not in _MEGATRON_P2P:
        raise SpecError(
            f"megatron_p2p must be one of {', '.join(_MEGATRON_P2P)}, not {megatron_p2p!r}"
        )
    _check_count("pp", pp)
    if microbatches is not None or lengths is None:
        _check_count("microbatches", microbatches, "(or give lengths=)")
    for name, v in (("vpp", vpp), ("group_size", group_size)):
        if v is not None:
            _check_count(name, v, "or None")
    # Layer counts as the CLI's u32 flags take them (0 included); the compiler judges the rest.
    for name, v in (("num_layers", num_layers), ("mtp_num_layers", mtp_num_layers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32):
            raise SpecError(f"{name} must be an integer from 0 to 2^32-1 or None, not {v!r}")
    if megatron_partial_recompute is not None and (
        isinstance(megatron_partial_recompute, bool)
        or not isinstance(megatron_partial_recompute, int)
    ):
        raise SpecError(
            f"megatron_partial_recompute must be an int or None, not {megatron_partial_recompute!r}"
        )
    lists = None if lengths is None else _lengths_lists(lengths)
    order = None
    if microbatch_order is not None:
        if isinstance(microbatch_order, (str, bytes)) or not isinstance(
            microbatch_order, (list, tuple)
        ):
            raise SpecError(f"microbatch_order must be a list of ints, not {microbatch_order!r}")
        for v in microbatch_order:
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(
                    f"microbatch_order must be a list of ints, not {microbatch_order!r}"
                )
        order = [max(min(v, 2**62), -(2**62)) for v in microbatch_order]
    # A name is parsed by `--p2p-groups`'s own parser (its words for a wrong one).
    if not isinstance(p2p_groups, str):
        raise SpecError(f"p2p_groups must be one of pair, direction, edge, not {p2p_groups!r}")
    if not isinstance(buffer_plan, bool):
        raise SpecError(f"buffer_plan must be True or False, not {buffer_plan!r}")
    if not isinstance(megatron_variable_seq_lengths, bool):
        raise SpecError(
            "megatron_variable_seq_lengths must be True or False, "
            f"not {megatron_variable_seq_lengths!r}"
        )

    return Schedule(
        _native.compile_schedule(
            schedule,
            pp,
            microbatches,
            vpp=vpp,
            layout=layout,
            group_size=group_size,
            forward_only=forward_only,
            combined=combined,
            memory_limit=_limit_text(memory_limit),
            megatron_p2p=megatron_p2p,
            cost=cost,
            megatron_partial_recompute=megatron_partial_recompute,
            lengths=lists,
            microbatch_order=order,
            megatron_variable_seq_lengths=megatron_variable_seq_lengths,
            num_layers=num_layers,
            mtp_num_layers=mtp_num_layers,
            p2p_groups=p2p_groups,
            buffer_plan=buffer_plan,
        )
    )


def load(path: str | os.PathLike, world_size: int | None = None) -> Schedule:
    """Load a compiled directory (JSON or binary rank files) with every check ``pipec-run``
    makes: format versions, file hashes, one schedule hash, structure, full verification, and
    ``world_size`` when given. A damaged or tampered directory raises :class:`FileError`
    naming the file and the reason; one that loads but does not verify, :class:`InvalidSchedule`.
    A file is refused as ``pipec-run`` refuses it: one of pipec's own files names its
    directory, and a torch CSV is imported first (``pipec import x.csv -o DIR``), where its
    stage placement can be given (``--pp``, ``--placement``) and its communication is placed
    and verified once.
    """
    return Schedule(_native.load_dir(os.fspath(path), world_size))


def seal(path: str | os.PathLike) -> dict:
    """``pipec seal``: recompute the hashes of a directory whose files another tool wrote or
    edited, so that :func:`load` and ``pipec check`` judge their content instead of refusing
    them as changed. The manifest then records ``sealed_by: "pipec seal"``. Returns
    ``ranks``, ``instructions``, ``changed`` (rank files whose recorded hash no longer
    matched) and ``unchanged`` (every hash already matched: nothing written). A missing or
    malformed file raises :class:`FileError` with the CLI's message (file, field, line).
    """
    return json.loads(_native.seal_dir(os.fspath(path)))


#: The keys of a cost file's ``[model]`` table (``pipec.tune(..., model={...})``), as the
#: Rust cost model reads them.
MODEL_KEYS: tuple[str, ...] = _native.MODEL_KEYS


def _with_model(cost: str | None, model: dict | None) -> str | None:
    """The cost text with ``model`` appended as a ``[model]`` table (the CLI's file form)."""
    if cost is not None and not isinstance(cost, str):
        raise SpecError(f"cost must be cost-spec text, not {cost!r}")
    if model is None:
        return cost
    if not isinstance(model, dict):
        raise SpecError(f"model must be a dict of [model] keys, not {model!r}")
    lines = ["[model]"]
    for key, value in model.items():
        if key not in MODEL_KEYS:
            raise SpecError(f"model: unknown key {key!r} (known: {', '.join(MODEL_KEYS)})")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        elif isinstance(value, float):
            # ``tflops``; Rust refuses a float where it wants an integer, and ``inf``/``nan``.
            text = repr(value)
        elif isinstance(value, str) and '"' not in value and "\n" not in value:
            text = f'"{value}"'
        else:
            raise SpecError(
                f"model: {key} must be an integer, a number, a boolean or a name, not {value!r}"
            )
        lines.append(f"{key} = {text}")
    return ("" if cost is None else cost + "\n") + "\n".join(lines) + "\n"


def cost_model(cost: str | None = None, model: dict | None = None) -> dict:
    """The cost model that ``cost`` (``--cost-file`` text) and ``model`` (the ``[model]``
    keys) describe, as a dict: per layer kind ``E``, ``t``, ``m``, ``L`` the pass times
    ``f``, ``b``, ``w``, then ``memory`` (per kind ``act`` and ``param``, bytes when derived
    from a model) and ``model`` (the shape, defaults filled in). Explicit keys in ``cost``
    win over what the model derives (docs/tune.md, "Model shape")."""
    return json.loads(_native.cost_model_json(_with_model(cost, model) or ""))


def tune(
    pp: int,
    microbatches: int | None,
    num_layers: int | None = None,
    mtp_num_layers: int | None = None,
    layout: str | None = None,
    rebalance: bool = False,
    cost: str | None = None,
    model: dict | None = None,
    memory_limit: str | float | None = None,
    target: str | None = None,
    kinds: list[str] | None = None,
    exclude_kinds: list[str] | None = None,
    out: str | os.PathLike | None = None,
    offload: bool = True,
    recompute: bool = True,
    lengths: list[int] | list[list[int]] | None = None,
    host_memory_limit: str | float | None = None,
    p2p_groups: str | None = None,
) -> tuple[Schedule, dict]:
    """``pipec tune``: the fastest verified schedule and layer split for a model's costs.

    ``cost`` is the cost-spec text of ``--cost`` / ``--cost-file`` (per layer kind ``K.f``,
    ``K.b``, ``K.w``, ``K.act``, ``K.param``, ``p2p``, ...); ``memory_limit`` is bytes with
    units (``"40GiB"``) or a number of activation units, applied to every rank. Returns the
    compiled, verified schedule (save it with :meth:`Schedule.save`) and the report
    ``pipec tune --json`` prints: ``schedule``, ``layout`` (a Megatron layout string),
    ``makespan``, ``lower_bound``, ``bubble``, ``peak_memory`` (per rank), ``candidates``.
    A limit nothing meets raises :class:`SpecError` naming the smallest peak reached.

    ``model`` describes the model by its shape, as the ``[model]`` table of a cost file
    (``dict(hidden=8192, ffn=28672, heads=64, kv_heads=8, seq=8192, vocab=128256,
    swiglu=True, normalization="RMSNorm", tp=8, dp=8, distributed_optimizer=True,
    recompute="selective")``): per-layer activation, parameter and optimizer bytes and pass
    times come from it (see :func:`cost_model`); keys in ``cost`` override them. Its times
    are in decoder-layer forwards unless ``tflops`` (the TFLOP/s one GPU achieves, a float)
    is given: then in seconds, or in the ``time_unit`` of ``cost``.

    ``target`` is the framework that will run it (``"megatron"``, ``"torch"``,
    ``"torchtitan"``, ``"pipec-run"``, ``"deepspeed"`` or ``"any"``): only candidates it runs are
    eligible, by the rule its adapter applies. The default, ``None``, asks for a schedule every
    framework runs (with ``lengths``: every framework that runs microbatches of different
    lengths, megatron, torch and pipec-run; torchtitan and DeepSpeed size receives once). ``kinds`` / ``exclude_kinds`` name the kinds to weigh or skip (``"tuned"``
    is pipec's own scheduler). The report's ``run`` says how to run the winner on the target,
    naming ``out`` (where you will save it) as its directory, one line per step: ``$ `` a shell
    command, ``>>> `` a Python statement, else what a framework's own settings must say
    (docs/tune.md "Run it"); ``runs_on`` lists every framework that runs it.

    Under ``memory_limit``, a candidate over the limit may be fitted by offloading activations
    to host memory and by recomputing checkpointed forwards, where the target's adapter runs
    them as tune places them: both on ``"pipec-run"``, ``"torch"`` and ``"any"``, offload only
    on ``"megatron"`` (it checkpoints only where Megatron's own rule puts checkpoints), neither
    on ``"torchtitan"``, ``"deepspeed"`` or the default (every framework). ``offload=False``,
    ``recompute=False`` turn a lever off, as ``--no-offload``, ``--no-recompute``; such a
    candidate's ``levers`` says per rank how much it offloads and recomputes and its makespan
    without them.

    ``lengths`` gives each microbatch's sequence lengths in tokens (issue #38): a list of
    ints (one sequence per microbatch) or a list of lists (the sequences packed into each),
    as ``--microbatch-lengths``. ``microbatches`` may then be ``None`` (a count that
    disagrees raises :class:`SpecError`). Tune also chooses the order microbatches enter the
    pipeline; the report's ``microbatch_order`` lists the ids in that order, and the
    schedule carries the lengths (every send and receive its ``tokens``). Planning per step
    is meant to be called every step (docs/tune.md, "Microbatch order").

    Offloaded activations live in host memory: the report's ``host_peak_memory`` gives each
    rank's most at once (in the unit of ``peak_memory``), and ``host_memory_limit`` (a size
    as ``memory_limit`` takes) bounds it per rank, as ``--host-memory-limit``. Without
    ``--target`` (``target=None``) the report's ``per_target`` gives each framework's own best
    plan (makespan, peak, host peak, levers), what ``target=`` that framework returns.

    ``p2p_groups`` is ``--p2p-groups``, as :func:`compile` takes it: ``"pair"`` (the default,
    also ``None``), ``"direction"`` or ``"edge"``. Every candidate is verified under those
    communicators (one that deadlocks there is not taken); the schedule carries them
    (:attr:`Schedule.p2p_groups`) and the report says ``p2p_groups`` when not ``"pair"``. A
    bad name raises :class:`SpecError` in the CLI's words.
    """
    lists = None
    if lengths is not None:
        lists = _tune_lengths(lengths)
        if microbatches is None:
            microbatches = len(lists)
        elif len(lists) != microbatches:
            raise SpecError(
                f"microbatches={microbatches} disagrees with lengths=, which gives "
                f"{len(lists)} microbatches (one entry each)"
            )
    for name, v in (("pp", pp), ("microbatches", microbatches)):
        _check_count(name, v)
    if memory_limit is not None and not isinstance(memory_limit, str):
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)):
            raise SpecError(f"memory_limit must be a size or a number, not {memory_limit!r}")
        memory_limit = repr(memory_limit)
    if host_memory_limit is not None and not isinstance(host_memory_limit, str):
        if isinstance(host_memory_limit, bool) or not isinstance(host_memory_limit, (int, float)):
            raise SpecError(
                f"host_memory_limit must be a size or a number, not {host_memory_limit!r}"
            )
        host_memory_limit = repr(host_memory_limit)
    for name, v in (("kinds", kinds), ("exclude_kinds", exclude_kinds)):
        if v is not None and (isinstance(v, str) or not all(isinstance(k, str) for k in v)):
            raise SpecError(f"{name} must be a list of kind names, not {v!r}")
    if target is not None and not isinstance(target, str):
        raise SpecError(f"target must be a name such as 'torch', not {target!r}")
    for name, v in (("offload", offload), ("recompute", recompute)):
        if not isinstance(v, bool):
            raise SpecError(f"{name} must be True or False, not {v!r}")
    if p2p_groups is not None and not isinstance(p2p_groups, str):
        raise SpecError(f"p2p_groups must be one of pair, direction, edge, not {p2p_groups!r}")
    native, report = _native.tune_schedule(
        pp,
        microbatches,
        num_layers=num_layers,
        mtp_num_layers=mtp_num_layers,
        layout=layout,
        rebalance=rebalance,
        cost=_with_model(cost, model),
        memory_limit=memory_limit,
        target=target,
        kinds=None if kinds is None else list(kinds),
        exclude_kinds=None if exclude_kinds is None else list(exclude_kinds),
        out=None if out is None else os.fspath(out),
        offload=offload,
        recompute=recompute,
        lengths=lists,
        host_memory_limit=host_memory_limit,
        p2p_groups=p2p_groups,
    )
    return Schedule(native), json.loads(report)


def _tune_lengths(lengths: object) -> list[list[int]]:
    """``tune``'s ``lengths=`` as lists of ints, one list per microbatch; anything else
    raises :class:`SpecError` naming the entry (the values are checked natively)."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)):
        raise SpecError(f"lengths must be a list of ints or of lists of ints, not {lengths!r}")
    out = []
    for i, v in enumerate(lengths):
        seqs = [v] if isinstance(v, int) else v
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, (list, tuple)):
            raise SpecError(f"lengths[{i}] must be an int or a list of ints, not {v!r}")
        for x in seqs:
            if isinstance(x, bool) or not isinstance(x, int):
                raise SpecError(f"lengths[{i}] must hold ints, not {x!r}")
        out.append(list(seqs))
    return out


def _as_schedule(schedule: Schedule | str | os.PathLike) -> Schedule:
    """A schedule given as itself or as the path of a compiled directory (loaded with every
    check), for the adapters (:mod:`pipec.torch`, :mod:`pipec.megatron`)."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, (str, os.PathLike)):
        return load(schedule)
    raise TypeError(
        f"expected a pipec.Schedule or the path of a compiled directory, got {type(schedule)}"
    )


def kinds() -> list[str]:
    """The schedule kinds pipec generates."""
    return list(_native.kinds())
