"""The partial-recompute golden data (tests/golden/megatron/recompute.txt.gz) is megatron-core's
own decision: re-run its recorder, ``tests/golden/megatron/record_recompute.py``, on a subset of
the grid against the installed megatron-core and compare with the committed lines.

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
# Both schedules, training and forward-only, M below, at and above pp, default and other group
# sizes, both recorded P2P modes, refusals, pp = 1; every N of each.
SUBSET = (
    r"^(1f1b pp=3 vpp=1 m=[1-7] "
    r"|interleaved pp=2 vpp=3 m=[2-5] "
    r"|interleaved pp=4 vpp=2 m=(3|8) "
    r"|nopipe pp=1 vpp=1 m=2 )"
)


def test_peer_versions_are_the_recorded_ones():
    assert megatron_core.__version__.split("+")[0] == "0.19.2", megatron_core.__version__
    assert torch.__version__.split("+")[0] == "2.15.0", torch.__version__


def test_recompute_golden_is_reproduced_by_megatrons_code(tmp_path):
    got, want = rerecord("record_recompute.py", SUBSET, "recompute.txt.gz", tmp_path)
    rx = re.compile(SUBSET)
    want = [line for line in want if rx.search(line.split(" | ")[0].split(" ! ")[0])]
    assert len(want) > 400, len(want)
    assert {line.split()[0] for line in want} == {"1f1b", "interleaved", "nopipe"}
    assert any(" ! " in line for line in want) and any("=1" in line for line in want)
    for g, w in zip(got, want):
        assert g == w, "megatron-core now decides otherwise"
    assert len(got) == len(want)
