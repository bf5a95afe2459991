"""#27: the rank file's instructions have one schema, in Rust; the Python executors, which
dispatch on the JSON ``op`` of each instruction, are checked against it (no torch needed)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pipec
import pytest
from pipec import _native

PKG = Path(pipec.__file__).parent


def _ops_named(source: str) -> set[str]:
    """Every op name the module compares an instruction's ``op`` with (``op == "fwd"``,
    ``ins["op"] in ("send", "recv")``, ``op not in _COMPUTE`` with ``_COMPUTE`` a literal)."""
    tree = ast.parse(source)
    consts = {
        t.id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and isinstance(n.value, (ast.Tuple, ast.Set, ast.List))
    }

    def is_op(e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id == "op"
        return isinstance(e, ast.Subscript) and (
            isinstance(e.slice, ast.Constant) and e.slice.value == "op"
        )

    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and is_op(n.left):
            for c in n.comparators:
                if isinstance(c, ast.Name) and c.id in consts:
                    names.update(consts[c.id])
                elif isinstance(c, (ast.Constant, ast.Tuple, ast.Set, ast.List)):
                    v = ast.literal_eval(c)
                    names.update(
                        x for x in ([v] if isinstance(v, str) else v or ()) if isinstance(x, str)
                    )
    return names


def test_schema_is_the_rank_files():
    """The exported schema is what a rank file holds: every op and its fields, in order."""
    schema = _native.instruction_schema()
    s = pipec.compile("dualpipe-v", pp=4, microbatches=8)
    # An op may have two rows: `fwd`, and `fwd` with its optional key `checkpoint`.
    fields: dict[str, list[list[str]]] = {}
    for op, fs in schema:
        fields.setdefault(op, []).append([f for f, _ in fs])
    seen = set()
    for r in range(s.pp):
        for ins in s.instructions(r):
            keys = list(ins)
            assert keys[0] == "op"
            assert keys[1:] in fields[ins["op"]]
            seen.add(ins["op"])
    assert seen <= set(fields)
    assert fields["fwd"] == [["stage", "mb"], ["stage", "mb", "checkpoint"]]
    assert {k for _, fs in schema for _, k in fs} <= {"int", "act|grad", "true"}


@pytest.mark.parametrize("module", ["megatron.py", "deepspeed.py"])
def test_executors_dispatch_exactly_the_schema(module: str):
    """Each executor names every op of the schema (runs it, or refuses it by name) and no op
    the schema lacks: a new instruction fails here until each executor decides what it means."""
    ops = {op for op, _ in _native.instruction_schema()}
    assert _ops_named((PKG / module).read_text()) == ops


def _with_memory_ops(tmp_path, checkpoint: bool):
    """1F1B at pp=2 with stage 0's first forward offloaded and reloaded (or checkpointed and
    recomputed), written as another tool would and sealed."""
    s = pipec.compile("1f1b", pp=2, microbatches=2)
    s.save(tmp_path)
    path = tmp_path / "rank-0.json"
    doc = json.loads(path.read_text())
    ins = doc["instructions"]
    f = next(i for i, x in enumerate(ins) if x["op"] == "fwd" and x["mb"] == 0)
    b = next(i for i, x in enumerate(ins) if x["op"] == "bwd" and x["mb"] == 0)
    if checkpoint:
        ins[f]["checkpoint"] = True
        ins.insert(b, {"op": "recompute", "stage": 0, "mb": 0})
    else:
        ins.insert(b, {"op": "reload", "stage": 0, "mb": 0})
        ins.insert(f + 1, {"op": "offload", "stage": 0, "mb": 0})
    path.write_text(json.dumps(doc))
    pipec.seal(tmp_path)
    return pipec.load(tmp_path)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_executors_refuse_memory_ops(tmp_path, checkpoint: bool):
    """Offload, reload, recompute and checkpointed forwards verify and load, and each executor
    refuses them with a PipecError naming the rank and instruction (not executed yet)."""
    pytest.importorskip("torch")
    s = _with_memory_ops(tmp_path, checkpoint)
    op = "fwd (checkpoint)" if checkpoint else "offload"
    from pipec import megatron

    with pytest.raises(pipec.PipecError, match=rf"rank 0, #\d+: {re.escape(op)}: .*pipec.megatron"):
        megatron.forward_backward_func(s)
