"""The README's "Use from Python" script is python/examples/train_pipec.py, and it trains."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import launch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "python" / "examples" / "train_pipec.py"


def test_readme_shows_the_example_script():
    readme = (REPO / "README.md").read_text()
    m = re.search(
        r"<!-- python/examples/train_pipec.py -->\n```python\n(.*?)```", readme, re.DOTALL
    )
    assert m, "the README's Use from Python section embeds python/examples/train_pipec.py"
    assert m.group(1) == SCRIPT.read_text()


def test_the_example_script_trains(tmp_path):
    ok, logs = launch.launch(lambda r, port: [sys.executable, str(SCRIPT)], 2, tmp_path, 180)
    assert ok, logs
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", logs)]
    assert len(losses) == 6, logs
    assert losses[-1] < losses[0], logs


def test_readme_api_tour_runs(tmp_path, monkeypatch):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use from Python") :]
    tour = re.search(r"```python\n(import pipec\n\ns = pipec.compile\(.*?)```", section, re.DOTALL)
    assert tour
    monkeypatch.chdir(tmp_path)
    exec(compile(tour.group(1), "README.md", "exec"), {})  # noqa: S102 (the README's own code)
    assert (tmp_path / "out" / "i1f1b" / "manifest.json").exists()
