"""#27: typed instruction records and steps from Rust. ``Schedule.steps(rank)`` is checked
against an independent cut of the rank file ``Schedule.save`` writes (the CLI's writer):
maximal runs of consecutive sends and receives with one batch id, every other instruction
alone."""

import json

import pipec
import pytest


def _cut(records: list[dict]) -> list[tuple]:
    out, i = [], 0
    while i < len(records):
        op = records[i]["op"]
        if op in ("send", "recv"):
            b, j = records[i]["batch"], i
            while (
                j < len(records)
                and records[j]["op"] in ("send", "recv")
                and records[j]["batch"] == b
            ):
                j += 1
            out.append(("batch", i, b, records[i:j]))
            i = j
        else:
            out.append(
                (op == "wait" and "wait" or "compute", i, records[i].get("batch"), [records[i]])
            )
            i += 1
    return out


@pytest.mark.parametrize(
    "args",
    [
        ("interleaved-1f1b", 4, 8, {"vpp": 2, "megatron_p2p": "overlap"}),
        ("1f1b", 3, 6, {"megatron_p2p": "unbatched"}),
        ("zb-v", 3, 6, {}),
        ("dualpipe", 4, 8, {}),
    ],
)
def test_steps_and_records_equal_the_rank_files(tmp_path, args):
    kind, pp, m, kw = args
    s = pipec.compile(kind, pp, m, **kw)
    s.save(tmp_path / "d")
    for r in range(pp):
        records = json.loads((tmp_path / "d" / f"rank-{r}.json").read_text())["instructions"]
        ins = s.instructions(r)
        assert ins == records
        assert [dict(i) for i in ins] == records
        assert [i.to_dict() for i in ins] == records
        got = [(st.kind, st.index, st.batch, [o.to_dict() for o in st.ops]) for st in s.steps(r)]
        assert got == _cut(records)


def test_a_record_reads_as_its_fields():
    s = pipec.compile("1f1b", 2, 2)
    send = next(i for i in s.instructions(0) if i.op == "send")
    assert (send.peer, send.payload, send.stage, send.mb) == (1, "act", 0, 0)
    assert send.keys() == ["op", "peer", "payload", "stage", "mb", "batch"]
    assert "batch" in send and "nope" not in send and len(send) == 6
    assert send.get("nope", 7) == 7
    fwd = s.instructions(0)[0]
    with pytest.raises(KeyError):
        fwd["peer"]
    with pytest.raises(AttributeError, match="a `fwd` instruction has no field `peer`"):
        fwd.peer  # noqa: B018
    assert repr(fwd) == 'Instruction(op="fwd", stage=0, mb=0)'
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        s.steps(2)
