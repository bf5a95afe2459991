"""The saved activations of a rank's forwards that its memory instructions (issue 30) move:
what :class:`pipec.torch.SavedActivations` and :mod:`pipec.megatron`'s executor share.

A managed forward runs inside ``torch.autograd.graph.saved_tensors_hooks`` (:meth:`saving`):
each tensor autograd saves for the backward is packed into a :class:`_Saved` handle, and the
backward unpacks it from there. Tensors whose storage the stage keeps anyway (its inputs,
parameters and buffers) stay where they are (:meth:`settle`); the others are the forward's
activations, which ``offload`` copies to host memory (CUDA: pinned memory on a side stream that
first waits for the compute stream; CPU: a separate host copy, so a test can see them leave)
and ``reload`` copies back (CUDA: on the same stream, in order, as PipeOffload's runtime does;
the backward's compute stream waits for the copy when it unpacks the tensor); ``wait_offload``
makes the compute stream wait for the offload. Imports torch: only the adapters import this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from . import PipecError


class MemoryEvent(NamedTuple):
    """What one memory step did to the activations of forward (``stage``, ``mb``), in bytes of
    the tensors autograd saved there that the store manages (the stage's inputs and
    parameters, which the stage keeps anyway, are not counted): ``device`` held in device
    memory and ``host`` in host memory after the step, ``host_total`` all that the rank holds
    on the host. ``op`` is the rank file's name (``fwd``, ``fwd_checkpoint``,
    ``offload``, ``reload``, ``wait_offload``, ``recompute``)."""

    op: str
    stage: int
    mb: int
    device: int
    host: int
    host_total: int


class _Saved:
    """One tensor autograd saved in a managed forward: on the device (``tensor``), on the
    host (``host``), or neither (dropped by a checkpointed forward until its recompute)."""

    __slots__ = ("device", "host", "kept", "meta", "ready", "tensor")

    def __init__(self, t: torch.Tensor):
        # Detached: the same storage without the autograd node, so a saved output does not
        # hold its own node through this handle (a reference cycle).
        self.tensor: torch.Tensor | None = t.detach()
        self.host: torch.Tensor | None = None
        self.device = t.device
        self.meta = (t.shape, t.dtype)
        self.kept = False
        self.ready: Any = None  # the CUDA event of its reload

    def nbytes(self) -> int:
        shape, dtype = self.meta
        return shape.numel() * dtype.itemsize


class _Entry:
    """The managed forward of one (stage, microbatch), from its forward to its reload or
    recompute."""

    __slots__ = ("autocast", "checkpoint", "inputs", "key", "rng", "saved", "where")

    def __init__(self, key: tuple[int, int], checkpoint: bool):
        self.key = key
        self.checkpoint = checkpoint
        self.saved: list[_Saved] = []
        self.inputs: tuple[tuple, dict] | None = None
        self.rng: Any = None
        self.autocast: Any = None
        self.where = "forward"

    def managed(self) -> list[_Saved]:
        return [h for h in self.saved if not h.kept]

    def bytes(self) -> tuple[int, int]:
        """(device, host) bytes of the managed tensors, each storage once."""
        dev, host, seen = 0, 0, set()
        for h in self.managed():
            for t, side in ((h.tensor, 0), (h.host, 1)):
                if t is None or (id(t), side) in seen:
                    continue
                seen.add((id(t), side))
                if side:
                    host += h.nbytes()
                else:
                    dev += h.nbytes()
        return dev, host


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # no storage: a tensor subclass, a sparse one
        return None


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _kept_storages(inputs: Any, module: torch.nn.Module) -> set[int]:
    """The storages a stage keeps whatever its memory instructions do: its inputs (the
    executor holds them for the backward), parameters and buffers."""
    kept = {_storage(t) for t in _tensors(inputs)}
    kept |= {_storage(p) for p in module.parameters()}
    kept |= {_storage(b) for b in module.buffers()}
    kept.discard(None)
    return kept  # type: ignore[return-value]


class ActivationStore:
    """The managed forwards of one rank (see the module's note): :meth:`open` one, run it
    under :meth:`saving`, :meth:`settle` it, then ``offload`` / ``wait_offload`` / ``reload``.
    A handle lives as long as the autograd graph that holds it: after the backward the
    activations are freed as without pipec. :attr:`events` records each step of the current
    training step (:class:`MemoryEvent`)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], _Entry] = {}
        # offloaded, until its wait_offload: (True for a CPU copy or the CUDA event, device)
        self._offloads: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._streams: dict[Any, Any] = {}
        self._host_total = 0
        self.events: list[MemoryEvent] = []
        #: Where the caller is (say ``rank 0, #12: bwd(stage 0, mb 1)``), prefixed to the error
        #: of a backward that finds an activation off the device; ``None``: nothing to say.
        self.context: str | None = None

    def begin_step(self) -> None:
        """Start a training step: nothing is held from an earlier one (an interrupted step
        leaves its handles to its own graph)."""
        self._entries.clear()
        self._offloads.clear()
        self._host_total = 0
        self.events = []

    def pending(self) -> list[tuple[int, int]]:
        """The managed forwards not yet reloaded or recomputed."""
        return sorted(self._entries)

    def where(self, stage: int, mb: int) -> str | None:
        """Where the managed forward's activations are (``device``, ``host``, ``dropped``),
        or ``None`` when it is not managed or was reloaded or recomputed."""
        entry = self._entries.get((stage, mb))
        return None if entry is None else entry.where

    def _event(self, op: str, entry: _Entry) -> None:
        dev, host = entry.bytes()
        s, m = entry.key
        self.events.append(MemoryEvent(op, s, m, dev, host, self._host_total))

    # --- the forward

    def open(self, key: tuple[int, int], checkpoint: bool) -> _Entry:
        """A new managed forward of ``key``."""
        if key in self._entries:
            raise PipecError(
                f"forward of stage {key[0]}, microbatch {key[1]} ran again before its "
                "activations were reloaded or recomputed"
            )
        entry = _Entry(key, checkpoint)
        self._entries[key] = entry
        return entry

    @contextlib.contextmanager
    def saving(self, entry: _Entry) -> Iterator[None]:
        """Run the forward of ``entry`` with what autograd saves packed into its handles."""

        def pack(t: torch.Tensor) -> _Saved:
            h = _Saved(t)
            entry.saved.append(h)
            return h

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def settle(self, entry: _Entry, kept: set[int]) -> None:
        """The forward of ``entry`` ended: the handles whose storage is in ``kept`` (or empty)
        stay out of the memory instructions; a checkpointed forward drops the others."""
        for h in entry.saved:
            ptr = _storage(h.tensor)
            h.kept = (ptr is not None and ptr in kept) or h.nbytes() == 0
            if entry.checkpoint and not h.kept:
                h.tensor = None
        entry.where = "dropped" if entry.checkpoint else "device"
        self._event("fwd_checkpoint" if entry.checkpoint else "fwd", entry)

    def _unpack(self, h: _Saved) -> torch.Tensor:
        if h.tensor is None:
            raise PipecError(
                (f"{self.context}: " if self.context else "")
                + "the backward needs an activation that is "
                + ("in host memory (no reload before it)" if h.host is not None else "dropped")
                + "; the schedule must reload or recompute before the backward"
            )
        if h.ready is not None:
            torch.cuda.current_stream(h.tensor.device).wait_event(h.ready)
        return h.tensor

    # --- the memory instructions

    def _entry(self, op: str, stage: int, mb: int, where: str) -> _Entry:
        entry = self._entries.get((stage, mb))
        if entry is None or entry.where != where:
            state = "no managed forward" if entry is None else f"its activations are {entry.where}"
            raise PipecError(f"{op}(stage {stage}, mb {mb}): {state}, expected {where}")
        return entry

    def _copy_stream(self, device: torch.device) -> Any:
        st = self._streams.get(device)
        if st is None:
            st = self._streams[device] = torch.cuda.Stream(device)
        return st

    def offload(self, stage: int, mb: int) -> None:
        entry = self._entry("offload", stage, mb, "device")
        moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        stream = None  # the copy stream, once it has waited for the forward's kernels
        for h in entry.managed():
            t = h.tensor
            if id(t) not in moved:
                if t.untyped_storage().nbytes() == 0:
                    # Freed outside autograd (resize_(0)): what was saved is no longer there.
                    raise PipecError(
                        f"offload(stage {stage}, mb {mb}): a tensor its forward saved "
                        f"({tuple(t.shape)}) was released outside autograd after it was saved "
                        "(an output-discarding checkpoint or another offloader frees storage "
                        "and refills it in place); it cannot be moved to the host"
                    )
                if t.is_cuda:
                    if stream is None:
                        stream = self._copy_stream(t.device)
                        stream.wait_stream(torch.cuda.current_stream(t.device))
                    with torch.cuda.stream(stream):
                        host = torch.empty_like(t, device="cpu", pin_memory=True)
                        host.copy_(t, non_blocking=True)
                    t.record_stream(stream)  # not reused before the copy has read it
                else:
                    host = torch.empty_like(t, device="cpu").copy_(t)
                moved[id(t)] = (t, host)
                self._host_total += h.nbytes()
            h.host, h.tensor = moved[id(t)][1], None
        done: Any = True  # a CPU copy has ended already
        device = None
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            device = stream.device
        self._offloads[(stage, mb)] = (done, device)
        entry.where = "host"
        self._event("offload", entry)

    def wait_offload(self, stage: int, mb: int) -> None:
        pending = self._offloads.pop((stage, mb), None)
        if pending is None:
            raise PipecError(f"wait_offload(stage {stage}, mb {mb}): no offload of it is pending")
        done, device = pending
        if done is not True:
            torch.cuda.current_stream(device).wait_event(done)
        dev, host = 0, 0
        entry = self._entries.get((stage, mb))
        if entry is not None:
            dev, host = entry.bytes()
        self.events.append(MemoryEvent("wait_offload", stage, mb, dev, host, self._host_total))

    def reload(self, stage: int, mb: int) -> None:
        entry = self._entry("reload", stage, mb, "host")
        back: dict[int, torch.Tensor] = {}
        for h in entry.managed():
            host = h.host
            if id(host) not in back:
                if h.device.type == "cuda":
                    stream = self._copy_stream(h.device)
                    with torch.cuda.stream(stream):
                        t = torch.empty_like(host, device=h.device)
                        t.copy_(host, non_blocking=True)
                        ready = torch.cuda.Event()
                        ready.record(stream)
                    t.record_stream(torch.cuda.current_stream(h.device))
                    h.ready = ready
                else:
                    t = host.clone()
                back[id(host)] = t
                self._host_total -= h.nbytes()
            h.tensor, h.host = back[id(host)], None
        entry.where = "device"
        self._event("reload", entry)
        del self._entries[(stage, mb)]
