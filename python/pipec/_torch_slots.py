"""A buffer plan's receive pool on torch's pipeline runtime (issue #39).

A schedule compiled with ``buffer_plan=True`` names, on every ``recv``, the ``slot`` of its
rank's pool the received tensor lives in, from the post of its receive to the pass that
consumes it (docs/format.md, "Buffer plan"; ``pipec_ir::ir::buffers``). :class:`SlotPool`
makes torch's runtime use exactly those slots: one tensor per slot that holds a receive,
allocated once (at the first step, right after torch's shape inference), each receive landing
in a view of its slot's tensor instead of the buffer torch 2.15 allocates per receive
(``_RecvInfo.allocate_buffer``), and each consuming pass copying its message out of the slot,
which is then free for the next message the plan puts there.

Why the copy: torch hands the received tensor itself to the stage (the forward's input, which
autograd may save for the backward, or the output gradient of ``I``, whose intermediate
gradients ``W`` reads later), while the plan frees a slot at the consuming pass (``bwd_W``
keeps the stage's activations, ``K.act``, not the message). So the stage gets a copy made at
the consuming pass, the tensor torch would otherwise have allocated at the receive.

Sends are not copied into their slots: torch sends the stage's output (or input gradient)
tensor itself, which exists anyway, so a slot that only ever holds sends gets no tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import Op, PipecError, Schedule, _compat

#: Byte alignment of each tensor inside a slot (a message of several tensors is laid out one
#: after the other): CUDA's allocator hands out 512-byte aligned blocks and NCCL and the
#: vectorised copy kernels want at least 16; 256 keeps every view aligned for any dtype.
ALIGN = 256

_RECVS = (Op.recv, Op.sized_recv, Op.slotted_recv, Op.sized_slotted_recv)


def has_plan(s: Schedule) -> bool:
    """Whether ``s`` has a buffer plan (its sends and receives name slots)."""
    return any(i.slot is not None for r in range(s.pp) for i in s.instructions(r) if i.op in _RECVS)


def _name(key: tuple[str, int, int]) -> str:
    payload, producer, mb = key
    what = "activation" if payload == "act" else "gradient"
    return f"the {what} of stage {producer}, microbatch {mb}"


class SlotPool:
    """This rank's receive slots of a buffer plan, as torch tensors.

    ``buffers`` maps each slot that holds a receive to its tensor (flat ``uint8``, as many
    bytes as the largest message the plan puts in it needs); empty until :meth:`allocate`.
    ``held`` maps a slot to the message received into it and not yet consumed. A receive into
    a slot that still holds a message raises :class:`pipec.PipecError` naming the slot and both
    messages (the plan never does that; a hand-edited or mismatched plan would)."""

    def __init__(
        self,
        s: Schedule,
        stages: Sequence[Any],
        rank: int,
        token_dim: int = 0,
        user_of: Sequence[int] | None = None,
    ):
        self.rank = rank
        self.token_dim = token_dim
        self.lengths = s.lengths is not None
        self._stages = {st.stage_index: st for st in stages}
        self._user_of = user_of
        self._torch_of = None
        if user_of is not None:
            self._torch_of = {u: k for k, u in enumerate(user_of)}
        #: (payload, producing stage, user's microbatch) -> (slot, tokens or None)
        self.plan: dict[tuple[str, int, int], tuple[int, int | None]] = {}
        for i in s.instructions(rank):
            if i.op in _RECVS:
                if i.slot is None:
                    raise PipecError(
                        f"rank {rank}: the receive of {_name((i.payload, i.stage, i.mb))} has "
                        "no slot, but the schedule has a buffer plan"
                    )
                self.plan[(i.payload, i.stage, i.mb)] = (i.slot, i.tokens)
        self.buffers: dict[int, torch.Tensor] = {}
        self.sizes: dict[int, int] = {}
        self.held: dict[int, tuple[str, int, int]] = {}
        # (stage, grad, torch's microbatch) -> (slot, message, [(descriptor, view)])
        self._posted: dict[tuple[int, bool, int], tuple[int, tuple, list]] = {}

    # --- the plan's messages as torch's descriptors

    def _user(self, mb: int) -> int:
        return mb if self._user_of is None else self._user_of[mb]

    def _key(self, stage: int, grad: bool, mb: int) -> tuple[str, int, int]:
        """The plan's name of what ``stage`` receives for torch's microbatch ``mb``."""
        return ("grad", stage + 1, self._user(mb)) if grad else ("act", stage - 1, self._user(mb))

    def _layout(self, infos: tuple, tokens: int | None) -> list[tuple[Any, tuple, tuple, Any, int]]:
        """(descriptor, shape, stride, dtype, byte offset) of each tensor a receive holds, in
        the descriptors' order (those torch posts a receive for), ``tokens`` along
        ``token_dim`` when the plan has lengths."""
        out, at = [], 0
        for info in infos:
            meta = info.tensor_meta
            if getattr(info, "is_root_arg", False) or meta is None:
                continue
            shape = list(meta.shape)
            stride = list(meta.stride)
            if (
                tokens is not None
                and self.token_dim < len(shape)
                and shape[self.token_dim] != tokens
            ):
                shape[self.token_dim] = tokens
                acc = 1
                for d in range(len(shape) - 1, -1, -1):
                    stride[d] = acc
                    acc *= shape[d]
            at = -(-at // ALIGN) * ALIGN
            out.append((info, tuple(shape), tuple(stride), meta.dtype, at))
            at += _extent(shape, stride) * _itemsize(meta.dtype)
        return out

    def _nbytes(self, layout) -> int:
        if not layout:
            return 0
        _, shape, stride, dtype, at = layout[-1]
        return at + _extent(shape, stride) * _itemsize(dtype)

    def allocate(self) -> None:
        """Allocate every receive slot once, as large as the largest message the plan puts in
        it (from the stages' receive descriptors, which torch fills by its shape inference
        before the first action; with lengths, each message at its own ``tokens``). Later
        calls do nothing."""
        if self.buffers:
            return
        need: dict[int, int] = {}
        device: dict[int, Any] = {}
        for key, (slot, tokens) in self.plan.items():
            payload, producer, mb = key
            grad = payload == "grad"
            stage = producer - 1 if grad else producer + 1
            st = self._stages.get(stage)
            if st is None:
                raise PipecError(
                    f"rank {self.rank}: the plan receives {_name(key)} for stage {stage}, "
                    "which is not among this rank's stages"
                )
            torch_mb = mb if self._torch_of is None else self._torch_of[mb]
            infos = _compat.torch_recv_infos(st, grad, torch_mb)
            need[slot] = max(need.get(slot, 0), self._nbytes(self._layout(infos, tokens)))
            dev = torch.device(st.device)
            if device.setdefault(slot, dev) != dev:
                raise PipecError(
                    f"rank {self.rank}: slot {slot} holds messages of stages on "
                    f"{device[slot]} and on {dev}; one slot is one buffer on one device"
                )
        for slot in sorted(need):
            self.sizes[slot] = need[slot]
            self.buffers[slot] = torch.empty(need[slot], dtype=torch.uint8, device=device[slot])

    # --- torch's receive and its consumption

    @contextlib.contextmanager
    def receiving(self, st: Any, grad: bool, mb: int) -> Iterator[None]:
        """Around torch building the receive of ``mb`` on ``st`` (``get_fwd_recv_ops`` /
        ``get_bwd_recv_ops``): its descriptors retain views of the message's slot instead of
        allocating."""
        key = self._key(st.stage_index, grad, mb)
        if key not in self.plan:
            raise PipecError(
                f"rank {self.rank}, stage {st.stage_index}: torch receives {_name(key)}, "
                "which the buffer plan does not receive on this rank"
            )
        slot, tokens = self.plan[key]
        if slot in self.held:
            raise PipecError(
                f"rank {self.rank}: buffer slot {slot} would receive {_name(key)} while it "
                f"still holds {_name(self.held[slot])}, which has not been consumed yet; the "
                "buffer plan must not give two live messages one slot"
            )
        self.allocate()
        layout = self._layout(_compat.torch_recv_infos(st, grad, mb), tokens)
        buf = self.buffers[slot]
        if self._nbytes(layout) > buf.numel():
            raise PipecError(
                f"rank {self.rank}: {_name(key)} needs {self._nbytes(layout)} bytes, but slot "
                f"{slot} was allocated with {buf.numel()} at the first step (from the stages' "
                "shapes then); rebuild the schedule after the shapes change"
            )
        views = {}
        for info, shape, stride, dtype, at in layout:
            size = _extent(shape, stride) * _itemsize(dtype)
            views[id(info)] = buf[at : at + size].view(dtype).as_strided(shape, stride)
        taken: list = []

        def view_of(info: Any) -> torch.Tensor:
            v = views.get(id(info))
            if v is None:
                raise PipecError(
                    f"rank {self.rank}: torch allocates a receive for {_name(key)} that the "
                    "slot layout does not know"
                )
            taken.append((info, v))
            return v

        with _compat.torch_recv_into(_compat.torch_recv_infos(st, grad, mb), view_of):
            yield
        self.held[slot] = key
        self._posted[(st.stage_index, grad, mb)] = (slot, key, taken)

    def consume(self, st: Any, grad: bool, mb: int) -> None:
        """Right before the consuming pass takes its received tensors: each one that is still
        a view of its slot is replaced by a copy, and the slot is free again."""
        posted = self._posted.pop((st.stage_index, grad, mb), None)
        if posted is None:
            return
        slot, key, taken = posted
        for info, view in taken:
            _compat.torch_replace_recv_buffer(info, view, view.clone())
        if self.held.get(slot) == key:
            del self.held[slot]

    def pending(self) -> dict[int, tuple[str, int, int]]:
        """Slots holding a message no pass has consumed (none after a complete step)."""
        return dict(self.held)


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a tensor of ``shape`` and ``stride`` spans (0 when it is empty)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def install(pool: SlotPool, stages: Sequence[Any]) -> None:
    """Make each of ``stages`` receive into ``pool``'s slots and copy out at consumption:
    its ``get_fwd_recv_ops``/``get_bwd_recv_ops`` (the calls torch's runtime makes for a
    ``RECV_F``/``RECV_B``) run inside :meth:`SlotPool.receiving`, and its
    ``_retrieve_recv_activations``/``_retrieve_recv_grads`` (what ``forward_one_chunk`` and
    ``backward_one_chunk`` take the received tensors through, after the runtime waited for the
    receive) first call :meth:`SlotPool.consume`."""
    for st in stages:
        fwd_recv, bwd_recv = st.get_fwd_recv_ops, st.get_bwd_recv_ops

        def get_fwd_recv_ops(mb, st=st, orig=fwd_recv):
            if st.is_first:
                return orig(mb)
            with pool.receiving(st, False, mb):
                return orig(mb)

        def get_bwd_recv_ops(mb, st=st, orig=bwd_recv):
            if st.is_last or not _compat.torch_recv_infos(st, True, mb):
                return orig(mb)
            with pool.receiving(st, True, mb):
                return orig(mb)

        st.get_fwd_recv_ops = get_fwd_recv_ops
        st.get_bwd_recv_ops = get_bwd_recv_ops
        _compat.torch_before_retrieve(st, False, lambda mb, st=st: pool.consume(st, False, mb))
        _compat.torch_before_retrieve(st, True, lambda mb, st=st: pool.consume(st, True, mb))
