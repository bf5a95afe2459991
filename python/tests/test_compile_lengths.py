"""``pipec.compile(..., lengths=..., microbatch_order=...)`` (issue #38): microbatches of
different lengths from Python. The token count of every send and receive is checked against
the sums of the lengths given here, the files against ``pipec compile --microbatch-lengths``,
and the errors word for word."""

from __future__ import annotations

import subprocess

import pipec
import pytest
from test_api import _cli, _cli_error

PACKED = [[3, 4], [5], [2, 2, 2], [6], [1, 7], [9]]


def _messages(s: pipec.Schedule) -> list[tuple[int, pipec.Instruction]]:
    return [(r, i) for r in range(s.pp) for i in s.instructions(r) if i["op"] in ("send", "recv")]


@pytest.mark.parametrize(
    ("kind", "vpp"), [("1f1b", None), ("interleaved-1f1b", 2), ("zb-v", None), ("gpipe", None)]
)
def test_every_message_carries_its_microbatchs_tokens(kind, vpp):
    s = pipec.compile(kind, 2, lengths=PACKED, vpp=vpp)
    assert s.num_microbatches == len(PACKED)
    assert s.lengths == PACKED
    msgs = _messages(s)
    assert msgs
    for _, ins in msgs:
        assert ins.tokens == sum(PACKED[ins.mb]) == ins["tokens"]
    # Compute instructions carry no tokens.
    assert all(i.tokens is None for i in s.instructions(0) if i["op"] not in ("send", "recv"))


def test_ints_are_one_sequence_each_and_no_lengths_no_tokens():
    s = pipec.compile("1f1b", 2, 3, lengths=[4, 9, 2])
    assert s.lengths == [4, 9, 2]
    assert {(i.mb, i.tokens) for _, i in _messages(s)} == {(0, 4), (1, 9), (2, 2)}
    plain = pipec.compile("1f1b", 2, 3)
    assert plain.lengths is None
    assert all(i.tokens is None and "tokens" not in i for _, i in _messages(plain))


def test_microbatch_order_sets_the_entry_order_and_keeps_the_indices():
    order = [2, 0, 5, 4, 1, 3]
    s = pipec.compile("1f1b", 2, lengths=PACKED, microbatch_order=order)
    assert [i.mb for i in s.instructions(0) if i["op"] == "fwd"] == order
    assert s.lengths == PACKED
    for _, ins in _messages(s):
        assert ins.tokens == sum(PACKED[ins.mb])
    assert s.check().valid


def test_files_match_the_cli(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("".join(" ".join(map(str, row)) + "\n" for row in PACKED))
    subprocess.run(
        [_cli(), "compile", "--schedule", "zb-v", "--pp", "2", "--microbatch-lengths", f]
        + ["-o", tmp_path / "cli"],
        check=True,
        capture_output=True,
    )
    s = pipec.compile("zb-v", 2, lengths=PACKED)
    s.save(tmp_path / "py")
    for name in ("manifest.json", "rank-0.json", "rank-1.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "py" / name).read_bytes()
    assert pipec.load(tmp_path / "py").lengths == PACKED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [3, 0]}, "microbatch lengths, lengths[1]: length 0 is not above 0"),
        ({"lengths": [3, -2]}, "microbatch lengths, lengths[1]: length -2 is not above 0"),
        (
            {"lengths": [[1], []]},
            "microbatch lengths, lengths[1]: empty line: every microbatch needs at least one sequence length",
        ),
        (
            {"lengths": [1, 2, "x"]},
            "microbatch lengths, lengths[2]: `'x'` is not a length in tokens (a whole number above 0)",
        ),
        (
            {"lengths": []},
            "microbatch lengths, input: no microbatches: give one line of sequence lengths per microbatch",
        ),
        (
            {"lengths": [2**32, 1]},
            "microbatch lengths, lengths[0]: the microbatch holds 4294967296 tokens, more than 4294967295",
        ),
        (
            {"microbatches": 3, "lengths": [1, 2]},
            "the microbatch lengths give 2 microbatches, but 3 were asked for (one line of lengths per microbatch)",
        ),
        (
            {"lengths": [1, 2], "microbatch_order": [0, -1]},
            "microbatch order [0, -1]: not a permutation of 0..2 (-1 is out of range)",
        ),
        (
            {"lengths": [1, 2], "microbatch_order": [1, 1]},
            "microbatch order [1, 1]: not a permutation of 0..2 (1 appears twice)",
        ),
        (
            {"lengths": [1, 2], "microbatch_order": [0]},
            "microbatch order [0]: not a permutation of 0..2 (1 entries)",
        ),
        ({}, "microbatches must be an integer (or give lengths=), not None"),
    ],
)
def test_bad_lengths_are_refused_in_the_compilers_words(kwargs, message):
    with pytest.raises(pipec.SpecError) as e:
        pipec.compile("1f1b", 2, **kwargs)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)


def test_a_bad_line_is_refused_as_the_cli_refuses_it(tmp_path):
    """The same error, named by list index here and by line in the CLI."""
    f = tmp_path / "lengths.txt"
    f.write_text("3\n0\n")
    code, msg = _cli_error(
        _cli(),
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatch-lengths",
        f,
        "-o",
        tmp_path / "out",
    )
    with pytest.raises(pipec.SpecError) as e:
        pipec.compile("1f1b", 2, lengths=[3, 0])
    assert code == 1
    assert msg == f"{f}: " + str(e.value).replace("lengths[1]", "line 2")
