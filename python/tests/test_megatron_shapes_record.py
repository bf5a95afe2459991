"""Megatron's recorded handshake (tests/golden/megatron/shapes.txt.gz) is megatron-core's own: re-run
its recorder, ``tests/golden/megatron/record_shapes.py``, on a subset of the grid against the
installed megatron-core and compare with the committed lines.

The recorder runs in a child process: it patches torch.distributed and megatron-core for the
whole process (see tests/golden/megatron/record.py), which must not leak into other tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from golden_record import rerecord

torch = pytest.importorskip("torch")
megatron_core = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (test.sh installs it)"
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "megatron"
# pp = 2 (crossed shapes, the flush modes' hang), pp = 4 at M = pp (the rendezvous hang) in
# every mode, and 1F1B at an odd pp, training and forward-only.
SUBSET = r"^(interleaved pp=2 vpp=2 m=4 g=2 |interleaved pp=4 vpp=2 m=4 |1f1b pp=3 vpp=1 m=4 )"


def test_shapes_golden_is_reproduced_by_megatrons_code(tmp_path):
    got, want = rerecord("record_shapes.py", SUBSET, "shapes.txt.gz", tmp_path)
    rx = re.compile(SUBSET)
    want = [line for line in want if rx.search(line.split(" | ")[0].split(" ! ")[0])]
    assert len(want) >= 30, len(want)
    assert {line.split()[0] for line in want} == {"1f1b", "interleaved"}
    assert all(":S" in line and " S " in line for line in want)
    assert got == want, "megatron-core now exchanges shapes otherwise"
