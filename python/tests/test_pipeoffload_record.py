"""PipeOffload's scheduler, recorded (tests/golden/pipeoffload/): the vendored copy of their code
is the commit the golden file names, byte for byte, and re-running the recorder on it
reproduces a few cases and the reference figures exactly (the whole grid takes minutes:
`python bench/pipeoffload_record.py tests/golden/pipeoffload/upstream`).

Needs only the standard library: their scheduler is pure Python.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "pipeoffload"
UPSTREAM = GOLDEN / "upstream"
RECORDER = ROOT / "bench" / "pipeoffload_record.py"
CASES = ["pp4-m8-uniform-c1", "pp4-m8-heavy-c3", "pp4-m16-uniform-c0.25"]
TIMEOUT = 300  # seconds; about 10 s


def golden():
    with open(GOLDEN / "pipeoffload.json") as f:
        return json.load(f)


def test_vendored_files_are_their_blobs_at_the_recorded_commit():
    lines = (UPSTREAM / "COMMIT").read_text().splitlines()
    commit = lines[0].split()[0]
    assert commit == golden()["commit"] == golden()["expected_commit"]
    blobs = [ln.split() for ln in lines[1:] if ln and not ln.startswith("#")]
    assert len(blobs) == 9
    for blob, path in blobs:
        data = (UPSTREAM / Path(path).name).read_bytes()
        got = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert got == blob, f"{path} differs from their commit"


def test_recorder_reproduces_cases_and_reference():
    run = subprocess.run(
        [sys.executable, "-B", str(RECORDER), str(UPSTREAM), "--reference", "--cases", *CASES],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    want = golden()
    assert sorted(got["cases"]) == sorted(CASES)
    for cid in CASES:
        assert got["cases"][cid] == want["cases"][cid], (
            f"{cid}: their code now gives another result"
        )
    for key, other in got["other_schedules"].items():
        assert other == want["other_schedules"][key], key
    assert got["reference"] == want["reference"]


def test_reference_figures_are_the_issues():
    ref = golden()["reference"]
    for name, fig in ref.items():
        if name == "copy_violations":
            assert fig == []
            continue
        assert abs(fig["makespan"] - fig["issue"]["makespan"]) < 0.01, name
        assert abs(fig["peak_x_1f1b"] - fig["issue"]["peak_x_1f1b"]) < 1e-3, name


def test_every_best_fits_its_limit_and_is_the_fastest_that_does():
    for cid, case in golden()["cases"].items():
        for lim, limit in case["limits"].items():
            fits = [
                c["makespan"]
                for c in case["configs"].values()
                if "error" not in c and c["peak"] <= limit + 1e-9
            ]
            best = case["best"][lim]
            if not fits:
                assert best is None, (cid, lim)
                continue
            assert best["makespan"] == min(fits), (cid, lim)
            assert best["peak"] <= limit + 1e-9, (cid, lim)
            assert best["config"] in case["plans"], (cid, lim)
        for name, c in case["configs"].items():
            assert c.get("copy_violations", []) == [], (cid, name)


def test_orders_recorder_reproduces_the_golden_orders():
    """`orders.json.gz` (what tests/integration/group_interleaved.rs holds pipec's
    group-interleaved to) is their scheduler's output: re-recorded whole (about 10 s)."""
    import gzip

    run = subprocess.run(
        [sys.executable, "-B", str(ROOT / "bench" / "pipeoffload_orders_record.py"), str(UPSTREAM)],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    want = gzip.decompress((GOLDEN / "orders.json.gz").read_bytes()).decode()
    assert run.stdout == want
