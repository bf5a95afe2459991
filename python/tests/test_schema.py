"""#27: the rank file's instructions have one schema, in Rust; the Python executors, which
dispatch on each typed instruction's ``op`` (a ``pipec.Op``), are checked against it (no torch
needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pipec
import pytest
from pipec import _native

PKG = Path(pipec.__file__).parent


def _ops_named(source: str) -> set[str]:
    """Every op the module names: each ``Op.<name>`` it mentions (``ins.op == Op.fwd``,
    ``case Op.send | Op.recv``, ``{Op.bwd: ...}``), and ``wait`` where it handles a
    ``WaitStep`` (``Schedule.steps`` hands each wait over as that step, not as an op)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Op":
            names.add(n.attr)
        elif isinstance(n, ast.Name) and n.id == "WaitStep":
            names.add("wait")
    return names


def test_schema_is_the_rank_files():
    """The exported schema is what a rank file holds: every op and its fields, in order."""
    schema = _native.instruction_schema()
    s = pipec.compile("dualpipe-v", pp=4, microbatches=8)
    fields = {op: [f for f, _ in fs] for op, fs in schema}
    seen = set()
    for r in range(s.pp):
        for ins in s.instructions(r):
            assert list(ins) == ["op", *fields[ins["op"]]]
            seen.add(ins["op"])
    assert seen <= set(fields)
    assert {k for _, fs in schema for _, k in fs} <= {"int", "act|grad"}


@pytest.mark.parametrize("module", ["megatron.py", "deepspeed.py"])
def test_executors_dispatch_exactly_the_schema(module: str):
    """Each executor names every op of the schema (runs it, or refuses it by name) and no op
    the schema lacks: a new instruction fails here until each executor decides what it means."""
    ops = {op for op, _ in _native.instruction_schema()}
    assert _ops_named((PKG / module).read_text()) == ops


@pytest.mark.parametrize("module", ["megatron.py", "deepspeed.py", "torch.py"])
def test_executors_read_typed_instructions(module: str):
    """No executor reads an instruction as a JSON dict any more (``ins["op"]``), compares a
    string with an op's name (``op == "fwd"``), or cuts comm batches itself (its batches come
    from ``Schedule.steps``, cut in Rust): the typed objects from Rust are all they read."""
    tree = ast.parse((PKG / module).read_text())
    ops = {op for op, _ in _native.instruction_schema()}
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            assert n.slice.value not in ("op", "batch", "stage", "mb", "peer", "payload"), (
                f"{module}:{n.lineno} reads an instruction as a dict"
            )
        if isinstance(n, ast.Compare):
            for c in [n.left, *n.comparators]:
                consts = c.elts if isinstance(c, (ast.Tuple, ast.Set, ast.List)) else [c]
                for k in consts:
                    assert not (isinstance(k, ast.Constant) and k.value in ops), (
                        f"{module}:{n.lineno} compares a string with the op {k.value!r}"
                    )
    assert "rank_instructions_json" not in (PKG / module).read_text()
