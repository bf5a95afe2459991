"""``pipec.Op``, made from the rank file's schema (Rust: ``ir/src/files/schema.rs``, one row
per instruction, exported as ``_native.op_rows()``), not written by hand: a row added there is
a member here. ``Instruction.op`` hands out these members."""

from __future__ import annotations

import enum

from . import _native

#: (row, the file's op, its fields) per member, in variant-index order.
_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (row, name, tuple(fields)) for row, name, fields in _native.op_rows()
)


class _Op(enum.IntEnum):
    """An instruction's op: one member per row of the rank file's schema, named as the row
    (``Op.fwd``, ``Op.bwd_D``, ``Op.fwd_checkpoint``: a ``fwd`` with ``"checkpoint": true``),
    ``int(op)`` the row's variant index; ``name`` is the op as the file writes it (``"fwd"``
    for ``Op.fwd_checkpoint``) and ``fields`` its fields in file order. ``list(Op)`` lists
    them in schema order."""

    @property
    def name(self) -> str:  # type: ignore[override]
        return _ROWS[self][1]

    @property
    def fields(self) -> list[str]:
        return list(_ROWS[self][2])

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        # The op as the file writes it: `ins.op == "fwd"` agrees with `ins["op"] == "fwd"`
        # (issue #40), so `Op.fwd_checkpoint == "fwd"` too, as its record's op is "fwd".
        if isinstance(other, str):
            return self.name == other
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    # Hashed as the int: members stay usable as dict keys and in sets of members; a set of
    # strings does not find them (`Op.fwd in {"fwd"}` is False; compare with `==`).
    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"Op.{self._name_}"


Op = _Op("Op", [(row, i) for i, (row, _, _) in enumerate(_ROWS)], module="pipec")
Op.__doc__ = _Op.__doc__
Op.__qualname__ = "Op"
