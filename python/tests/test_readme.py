"""The Python the docs show runs: docs/torch.md embeds python/examples/train_pipec.py, which
trains; docs/python.md's API tour and the README's Python example run as written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import launch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "python" / "examples" / "train_pipec.py"


def test_torch_doc_shows_the_example_script():
    doc = (REPO / "docs" / "torch.md").read_text()
    m = re.search(r"<!-- python/examples/train_pipec.py -->\n```python\n(.*?)```", doc, re.DOTALL)
    assert m, "docs/torch.md's training section embeds python/examples/train_pipec.py"
    assert m.group(1) == SCRIPT.read_text()


def test_the_example_script_trains(tmp_path):
    ok, logs = launch.launch(lambda r, port: [sys.executable, str(SCRIPT)], 2, tmp_path, 180)
    assert ok, logs
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", logs)]
    assert len(losses) == 6, logs
    assert losses[-1] < losses[0], logs


def test_python_doc_api_tour_runs(tmp_path, monkeypatch):
    doc = (REPO / "docs" / "python.md").read_text()
    section = doc[doc.index("# Use from Python") :]
    tour = re.search(r"```python\n(import pipec\n\ns = pipec.compile\(.*?)```", section, re.DOTALL)
    assert tour
    monkeypatch.chdir(tmp_path)
    exec(compile(tour.group(1), "docs/python.md", "exec"), {})  # noqa: S102 (the doc's own code)
    assert (tmp_path / "out" / "i1f1b" / "manifest.json").exists()


def test_readme_python_example_runs(capsys):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("**Python**") :]
    example = re.search(r"```python\n(import pipec\n.*?)```", section, re.DOTALL)
    assert example, "the README's tour has a Python example"
    scope: dict = {}
    exec(compile(example.group(1), "README.md", "exec"), scope)  # noqa: S102 (the README's code)
    assert scope["s"].kind == "interleaved-1f1b"
    assert capsys.readouterr().out.startswith("True\n76.0\n")
    assert scope["report"]["runs_on"], scope["report"]
