"""``pipec.tune``'s host memory (``host_peak_memory``, ``host_memory_limit=``) and, without a
target, ``per_target`` (issue #40 points 2 and 11), against the CLI's ``--json`` and against
``pipec.tune`` called with each target on its own."""

from __future__ import annotations

import json
import os
import subprocess

import pipec
import pytest

U = 1 / 12
# PipeOffload's units: 12 layers a rank, one forward of a rank = 1, a rank's activations = 1.
UNITS = f"t.f={U},t.b={U},t.w={U},t.act={U}"
CASE = {"num_layers": 48, "cost": UNITS, "memory_limit": 2}


def test_host_peak_and_limit():
    _, r = pipec.tune(4, 8, target="torch", **CASE)
    host = r["host_peak_memory"]
    assert len(host) == 4 and max(host) > 0, r["schedule"]
    assert "assumed" in r["copy_speed"]
    # Half the host memory: within it, never faster.
    _, r = pipec.tune(4, 8, target="torch", host_memory_limit=max(host) / 2, **CASE)
    assert max(r["host_peak_memory"]) <= max(host) / 2 + 1e-9
    assert r["makespan"] >= pipec.tune(4, 8, target="torch", **CASE)[1]["makespan"] - 1e-9
    _, r = pipec.tune(4, 8, target="torch", host_memory_limit=0, **CASE)
    assert r["host_peak_memory"] == [0, 0, 0, 0]
    assert "copy_speed" not in r


@pytest.mark.parametrize(
    "bad, words",
    [
        ("3GiB", "host_memory_limit: the memory limit 3.00GiB is in bytes"),
        (True, "host_memory_limit must be a size or a number"),
        ("40G", "host_memory_limit: `40G` has an ambiguous unit"),
    ],
)
def test_host_limit_refused_as_the_cli(bad, words):
    with pytest.raises(pipec.SpecError, match=words.replace("(", r"\(")):
        pipec.tune(4, 8, target="torch", host_memory_limit=bad, **CASE)


def test_per_target_is_each_targets_own_tune():
    _, common = pipec.tune(4, 8, **CASE)
    per = common["per_target"]
    assert set(per) == {"megatron", "torch", "torchtitan", "deepspeed", "pipec-run"}
    for name, p in per.items():
        _, own = pipec.tune(4, 8, target=name, **CASE)
        assert p["makespan"] == own["makespan"], name
        assert p["peak_memory"] == own["peak_memory"], name
        assert p["host_peak_memory"] == own["host_peak_memory"], name
        assert p["gives_up"] == pytest.approx(common["makespan"] / own["makespan"] - 1), name
    assert per["torch"]["makespan"] < common["makespan"]
    assert "+ offload" in per["torch"]["schedule"]
    # With a target: none.
    assert "per_target" not in pipec.tune(4, 8, target="torch", **CASE)[1]


def test_cli_json_agrees():
    built = os.path.join(os.path.dirname(__file__), "..", "..", "target", "debug", "pipec")
    exe = os.environ.get("PIPEC_BIN") or (built if os.path.exists(built) else None)
    if not exe:
        pytest.skip("no pipec binary (set PIPEC_BIN, or cargo build)")
    args = ["tune", "--pp", "4", "--microbatches", "8", "--num-layers", "48", "--cost", UNITS]
    args += ["--memory-limit", "2", "--target", "torch", "--json"]
    cli = json.loads(subprocess.run([exe, *args], capture_output=True, check=True).stdout)
    _, r = pipec.tune(4, 8, target="torch", **CASE)
    assert cli["host_peak_memory"] == r["host_peak_memory"]
