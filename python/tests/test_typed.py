"""#27: the typed data the package gets from Rust (``Schedule.instructions``, ``Schedule.steps``,
``Schedule.torch_actions``), checked against the CLI's files read as plain JSON and cut by a
test-local reference, and against the rank file's schema (no torch needed)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping

import pipec
import pytest
from pipec import BatchStep, ComputeStep, Instruction, MemoryStep, Op, Task, WaitStep, _native
from test_api import _cli

#: (CLI flags, the same as pipec.compile arguments): every op of the schema appears in one.
CASES = [
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"], {"schedule": "1f1b", "pp": 4}),
    (["--schedule", "zb-v", "--pp", "3", "--microbatches", "6"], {"schedule": "zb-v", "pp": 3}),
    (
        ["--schedule", "dualpipe-v", "--pp", "4", "--microbatches", "8"],
        {"schedule": "dualpipe-v", "pp": 4},
    ),
    (
        ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--combined"],
        {"schedule": "1f1b", "pp": 2, "combined": True},
    ),
    (
        [
            *("--schedule", "interleaved-1f1b", "--pp", "4", "--vpp", "2"),
            *("--microbatches", "8", "--megatron-p2p", "overlap"),
        ],
        {"schedule": "interleaved-1f1b", "pp": 4, "vpp": 2, "megatron_p2p": "overlap"},
    ),
    (
        ["--schedule", "1f1b", "--pp", "3", "--microbatches", "6", "--megatron-p2p", "unbatched"],
        {"schedule": "1f1b", "pp": 3, "megatron_p2p": "unbatched"},
    ),
    (
        ["--schedule", "dualpipe", "--pp", "4", "--microbatches", "8"],
        {"schedule": "dualpipe", "pp": 4},
    ),
    (
        ["--schedule", "gpipe", "--pp", "2", "--microbatches", "3", "--forward-only"],
        {"schedule": "gpipe", "pp": 2, "forward_only": True},
    ),
    (
        ["--schedule", "zb-v", "--pp", "4", "--microbatches", "8", "--buffer-plan"],
        {"schedule": "zb-v", "pp": 4, "buffer_plan": True},
    ),
]


def _microbatches(flags: list[str]) -> int:
    return int(flags[flags.index("--microbatches") + 1])


def _cli_records(tmp_path, flags: list[str]) -> list[list[dict]]:
    """Every rank's instruction records as ``pipec compile -o DIR`` writes them."""
    d = tmp_path / "cli"
    subprocess.run([_cli(), "compile", *flags, "-o", d], check=True, capture_output=True)
    pp = json.loads((d / "manifest.json").read_text())["world_size"]
    return [json.loads((d / f"rank-{r}.json").read_text())["instructions"] for r in range(pp)]


def _reference_steps(records: list[dict]) -> list[tuple]:
    """docs/format.md's rule, written out once here: a comm batch is a maximal run of
    consecutive sends and receives with one batch id; a compute op or a wait is a unit of its
    own; a batch is left in flight when some wait of the rank names its id."""
    waited = {r["batch"] for r in records if r["op"] == "wait"}
    out, i = [], 0
    while i < len(records):
        rec = records[i]
        if rec["op"] in ("send", "recv"):
            j = i
            while (
                j < len(records)
                and records[j]["op"] in ("send", "recv")
                and records[j]["batch"] == rec["batch"]
            ):
                j += 1
            out.append(("batch", rec["batch"], tuple(range(i, j)), rec["batch"] in waited))
            i = j
        elif rec["op"] == "wait":
            out.append(("wait", i, rec["batch"]))
            i += 1
        elif rec["op"] in ("offload", "reload", "wait_offload", "recompute"):
            out.append(("memory", i))
            i += 1
        else:
            out.append(("compute", i))
            i += 1
    return out


def _plain(step) -> tuple:
    """A typed step in the reference's words."""
    match step:
        case ComputeStep(instruction=ins):
            assert step.index == ins.index
            return ("compute", ins.index)
        case BatchStep(id=b, ops=ops, in_flight=in_flight):
            assert step.index == ops[0].index and all(o.batch == b for o in ops)
            return ("batch", b, tuple(o.index for o in ops), in_flight)
        case WaitStep(index=i, batch=b):
            return ("wait", i, b)
        case MemoryStep(instruction=ins):
            assert step.index == ins.index
            return ("memory", ins.index)
    raise AssertionError(f"not a step: {step!r}")


@pytest.mark.parametrize("flags,kw", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_steps_and_instructions_are_the_cli_files(tmp_path, flags, kw):
    records = _cli_records(tmp_path, flags)
    s = pipec.compile(microbatches=_microbatches(flags), **kw)
    assert s.pp == len(records)
    for r, recs in enumerate(records):
        ins = s.instructions(r)
        # The records, as dicts, equal the file's (keys in file order), and each typed field
        # is the record's.
        assert [i.to_dict() for i in ins] == recs
        assert ins == recs
        for k, (i, rec) in enumerate(zip(ins, recs, strict=True)):
            assert list(i) == list(rec) and i.index == k
            assert (i.op, i.op.name) == (getattr(Op, _row(rec)), rec["op"])
            for key in ("stage", "mb", "peer", "payload", "batch", "tokens", "slot"):
                assert getattr(i, key) == rec.get(key)
            if rec["op"] == "fwd_bwd":
                assert i.fwd == Task(rec["fwd_stage"], rec["fwd_mb"])
                assert i.bwd == Task(rec["bwd_stage"], rec["bwd_mb"])
                assert (i.fwd.stage, i.fwd.mb) == (rec["fwd_stage"], rec["fwd_mb"])
            else:
                assert i.fwd is None and i.bwd is None
        steps = s.steps(r)
        assert [_plain(st) for st in steps] == _reference_steps(recs)
        # A batch's ops are the instructions at those positions.
        for st in steps:
            if isinstance(st, BatchStep):
                assert list(st.ops) == [ins[o.index] for o in st.ops]


def _row(rec: dict) -> str:
    """The schema row of a record: its op, ``fwd_checkpoint`` for a checkpointed forward,
    ``sized_send``/``sized_recv`` for a message with ``tokens`` (a plan with lengths),
    ``slotted_``/``sized_slotted_`` with a buffer plan's ``slot``."""
    if rec.get("checkpoint"):
        return "fwd_checkpoint"
    sized = "sized_" if "tokens" in rec else ""
    slotted = "slotted_" if "slot" in rec else ""
    return f"{sized}{slotted}{rec['op']}" if sized or slotted else rec["op"]


def _memory_dir(tmp_path) -> list[list[dict]]:
    """1F1B at pp=2, M=2 with every memory instruction: on rank 0 stage 0's microbatch 0
    offloaded (waited) and reloaded before its backward, microbatch 1 checkpointed and
    recomputed; written as another tool would, sealed by the CLI. Returns the records."""
    d = tmp_path / "mem"
    subprocess.run(
        [_cli(), "compile", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "-o", d],
        check=True,
        capture_output=True,
    )
    path = d / "rank-0.json"
    doc = json.loads(path.read_text())
    ins = doc["instructions"]
    at = {(x["op"], x.get("mb")): i for i, x in enumerate(ins)}
    ins[at["fwd", 1]]["checkpoint"] = True
    edits = [
        (at["bwd", 1], {"op": "recompute", "stage": 0, "mb": 1}),
        (at["bwd", 0], {"op": "reload", "stage": 0, "mb": 0}),
        (at["fwd", 1], {"op": "wait_offload", "stage": 0, "mb": 0}),
        (at["fwd", 0] + 1, {"op": "offload", "stage": 0, "mb": 0}),
    ]
    for i, rec in sorted(edits, key=lambda e: -e[0]):
        ins.insert(i, rec)
    path.write_text(json.dumps(doc))
    subprocess.run([_cli(), "seal", d], check=True, capture_output=True)
    return [json.loads((d / f"rank-{r}.json").read_text())["instructions"] for r in range(2)]


def test_memory_ops_are_their_records(tmp_path):
    """Offload, reload, wait_offload, recompute and a checkpointed forward read as their
    records, each its own row of ``Op``, and cut as steps of their own (the forward as a
    compute step)."""
    records = _memory_dir(tmp_path)
    s = pipec.load(tmp_path / "mem")
    for r, recs in enumerate(records):
        ins = s.instructions(r)
        assert ins == recs and [dict(i) for i in ins] == recs
        for i, rec in zip(ins, recs, strict=True):
            assert i.op == getattr(Op, _row(rec)) and i.op.name == rec["op"]
            assert i.checkpoint == bool(rec.get("checkpoint")) and list(i) == list(rec)
            assert (i.stage, i.mb) == (rec.get("stage"), rec.get("mb"))
        assert [_plain(st) for st in s.steps(r)] == _reference_steps(recs)
    assert {_row(x) for x in records[0]} >= {"fwd_checkpoint", "offload", "reload", "recompute"}


def test_every_op_is_reached(tmp_path):
    """The cases above between them hold every op of the schema (so each is compared)."""
    seen = set()
    for _, kw in CASES:
        s = pipec.compile(microbatches=8, **kw)
        seen |= {_row(i) for r in range(s.pp) for i in s.instructions(r)}
    seen |= {_row(x) for recs in _memory_dir(tmp_path) for x in recs}
    sized = pipec.compile("1f1b", 2, lengths=[3, [1, 4]])
    seen |= {_row(i) for r in range(2) for i in sized.instructions(r)}
    both = pipec.compile("1f1b", 2, lengths=[3, [1, 4]], buffer_plan=True)
    seen |= {_row(i) for r in range(2) for i in both.instructions(r)}
    assert seen == {n for n in dir(Op) if isinstance(getattr(Op, n), Op)}
    assert len(seen) == len(_native.instruction_schema())


def test_op_is_the_schema():
    """``Op`` has one member per row of the rank file's schema, numbered as it is and named as
    the file names its op (a checkpointed forward: ``Op.fwd_checkpoint``, whose ``name`` is
    the file's ``"fwd"``)."""
    schema = _native.instruction_schema()
    members = {n: getattr(Op, n) for n in dir(Op) if isinstance(getattr(Op, n), Op)}
    assert sorted(int(op) for op in members.values()) == list(range(len(schema)))
    for row, op in members.items():
        name, fields = schema[int(op)]
        assert (op.name, str(op)) == (name, name)
        assert op.fields == [f for f, _ in fields]
        if "checkpoint" in op.fields:
            assert row == name + "_checkpoint"
        else:
            sized = "sized_" if "tokens" in op.fields else ""
            assert row == sized + ("slotted_" if "slot" in op.fields else "") + name
        assert repr(op) == f"Op.{row}"
    assert Op.fwd != Op.bwd and len({Op.fwd, Op.fwd, Op.bwd}) == 2
    assert Op.fwd_checkpoint != Op.fwd
    # #41: made from the schema's rows, not written by hand: list(Op) is the rows in order.
    assert [repr(op) for op in Op] == [f"Op.{row}" for row, _, _ in _native.op_rows()]
    assert [int(op) for op in Op] == list(range(len(schema)))
    assert Op(3) is Op.bwd_W and isinstance(Op.fwd, Op) and Op.__module__ == "pipec"


def test_op_compares_as_the_files_op():
    """#40: ``list(pipec.Op)`` lists the members, and ``ins.op == "fwd"`` agrees with
    ``ins["op"] == "fwd"`` on every instruction (the record's op is the reference)."""
    assert list(pipec.Op) == [getattr(Op, row) for row, _, _ in _native.op_rows()]
    assert len(list(pipec.Op)) == len(_native.op_rows())
    s = pipec.compile("1f1b", 2, 4, megatron_partial_recompute=1)
    names = {op.name for op in Op} | {"nope"}
    checked = 0
    for rank in range(s.pp):
        for ins in s.instructions(rank):
            for name in names:
                assert (ins.op == name) == (ins["op"] == name), (ins, name)
                assert (ins.op != name) == (ins["op"] != name), (ins, name)
                checked += 1
    assert checked > 0 and any(i.op == Op.fwd_checkpoint for i in s.instructions(0))
    # A checkpointed forward is written "fwd": it equals that string and stays its own member.
    assert Op.fwd_checkpoint == "fwd" and Op.fwd_checkpoint != Op.fwd
    assert Op.fwd == Op.fwd and Op.fwd != "bwd" and Op.fwd == int(Op.fwd)
    assert {Op.fwd: 1}[Op.fwd] == 1


def test_instruction_reads_as_its_record():
    """What ``instructions`` returned before (dicts) still works on the typed objects."""
    s = pipec.compile("1f1b", 2, 2, combined=True)
    old = json.loads(s._n.rank_instructions_json(1))
    ins = s.instructions(1)
    assert all(isinstance(i, Instruction) and isinstance(i, Mapping) for i in ins)
    for i, rec in zip(ins, old, strict=True):
        assert dict(i) == rec and i == rec and rec == i
        assert list(i.keys()) == list(rec) and list(i.values()) == list(rec.values())
        assert list(i.items()) == list(rec.items()) and len(i) == len(rec)
        assert all(i[k] == v and k in i for k, v in rec.items())
        assert i.get("nope") is None and i.get("nope", 7) == 7 and "nope" not in i
        with pytest.raises(KeyError):
            i["nope"]
        assert i != {**rec, "extra": 1} and i != 3
    assert ins == s.instructions(1) and hash(ins[0]) == hash(s.instructions(1)[0])
    for a in ins:  # equal exactly when the records are
        assert [a == b for b in ins] == [a.to_dict() == b.to_dict() for b in ins]
    send = next(i for i in s.instructions(0) if i.op == Op.send)
    assert (send.peer, send.payload, send.stage, send.mb, send.batch) == (1, "act", 0, 0, 0)
    assert send.keys() == ["op", "peer", "payload", "stage", "mb", "batch"]
    fwd = s.instructions(0)[0]
    assert (fwd.op, fwd.stage, fwd.mb, fwd.peer, fwd.payload, fwd.batch) == (
        Op.fwd,
        0,
        0,
        None,
        None,
        None,
    )
    fb = next(i for i in ins if i.op == Op.fwd_bwd)
    assert (fb.stage, fb.mb) == (None, None) and fb.fwd.stage == fb.bwd.stage == 1
    assert fb.fwd != fb.bwd and hash(fb.fwd) == hash(Task(fb.fwd.stage, fb.fwd.mb))
    assert str(ins[0]).startswith("recv") and repr(ins[0]).startswith("Instruction(0, {")


def test_wait_steps_complete_in_flight_batches():
    """Every in-flight batch is named by exactly the waits that follow it, and only those."""
    s = pipec.compile("interleaved-1f1b", 4, 8, vpp=2, megatron_p2p="overlap")
    saw_wait = False
    for r in range(s.pp):
        pending = set()
        for st in s.steps(r):
            if isinstance(st, BatchStep) and st.in_flight:
                pending.add(st.id)
            elif isinstance(st, WaitStep):
                saw_wait = True
                assert st.batch in pending
                pending.discard(st.batch)
                assert s.instructions(r)[st.index].op == Op.wait
        assert not pending
    assert saw_wait


def test_rank_out_of_range():
    s = pipec.compile("1f1b", 2, 4)
    for f in (s.instructions, s.steps):
        with pytest.raises(ValueError, match="out of range"):
            f(2)
    with pytest.raises(ValueError, match="out of range"):
        s._n.steps(9)


_CELL = re.compile(r"(\d+)([A-Z_]+?)(\d*)")


def _csv_cell(text: str):
    """One cell of torch's CSV as ``torch_actions`` structures it."""
    if text == "":
        return None
    if text.endswith(")OVERLAP_F_B"):
        f, b = text[1 : -len(")OVERLAP_F_B")].split(";")
        return ["OVERLAP_F_B", _csv_cell(f), _csv_cell(b)]
    m = _CELL.fullmatch(text)
    assert m, text
    return [int(m[1]), m[2], int(m[3]) if m[3] else None]


@pytest.mark.parametrize("compute_only", [False, True])
def test_torch_actions_are_the_cli_csv(tmp_path, compute_only):
    """``torch_actions`` (Python lists made in Rust) says what ``pipec export --format
    torch-csv`` writes, cell by cell."""
    s = pipec.compile("interleaved-1f1b", 2, 4, vpp=2, combined=True)
    s.save(tmp_path / "s")
    args = [_cli(), "export", "--format", "torch-csv", tmp_path / "s"]
    csv = subprocess.run(
        [*args, *(["--compute-only"] if compute_only else [])],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    want = [[_csv_cell(c) for c in line.split(",")] for line in csv.splitlines()]
    got = s.torch_actions(compute_only)
    # Compute-only lines are padded to one length with empty cells; the structured form keeps
    # the idle cells too.
    assert got == want
    assert any(c and c[0] == "OVERLAP_F_B" for line in got for c in line)


def test_buffer_plan_slots():
    """``buffer_plan=True`` is ``--buffer-plan`` (issue #39): every send and receive carries its
    ``slot`` (``Op.slotted_send`` / ``Op.slotted_recv``), each in range of its rank's pool, and
    the instruction records are the rank files' (checked against the CLI's files)."""
    s = pipec.compile("zb-v", 4, 8, buffer_plan=True)
    pools = [0, 0, 0, 0]
    for r in range(4):
        for i in s.instructions(r):
            if i.op.name in ("send", "recv"):
                assert i.op in (Op.slotted_send, Op.slotted_recv)
                pools[r] = max(pools[r], i.slot + 1)
            else:
                assert i.slot is None
    # tests/integration/buffers.rs pins these against a brute-force count.
    assert pools == [2, 4, 4, 3]
    with pytest.raises(pipec.SpecError, match="buffer_plan must be True or False"):
        pipec.compile("zb-v", 4, 8, buffer_plan=1)
