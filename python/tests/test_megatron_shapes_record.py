"""Megatron's recorded handshake (tests/golden/megatron/shapes.txt.gz) is megatron-core's own: re-run
its recorder, ``tests/golden/megatron/record_shapes.py``, on a subset of the grid against the
installed megatron-core and compare with the committed lines.

The recorder runs in a child process: it patches torch.distributed and megatron-core for the
whole process (see tests/golden/megatron/record.py), which must not leak into other tests.
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
megatron_core = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (test.sh installs it)"
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "megatron"
# pp = 2 (crossed shapes, the flush modes' hang), pp = 4 at M = pp (the rendezvous hang) in
# every mode, and 1F1B at an odd pp, training and forward-only.
SUBSET = r"^(interleaved pp=2 vpp=2 m=4 g=2 |interleaved pp=4 vpp=2 m=4 |1f1b pp=3 vpp=1 m=4 )"
RECORD_TIMEOUT = 300  # seconds; the run is ~15 s, mostly importing torch and megatron-core


def test_shapes_golden_is_reproduced_by_megatrons_code(tmp_path):
    out = tmp_path / "subset.txt.gz"
    run = subprocess.run(
        [
            sys.executable,
            "-B",
            str(GOLDEN / "record_shapes.py"),
            "--only",
            SUBSET,
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = gzip.decompress(out.read_bytes()).decode().splitlines()
    want = gzip.decompress((GOLDEN / "shapes.txt.gz").read_bytes()).decode().splitlines()
    assert got[0].startswith("# megatron-core 0.19.2 torch 2.15.0"), got[0]
    rx = re.compile(SUBSET)
    want = [line for line in want[1:] if rx.search(line.split(" | ")[0].split(" ! ")[0])]
    assert len(want) >= 30, len(want)
    assert {line.split()[0] for line in want} == {"1f1b", "interleaved"}
    assert all(":S" in line and " S " in line for line in want)
    assert got[1:] == want, "megatron-core now exchanges shapes otherwise"
