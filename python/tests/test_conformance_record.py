"""The conformance data (tests/golden/conformance/) is the peers' own output: its recorder,
``tests/golden/conformance/record.py``, runs megatron-core 0.19.2's layout parser and schedules
and torch 2.15's pipelining schedule classes, and every file it writes must equal the committed
one byte for byte.

The recorder runs in a child process: it patches torch.distributed and megatron-core for the
whole process (see tests/golden/megatron/record.py), which must not leak into other tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
megatron_core = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (test.sh installs it)"
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "conformance"
FILES = [
    "megatron/layouts.json",
    "megatron/interleaved_pp4_vpp2_m8_g4.json",
    "megatron/1f1b_pp4_m8.json",
    "torch/dualpipev_pp2_v2_m4.compute_only.csv",
    "torch/interleaved1f1b_pp2_v2_m2.compute_comms.csv",
    "torch/interleaved1f1b_pp2_v2_m2.compute_only.csv",
]
RECORD_TIMEOUT = 180  # seconds; the run is ~6 s, mostly importing torch and megatron-core


def test_peer_versions_are_the_recorded_ones():
    # Another version may legitimately schedule differently; say so instead of a byte diff.
    assert megatron_core.__version__.split("+")[0] == "0.19.2", megatron_core.__version__
    assert torch.__version__.split("+")[0] == "2.15.0", torch.__version__


def test_every_conformance_file_is_reproduced_by_the_peers_code(tmp_path):
    committed = [p for p in GOLDEN.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sorted(str(p.relative_to(GOLDEN)) for p in committed) == sorted(
        FILES + ["README.md", "record.py"]
    ), "a conformance file is not covered by record.py (or one is missing)"
    run = subprocess.run(
        [sys.executable, "-B", str(GOLDEN / "record.py"), "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for name in FILES:
        want = (GOLDEN / name).read_bytes()
        got = (tmp_path / name).read_bytes()
        assert got == want, f"{name}: the peers' code now writes something else"
