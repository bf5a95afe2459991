"""Re-run one of the committed recorders of megatron-core's behaviour
(``tests/golden/megatron/record*.py``) on a subset of its grid, against the installed
megatron-core, for a test to compare with the committed golden lines.

The recorder runs in a child process: it patches torch.distributed and megatron-core for the
whole process (see tests/golden/megatron/record.py), which must not leak into other tests.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "megatron"
RECORD_TIMEOUT = 300  # seconds; a run is ~15 s, mostly importing torch and megatron-core


def rerecord(script: str, subset: str, golden: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Run ``GOLDEN/script --only subset``; return the lines it wrote and the lines of the
    committed ``GOLDEN/golden``, both without their header line, after checking that the run
    used the versions the golden file was recorded with."""
    out = tmp_path / "subset.txt.gz"
    run = subprocess.run(
        [sys.executable, "-B", str(GOLDEN / script), "--only", subset, "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=RECORD_TIMEOUT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = gzip.decompress(out.read_bytes()).decode().splitlines()
    want = gzip.decompress((GOLDEN / golden).read_bytes()).decode().splitlines()
    assert got[0].startswith("# megatron-core 0.19.2 torch 2.15.0"), got[0]
    return got[1:], want[1:]
