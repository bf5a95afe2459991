"""``pipec.tune(..., lengths=...)`` (issue #38): the microbatch order it chooses, the lengths the
schedule carries, and its errors; against the schedule's own simulation and the saved files."""

from __future__ import annotations

import json

import pipec
import pytest

COST = "f=1,b=1.2,w=0.8,p2p=0.05"
LENGTHS = [512, 4096, 1024, 8000, 300, 2000]


def test_tune_with_lengths_orders_and_carries_them(tmp_path):
    s, report = pipec.tune(2, None, cost=COST, lengths=LENGTHS)
    order = report["microbatch_order"]
    assert sorted(order) == list(range(len(LENGTHS)))
    assert report["microbatch_order_rule"] in (
        "index",
        "ascending",
        "descending",
        "short-long-short",
    )
    assert all(sorted(c["microbatch_order"]) == list(range(6)) for c in report["candidates"])
    assert s.num_microbatches == len(LENGTHS)
    assert s.check().valid
    # The reported makespan is the schedule's own simulation under the same costs.
    assert s.simulate(COST)["makespan"] == pytest.approx(report["makespan"])
    s.save(tmp_path / "plan")
    manifest = json.loads((tmp_path / "plan" / "manifest.json").read_text())
    assert manifest["microbatch_lengths"] == LENGTHS
    rank0 = json.loads((tmp_path / "plan" / "rank-0.json").read_text())
    sends = [i for i in _records(rank0) if i.get("op") in ("send", "recv")]
    assert sends and all(i["tokens"] == LENGTHS[i["mb"]] for i in sends)


def _records(doc):
    """The instruction records of a rank file, wherever its schema puts the list."""
    if isinstance(doc, list):
        return doc
    for v in doc.values():
        if isinstance(v, list) and v and isinstance(v[0], dict) and "op" in v[0]:
            return v
    return []


def test_list_of_lists_is_the_same_as_ints_when_unpacked():
    _, a = pipec.tune(2, 6, cost=COST, lengths=LENGTHS)
    _, b = pipec.tune(2, 6, cost=COST, lengths=[[x] for x in LENGTHS])
    for key in ("microbatch_order", "makespan", "peak_memory", "candidates", "schedule"):
        assert a[key] == b[key], key
    # Packed lines: several sequences per microbatch.
    s, c = pipec.tune(2, None, cost=COST, lengths=[[100, 200], [4000], [50, 50, 50], [900]])
    assert sorted(c["microbatch_order"]) == [0, 1, 2, 3] and s.check().valid


def test_tune_lengths_errors():
    with pytest.raises(pipec.SpecError, match=r"lengths\[2\]"):
        pipec.tune(2, None, lengths=[10, 20, 0])
    with pytest.raises(pipec.SpecError, match="disagrees"):
        pipec.tune(2, 4, lengths=[10, 20, 30])
    with pytest.raises(pipec.SpecError, match=r"lengths\[1\]"):
        pipec.tune(2, None, lengths=[10, 2.5])
    with pytest.raises(pipec.SpecError):
        pipec.tune(2, None, lengths="10 20")
