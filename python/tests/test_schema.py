"""#27: the rank file's instructions have one schema, in Rust; the Python executors, which
dispatch on each typed instruction's ``op`` (a ``pipec.Op``), are checked against it (no torch
needed)."""

from __future__ import annotations

import ast
import json
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
    assert {k for _, fs in schema for _, k in fs} <= {
        "int",
        "act|grad|act_shape|grad_shape",
        "true",
    }


@pytest.mark.parametrize("module", ["megatron.py", "deepspeed.py"])
def test_executors_dispatch_exactly_the_schema(module: str):
    """Each executor names every row of the schema (runs it, or refuses it by name) and no op
    the schema lacks: a new instruction fails here until each executor decides what it means."""
    assert _ops_named((PKG / module).read_text()) == set(_rows())


def _rows() -> dict[str, int]:
    """``pipec.Op``'s members by name: one per schema row, its integer the row's index."""
    return {n: int(m) for n in dir(pipec.Op) if isinstance(m := getattr(pipec.Op, n), pipec.Op)}


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
    """Offload, reload, recompute and checkpointed forwards verify and load; DeepSpeed's
    executor refuses them all, with a PipecError naming the rank and instruction. Megatron's
    executor runs the copies (test_megatron_offload), and checkpointed forwards only as
    megatron-core's partial recompute: the marks must be Megatron's own under the config's N."""
    pytest.importorskip("torch")
    s = _with_memory_ops(tmp_path, checkpoint)
    from pipec import deepspeed, megatron

    # DeepSpeed refuses by the one rule `pipec tune --target deepspeed` applies, naming the
    # first memory instruction.
    with pytest.raises(pipec.PipecError, match=r"rank 0, #\d+: .*not executed by this target"):
        deepspeed.check(s, 2, 2)
    assert s.refusal("deepspeed") is not None and s.refusal("pipec-run") is None
    # pipec.megatron takes both (the Rust rule agrees).
    assert s.refusal("megatron") is None
    if not checkpoint:
        megatron.forward_backward_func(s)
        return
    megatron.forward_backward_func(s)  # accepted: decided per call, by the config's N
    with pytest.raises(
        pipec.PipecError, match=r"rank 0: the schedule checkpoints fwd\(stage 0, mb 0\)"
    ):
        megatron._checkpoint_flags(s, None)
    # Megatron checkpoints microbatch 1 of rank 0 at N = 1 (window 2), both at N = 0.
    with pytest.raises(pipec.PipecError, match=r"mb 0\), which Megatron does not: .*=1"):
        megatron._checkpoint_flags(s, 1)
    with pytest.raises(pipec.PipecError, match=r"does not checkpoint fwd\(stage 0, mb 1\)"):
        megatron._checkpoint_flags(s, 0)
