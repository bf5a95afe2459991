"""The Python API: compile, load, Schedule, and every documented error (no torch needed except
where marked)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pipec
import pytest
from pipec import _native

REPO = Path(__file__).resolve().parents[2]
_BIN = REPO / "target" / "debug"


@functools.cache
def _built() -> Path:
    """The CLI binaries, built fresh from this checkout (``cargo build``), so a test never
    compares with a stale ``pipec``. Without cargo the tests that need them skip, except under
    CI=true, where that fails."""
    try:
        subprocess.run(
            ["cargo", "build", "--quiet", "-p", "pipec-cli", "--bins"],
            cwd=REPO,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"cannot build the CLI ({e})")
    return _BIN


def _cli(name: str = "pipec") -> Path:
    return _built() / name


def test_compile_and_inspect():
    s = pipec.compile("1f1b", 4, 8)
    assert (s.pp, s.num_stages, s.num_microbatches, s.kind) == (4, 4, 8, "1f1b")
    assert s.stage_to_rank == [0, 1, 2, 3]
    assert s.placement == "looped"
    r = s.check()
    assert r.valid and r.violations == [] and len(r.peak_activations) == 4
    assert r.peak_activations == [4, 3, 2, 1]
    assert "verified" in r.verdict
    ins = s.instructions(0)
    assert ins[0] == {"op": "fwd", "stage": 0, "mb": 0}
    assert {i["op"] for i in ins} == {"fwd", "bwd", "send", "recv"}


def test_placements():
    v = pipec.compile("zb-v", 3, 6)
    assert v.stage_to_rank == [0, 1, 2, 2, 1, 0]
    assert v.stages_of(0) == [0, 5] and v.stages_of(2) == [2, 3]
    loop = pipec.compile("interleaved-1f1b", 2, 4, vpp=2)
    assert loop.stage_to_rank == [0, 1, 0, 1]
    assert "interleaved-1f1b" in repr(loop)


def test_layout_error_has_the_caret():
    with pytest.raises(pipec.LayoutError) as e:
        pipec.compile("1f1b", 2, 4, layout="Ett|tX|tL")
    msg = str(e.value)
    assert "^" in msg and "Ett|tX|tL" in msg, msg
    assert isinstance(e.value, pipec.PipecError) and isinstance(e.value, ValueError)


def test_layout_is_used():
    s = pipec.compile("1f1b", 2, 4, layout="Ett|ttL")
    assert s.num_stages == 2


def test_spec_errors():
    with pytest.raises(pipec.SpecError, match="unknown"):
        pipec.compile("zigzag", 2, 4)
    with pytest.raises(pipec.SpecError):
        pipec.compile("1f1b", 0, 4)
    with pytest.raises(pipec.SpecError, match="combined"):
        pipec.compile("gpipe", 2, 4, combined=True)
    with pytest.raises(pipec.SpecError, match="megatron_p2p"):
        pipec.compile("1f1b", 2, 4, megatron_p2p="sideways")
    for cls in (pipec.SpecError, pipec.LayoutError, pipec.InvalidSchedule, pipec.FileError):
        assert issubclass(cls, pipec.PipecError) and issubclass(cls, ValueError)


def test_megatron_p2p_modes():
    for mode in ("batched", "unbatched", "overlap", "overlap-flush"):
        s = pipec.compile("interleaved-1f1b", 4, 8, vpp=2, megatron_p2p=mode)
        assert s.check().valid
    waits = [
        i
        for i in pipec.compile(
            "interleaved-1f1b", 4, 8, vpp=2, megatron_p2p="overlap"
        ).instructions(1)
        if i["op"] == "wait"
    ]
    assert waits, "overlap mode leaves batches in flight and waits for them"


def test_megatron_variable_seq_lengths_models_the_handshake():
    """``megatron_variable_seq_lengths=True`` is ``--megatron-variable-seq-lengths``: Megatron's
    shape messages before every call; where they cross (interleaving at pp = 2, unbatched:
    Megatron-LM #5271) compile raises with the verifier's words."""
    s = pipec.compile("1f1b", 4, 8, megatron_variable_seq_lengths=True)
    shapes = [i for i in s.instructions(1) if i["op"] in ("send", "recv")]
    assert {i["payload"] for i in shapes} == {"act", "grad", "act_shape", "grad_shape"}
    # Each data message follows its own shape message.
    first = shapes[0]
    assert first["payload"] == "act_shape" and shapes[1]["payload"] == "act"
    assert pipec.compile("1f1b", 4, 8).instructions(1) != s.instructions(1)
    # A model of Megatron's handshake, not a schedule to execute: no steps for the executors.
    with pytest.raises(pipec.SpecError, match="one of Megatron's shape messages"):
        s.steps(1)
    with pytest.raises(pipec.InvalidSchedule) as e:
        pipec.compile(
            "interleaved-1f1b",
            2,
            4,
            vpp=2,
            megatron_p2p="unbatched",
            megatron_variable_seq_lengths=True,
        )
    assert any("shape of act" in v and "shape of grad" in v for v in e.value.violations)
    with pytest.raises(pipec.SpecError, match="only Megatron's own schedules"):
        pipec.compile("zb-v", 2, 4, megatron_variable_seq_lengths=True)
    with pytest.raises(pipec.SpecError, match="True or False"):
        pipec.compile("1f1b", 2, 4, megatron_variable_seq_lengths=1)


def test_invalid_schedule_lists_violations():
    with pytest.raises(pipec.InvalidSchedule) as e:
        pipec.compile("gpipe", 2, 8, memory_limit=2)
    assert e.value.violations, "violations in words"
    assert all(isinstance(v, str) for v in e.value.violations)
    assert any("memory" in v or "activation" in v for v in e.value.violations), e.value.violations
    assert "gpipe" in str(e.value)
    # check() reports the same without raising.
    r = pipec.compile("gpipe", 2, 8).check(memory_limit=2)
    assert not r.valid and r.violations


@pytest.mark.parametrize("fmt", ["json", "bin"])
def test_save_and_load(tmp_path, fmt):
    s = pipec.compile("zb-v", 2, 4)
    s.save(tmp_path / "s", format=fmt)
    ext = "json" if fmt == "json" else "bin"
    assert (tmp_path / "s" / "manifest.json").exists()
    assert (tmp_path / "s" / f"rank-1.{ext}").exists()
    t = pipec.load(tmp_path / "s")
    assert (t.kind, t.pp, t.num_stages, t.stage_to_rank) == ("zb-v", 2, 4, s.stage_to_rank)
    for r in range(2):
        assert t.instructions(r) == s.instructions(r)
    assert t.to_torch_csv() == s.to_torch_csv()
    assert pipec.load(str(tmp_path / "s"), world_size=2).pp == 2


def test_load_refuses_a_tampered_directory(tmp_path):
    d = tmp_path / "s"
    pipec.compile("1f1b", 2, 4).save(d)
    f = d / "rank-1.json"
    text = f.read_text()
    assert '"mb":3' in text
    f.write_text(text.replace('"mb":3', '"mb":2', 1))
    with pytest.raises(pipec.FileError) as e:
        pipec.load(d)
    assert "rank-1.json" in str(e.value) and "hash" in str(e.value), str(e.value)


def test_load_refuses_damaged_and_missing_files(tmp_path):
    d = tmp_path / "s"
    pipec.compile("1f1b", 2, 4).save(d)
    (d / "manifest.json").write_text("{ not json")
    with pytest.raises(pipec.FileError, match="manifest.json"):
        pipec.load(d)
    # A missing directory is named as given, not as the manifest inside it.
    with pytest.raises(pipec.FileError, match="nothing-here: "):
        pipec.load(tmp_path / "nothing-here")
    e = tmp_path / "e"
    pipec.compile("1f1b", 2, 4).save(e)
    os.remove(e / "rank-0.json")
    with pytest.raises(pipec.FileError, match="rank-0.json"):
        pipec.load(e)


def _cli_error(*args) -> tuple[int, str]:
    """Exit code and message (without ``error: ``) of a failing CLI call."""
    p = subprocess.run([str(a) for a in args], check=False, capture_output=True, text=True)
    lines = [l for l in p.stderr.splitlines() if l.startswith("error: ")]
    assert p.returncode != 0 and lines, p.stderr
    return p.returncode, lines[-1][len("error: ") :]


def test_load_csv_says_import_it(tmp_path):
    """``pipec.load`` refuses a file as ``pipec-run`` does, with the same message: a torch
    CSV is imported first, one of pipec's own files names its directory."""
    csv = tmp_path / "x.csv"
    csv.write_text("0F0,0B0\n")
    with pytest.raises(pipec.FileError) as e:
        pipec.load(csv)
    assert f"`pipec import {csv} -o DIR`" in str(e.value), str(e.value)
    code, msg = _cli_error(_cli("pipec-run"), csv)
    assert (code, msg) == (2, str(e.value))
    d = tmp_path / "s"
    pipec.compile("zb-v", 2, 4).save(d)
    for name, what in (("manifest.json", "the manifest"), ("rank-1.json", "rank 1's instructions")):
        with pytest.raises(pipec.FileError) as e:
            pipec.load(d / name)
        want = f"{d / name}: this is a pipec instruction file ({what}), not a schedule directory: pass its directory, {d}"
        assert str(e.value) == want
        assert _cli_error(_cli("pipec-run"), d / name) == (2, want)
        assert _cli_error(_cli(), "check", d / name) == (2, want)


def test_seal_then_load_judges_content(tmp_path):
    d = tmp_path / "s"
    pipec.compile("1f1b", 2, 4).save(d)
    assert pipec.seal(d) == {"ranks": 2, "instructions": 32, "changed": [], "unchanged": True}
    f = d / "rank-1.json"
    text = f.read_text()
    assert text.count('{"op":"bwd","stage":1,"mb":3}') == 1
    # Rank 1 runs the backward of microbatch 2 twice and never that of microbatch 3.
    f.write_text(text.replace('{"op":"bwd","stage":1,"mb":3}', '{"op":"bwd","stage":1,"mb":2}'))
    with pytest.raises(pipec.FileError, match="pipec seal"):
        pipec.load(d)
    assert pipec.seal(d) == {
        "ranks": 2,
        "instructions": 32,
        "changed": ["rank-1.json"],
        "unchanged": False,
    }
    assert json.loads((d / "manifest.json").read_text())["sealed_by"] == "pipec seal"
    with pytest.raises(pipec.InvalidSchedule) as e:
        pipec.load(d)
    v = e.value.violations
    assert any(x.startswith("[incomplete] rank 1, #") and "bwd(stage 1, mb 2)" in x for x in v), v
    assert any("bwd(stage 1, mb 3) never runs" in x for x in v), v
    # A malformed file: the CLI's message, nothing written.
    f.write_text(f.read_text().replace('"op":"fwd"', '"op":"fwdd"', 1))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(pipec.FileError) as e:
        pipec.seal(d)
    assert "rank-1.json: not a valid pipec file: unknown variant `fwdd`" in str(e.value)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert _cli_error(_cli(), "seal", d) == (2, str(e.value))


def test_load_refuses_a_world_size_that_does_not_match(tmp_path):
    pipec.compile("1f1b", 2, 4).save(tmp_path / "s")
    with pytest.raises(pipec.FileError) as e:
        pipec.load(tmp_path / "s", world_size=4)
    assert "world_size" in str(e.value) and "2 ranks" in str(e.value), str(e.value)


def test_save_refuses_to_replace_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(pipec.FileError, match="notes.txt"):
        pipec.compile("1f1b", 2, 4).save(tmp_path)


def test_torch_csv_both_forms():
    s = pipec.compile("1f1b", 2, 2)
    assert s.to_torch_csv(compute_only=True) == "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"
    comms = s.to_torch_csv().splitlines()
    assert len(comms) == 2 and "0SEND_F0" in comms[0] and "1RECV_F0" in comms[1]
    acts = s.torch_actions()
    assert acts[0][0] == [0, "UNSHARD", None]
    assert [0, "F", 0] in acts[0]
    combined = pipec.compile("1f1b", 2, 4, combined=True)
    assert any(c[0] == "OVERLAP_F_B" for line in combined.torch_actions() for c in line)


def test_dualpipe_is_refused_for_torch():
    s = pipec.compile("dualpipe", 2, 4)
    with pytest.raises(pipec.TorchExportError, match="bidirectional"):
        s.to_torch_csv()


def test_simulate_matches_the_cli(tmp_path):
    s = pipec.compile("zb-1p", 4, 8)
    sim = s.simulate()
    assert sim["schedule"] == "zb-1p pp=4 vpp=1 microbatches=8"
    assert sim["makespan"] > 0 and len(sim["ranks"]) == 4
    assert s.simulate("f=1,b=2,w=1")["makespan"] > sim["makespan"]
    with pytest.raises(pipec.SpecError):
        s.simulate("f=banana")
    s.save(tmp_path / "s")
    out = subprocess.run(
        [_cli(), "simulate", tmp_path / "s", "--json", "--cost", "f=1,b=2,w=1"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(out) == s.simulate("f=1,b=2,w=1")


def test_compile_matches_the_cli(tmp_path):
    subprocess.run(
        [
            _cli(),
            "compile",
            "--schedule",
            "interleaved-1f1b",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--microbatches",
            "4",
            "-o",
            tmp_path / "cli",
        ],
        check=True,
        capture_output=True,
    )
    pipec.compile("interleaved-1f1b", 2, 4, vpp=2).save(tmp_path / "py")
    for name in ("manifest.json", "rank-0.json", "rank-1.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "py" / name).read_bytes()


def test_import_pipec_needs_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pipec\n"
        "assert pipec.compile('1f1b', 2, 2).check().valid\n"
        "try:\n"
        "    import pipec.torch\n"
        "except ImportError:\n"
        "    print('torch only for pipec.torch')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "torch only for pipec.torch" in out.stdout


def test_kinds():
    assert {"gpipe", "1f1b", "zb-v", "dualpipe-v"} <= set(pipec.kinds())


# --- pipec.torch without a process group: what build_schedule refuses before running ---


def fake_stages(indices, num_stages, group_size, rank=0):
    return [
        types.SimpleNamespace(
            stage_index=i, num_stages=num_stages, group_size=group_size, group_rank=rank
        )
        for i in indices
    ]


def test_build_schedule_refusals(tmp_path):
    pt = pytest.importorskip("pipec.torch")
    s = pipec.compile("zb-v", 2, 4)
    assert pt.stage_indices(s, 0) == [0, 3] and pt.stage_indices(s, 1) == [1, 2]

    def loss(a, b):
        return a.sum()

    with pytest.raises(pipec.PipecError, match="world size mismatch.*pp=2.*4 ranks"):
        pt.build_schedule(s, fake_stages([0, 3], 4, group_size=4), loss)
    with pytest.raises(pipec.PipecError, match=r"must build stages \[0, 3\]"):
        pt.build_schedule(s, fake_stages([0, 1], 4, group_size=2), loss)
    with pytest.raises(pipec.PipecError, match="n_microbatches=8"):
        pt.build_schedule(s, fake_stages([0, 3], 4, group_size=2), loss, n_microbatches=8)
    with pytest.raises(pipec.PipecError, match="6 stages"):
        pt.build_schedule(s, fake_stages([0, 3], 6, group_size=2), loss)
    with pytest.raises(pipec.PipecError, match="loss_fn"):
        pt.build_schedule(s, fake_stages([0, 3], 4, group_size=2), None)
    with pytest.raises(pipec.TorchExportError, match="dualpipe-v"):
        pt.stage_indices(pipec.compile("dualpipe", 2, 4), 0)
    # A path is loaded with load()'s checks.
    s.save(tmp_path / "s")
    shutil.copy(tmp_path / "s" / "rank-0.json", tmp_path / "s" / "rank-1.json")
    with pytest.raises(pipec.FileError, match="rank-1.json"):
        pt.build_schedule(tmp_path / "s", fake_stages([0, 3], 4, group_size=2), loss)


def forwards_out_of_order(tmp_path) -> pipec.Schedule:
    """gpipe on one rank with its two forwards swapped (sealed, loaded: it verifies): the one
    stage, the last, runs microbatch 1's forward before microbatch 0's."""
    d = tmp_path / "swapped"
    pipec.compile("gpipe", 1, 2).save(d)
    f0, f1 = '{"op":"fwd","stage":0,"mb":0}', '{"op":"fwd","stage":0,"mb":1}'
    text = (d / "rank-0.json").read_text()
    assert f"{f0},\n    {f1}" in text, text
    (d / "rank-0.json").write_text(text.replace(f0, "F0").replace(f1, f0).replace("F0", f1))
    pipec.seal(d)
    s = pipec.load(d)
    assert [(i.op.name, i.mb) for i in s.instructions(0)[:2]] == [("fwd", 1), ("fwd", 0)]
    return s


def test_adapters_refuse_by_the_rust_rule(tmp_path):
    """#41: pipec.torch refuses what ``Schedule.refusal("torch")`` (the rule ``pipec tune
    --target torch`` filters by) refuses, in its own words. A last stage that runs its forwards
    out of microbatch order is no longer among them (#38: pipec.torch renumbers the
    microbatches for torch, whose loss list follows the last stage's forwards); torchtitan,
    which runs the plan's ids on torch's runtime as they are, still refuses it."""
    pt = pytest.importorskip("pipec.torch")
    s = forwards_out_of_order(tmp_path)
    assert s.refusal("torch") is None
    assert "out of microbatch order (0 after 1)" in s.refusal("torchtitan")
    assert "pipec.torch renumbers them; torchtitan does not" in s.refusal("torchtitan")
    assert s.refusal("pipec-run") is None
    assert pt.stage_indices(s, 0) == [0]  # the placement is fine
    # torch's microbatch k is the user's microbatch 1 - k.
    assert pt._torch_order(pt.actions(s, compute_only=True), 0) == [1, 0]
    with pytest.raises(pipec.TorchExportError) as e:
        pt.stage_indices(pipec.compile("dualpipe", 2, 4), 0)
    assert str(e.value) == (
        "dualpipe places each stage on two ranks (one per direction); torch's pipeline runtime "
        "gives every stage exactly one rank and cannot run it (use dualpipe-v, its V-shaped form)"
    )


def test_torch_actions_are_torch_actions():
    pt = pytest.importorskip("pipec.torch")
    from torch.distributed.pipelining import schedules as ts

    acts = pt.actions(pipec.compile("interleaved-1f1b", 2, 4, vpp=2, combined=True))
    flat = [a for line in acts.values() for a in line]
    assert all(isinstance(a, ts._Action) for a in flat)
    overlap = [a for a in flat if a.computation_type == ts._ComputationType.OVERLAP_F_B]
    assert overlap and all(len(a.sub_actions) == 2 for a in overlap)
    # Exactly what torch's own parser makes of the CSV pipec writes.
    csv = pipec.compile("interleaved-1f1b", 2, 4, vpp=2, combined=True).to_torch_csv()
    for r, line in enumerate(csv.splitlines()):
        assert [ts._Action.from_str(c) for c in line.split(",")] == acts[r]


def test_eval_and_step_refusals():
    pt = pytest.importorskip("pipec.torch")
    train = pt.build_schedule(
        pipec.compile("1f1b", 2, 4), fake_stages([0], 2, group_size=2), lambda a, b: a.sum()
    )
    with pytest.raises(pipec.PipecError, match="forward_only=True"):
        train.eval()
    infer = pt.build_schedule(
        pipec.compile("1f1b", 2, 4, forward_only=True),
        fake_stages([0], 2, group_size=2),
        lambda a, b: a.sum(),
    )
    with pytest.raises(pipec.PipecError, match="forward-only"):
        infer.step()


def test_exception_names():
    assert pipec.PipecError.__module__ == "pipec"
    assert pipec.InvalidSchedule.__name__ == "InvalidSchedule"


UNEVEN = "t.f=1,t.b=1.5,t.w=0.7,E.f=2,E.b=2,E.w=1,L.f=3,L.b=3,L.w=1"


def test_tune_matches_the_cli(tmp_path):
    s, report = pipec.tune(4, 16, num_layers=8, cost=UNEVEN)
    assert s.pp == 4 and s.num_microbatches == 16
    assert report["makespan"] >= report["lower_bound"] * (1 - 1e-9) > 0
    assert len(report["peak_memory"]) == 4 and report["candidates"]
    assert s.check().valid
    # The schedule simulates to the reported makespan under the same costs.
    assert s.simulate(UNEVEN)["makespan"] == pytest.approx(report["makespan"])
    out = subprocess.run(
        [_cli(), "tune", "--pp", "4", "--microbatches", "16", "--num-layers", "8"]
        + ["--cost", UNEVEN, "--json", "-o", tmp_path / "cli"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    cli = json.loads(out)
    for key in ("schedule", "layout", "makespan", "lower_bound", "peak_memory", "candidates"):
        assert cli[key] == report[key], key
    s.save(tmp_path / "py")
    for f in sorted(os.listdir(tmp_path / "cli")):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "py" / f).read_bytes(), f


def test_tune_errors():
    with pytest.raises(pipec.SpecError, match="smallest peak memory"):
        pipec.tune(4, 16, num_layers=8, memory_limit=1)
    with pytest.raises(pipec.SpecError):
        pipec.tune(4, 16, cost="f=banana")
    with pytest.raises(pipec.LayoutError):
        pipec.tune(2, 4, layout="Et|x|L")


def test_tune_takes_p2p_groups_as_the_cli_does(tmp_path):
    """``pipec.tune(p2p_groups=...)`` is ``pipec tune --p2p-groups`` (#39): the schedule and the
    report carry the groups, the saved plan is the CLI's byte for byte, the default is
    ``pair`` (absent from the report, as from the CLI's), and a bad name raises the CLI's
    words."""
    kw = {"num_layers": 8, "target": "any", "cost": UNEVEN}
    s, report = pipec.tune(4, 4, **kw, p2p_groups="direction")
    assert s.p2p_groups == "direction" and report["p2p_groups"] == "direction"
    assert s.check().valid
    line = [_cli(), "tune", "--pp", "4", "--microbatches", "4", "--num-layers", "8"]
    line += ["--target", "any", "--cost", UNEVEN]
    out = subprocess.run(
        line + ["--p2p-groups", "direction", "--json", "-o", tmp_path / "cli"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    cli = json.loads(out)
    for key in ("schedule", "layout", "makespan", "peak_memory", "p2p_groups"):
        assert cli[key] == report[key], key
    s.save(tmp_path / "py")
    for f in sorted(os.listdir(tmp_path / "cli")):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "py" / f).read_bytes(), f
    assert json.loads((tmp_path / "py" / "manifest.json").read_text())["p2p_groups"] == "direction"

    plain, plain_report = pipec.tune(4, 4, **kw)
    pair, pair_report = pipec.tune(4, 4, **kw, p2p_groups="pair")
    assert plain.p2p_groups == pair.p2p_groups == "pair"
    assert "p2p_groups" not in plain_report
    plain_report.pop("seconds")
    pair_report.pop("seconds")
    assert plain_report == pair_report

    bad = subprocess.run(
        line + ["--p2p-groups", "ring"], check=False, capture_output=True, text=True
    )
    assert bad.returncode == 2
    with pytest.raises(pipec.SpecError) as e:
        pipec.tune(4, 4, **kw, p2p_groups="ring")
    assert str(e.value) == "unknown P2P groups `ring` (expected one of pair, direction, edge)"
    assert str(e.value) in bad.stderr
    with pytest.raises(pipec.SpecError, match="pair, direction, edge"):
        pipec.tune(4, 4, **kw, p2p_groups=3)


# ---- #29: what pipec tells a user, in the same words as the CLI ----------------------------


def test_pp_messages_agree_for_zero_and_negative():
    """Regression (#29): pp=-1 said "non-negative integer" while pp=0 said "at least 1"."""
    for bad in (0, -1):
        with pytest.raises(pipec.SpecError, match="pp must be at least 1"):
            pipec.compile("1f1b", bad, 4)
        with pytest.raises(pipec.SpecError, match="microbatches must be at least 1"):
            pipec.compile("1f1b", 2, bad)
        with pytest.raises(pipec.SpecError, match="pp must be at least 1"):
            pipec.tune(bad, 4, num_layers=4)
    with pytest.raises(pipec.SpecError, match="vpp must be an integer or None"):
        pipec.compile("interleaved-1f1b", 2, 4, vpp="2")


def test_repr_names_the_sizes_once():
    """Regression (#29): ``Schedule.__repr__`` said "8 ranks, 16 stages" twice."""
    s = pipec.compile("interleaved-1f1b", 8, 16, vpp=2)
    assert repr(s) == "<pipec.Schedule interleaved-1f1b pp=8 vpp=2 microbatches=16>"
    one = pipec.compile("1f1b", 1, 2)
    with pytest.raises(ValueError, match="a schedule of 1 rank$"):
        one.instructions(1)


def test_interleaved_without_vpp_and_torch_names():
    """Regression (#29): interleaved-1f1b without vpp silently ran one chunk; torch's class
    names were unknown kinds with no suggestion."""
    with pytest.raises(pipec.SpecError, match="needs the number of model chunks per rank"):
        pipec.compile("interleaved-1f1b", 4, 8)
    with pytest.raises(pipec.SpecError, match="did you mean `zb-v`"):
        pipec.compile("ZBVZeroBubble", 2, 4)
    with pytest.raises(pipec.SpecError, match="did you mean `dualpipe-v`"):
        pipec.compile("DualPipeV", 2, 4)


def test_memory_is_counted_as_the_cli_counts_it(tmp_path):
    """#28: one memory model everywhere. Python's peaks equal `pipec check --json`'s, in
    layer-activations and in bytes, and a byte limit without byte costs says what to add."""
    s = pipec.compile("zb-v", 2, 4, layout="Et|tt|tt|tL")
    s.save(tmp_path / "s")
    for cost, args in (
        (None, []),
        ("t.act=1GiB,t.param=0.5GiB", ["--cost", "t.act=1GiB,t.param=0.5GiB"]),
    ):
        r = s.check(cost=cost)
        p = subprocess.run(
            [_cli(), "check", tmp_path / "s", "--json", *args],
            check=False,
            capture_output=True,
            text=True,
        )
        d = json.loads(p.stdout)
        assert r.peak_memory == [m["peak"] for m in d["memory"]], (cost, d)
        # `params` is left out of the JSON where it is 0.
        acts = [m["peak"] - m.get("params", 0) for m in d["memory"]]
        assert r.peak_activations == acts, (cost, d)
        assert r.memory_unit == d["memory_unit"]
    assert s.check(cost="t.act=1GiB").memory_unit == "bytes"
    peak = max(s.check(cost="t.act=1GiB").peak_memory)
    assert not s.check(memory_limit=f"{peak - 1}B", cost="t.act=1GiB").valid
    assert s.check(memory_limit=f"{peak}B", cost="t.act=1GiB").valid
    with pytest.raises(pipec.SpecError, match="t.act="):
        s.check(memory_limit="80GiB")
    with pytest.raises(pipec.SpecError, match="is negative"):
        s.check(memory_limit="-5GiB")


def test_native_stub_matches_the_module():
    """#27: the native module has a .pyi (and the package a py.typed); every name it declares
    exists, and every public name of the module is declared."""
    import ast

    pkg = Path(pipec.__file__).parent
    assert (pkg / "py.typed").exists()
    tree = ast.parse((pkg / "_native.pyi").read_text())
    top = {
        n.name if not isinstance(n, ast.AnnAssign) else n.target.id
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AnnAssign))
    }
    public = {n for n in dir(_native) if not n.startswith("_")} | {"__version__"}
    assert top == public
    # Every class's public members, the typed instructions and steps included.
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef) or issubclass(getattr(_native, cls.name), Exception):
            continue
        members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} | {
            n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
        }
        public = {n for n in dir(getattr(_native, cls.name)) if not n.startswith("_")}
        assert {m for m in members if not m.startswith("_")} == public, cls.name


# ---- #41: one rule per fact: what Python reads from Rust ------------------------------------

#: `pipec tune --memory-limit 40GiB` without byte costs: the CLI's message after its flag.
BYTES_WITHOUT_BYTE_COSTS = (
    "the memory limit 40.00GiB is in bytes, but the cost model gives memory in "
    "layer-activations (no K.act or K.param with a byte unit)"
)


def test_tune_refuses_a_byte_limit_without_byte_costs_as_the_cli_does():
    with pytest.raises(pipec.SpecError, match=re.escape(BYTES_WITHOUT_BYTE_COSTS)):
        pipec.tune(4, 8, num_layers=8, memory_limit="40GiB")


def test_the_byte_limit_message_is_the_clis():
    """The message above is what ``pipec tune`` prints for the same request, and a byte
    limit with byte costs is taken (as bytes) by both."""
    code, msg = _cli_error(
        _cli(), "tune", "--pp", "4", "--microbatches", "8", "--num-layers", "8",
        "--memory-limit", "40GiB",
    )  # fmt: skip
    assert code == 1 and BYTES_WITHOUT_BYTE_COSTS in msg, msg
    with pytest.raises(pipec.SpecError) as e:
        pipec.tune(4, 8, num_layers=8, memory_limit="40GiB")
    assert str(e.value).removeprefix("memory_limit: ") == msg.removeprefix("--memory-limit: ")
    _, report = pipec.tune(4, 8, num_layers=8, memory_limit="40GiB", cost="t.act=1GiB")
    assert "GiB" in report["verdict"] and max(report["peak_memory"]) <= 40 * 2**30


def test_an_ambiguous_limit_unit_is_refused_as_the_cli_does():
    """#40: ``40G`` could be GiB or GB; the CLI exits 1 offering both, Python raises the same."""
    code, msg = _cli_error(
        _cli(), "tune", "--pp", "4", "--microbatches", "8", "--num-layers", "8",
        "--memory-limit", "40G",
    )  # fmt: skip
    want = "`40G` has an ambiguous unit: did you mean 40GiB or 40GB?"
    assert code == 1 and msg == f"--memory-limit: {want}", msg
    with pytest.raises(pipec.SpecError) as e:
        pipec.tune(4, 8, num_layers=8, memory_limit="40G")
    assert str(e.value) == f"memory_limit: {want}"
    with pytest.raises(pipec.SpecError, match=re.escape(want)):
        pipec.compile("1f1b", 4, 8, memory_limit="40G")


@pytest.mark.parametrize(
    ("flag", "name"), [("--num-layers", "num_layers"), ("--mtp-num-layers", "mtp_num_layers")]
)
def test_tune_refuses_layers_beside_a_layout_as_the_cli_does(flag, name):
    """#40: ``pipec tune --layout L --num-layers N`` is refused (exit 2); ``pipec.tune`` raised
    nothing and ignored ``num_layers``. Both now refuse, in the same words, each naming its own
    spelling of the two."""
    code, msg = _cli_error(
        _cli(), "tune", "--pp", "2", "--microbatches", "4", "--layout", "Et|tL", flag, "2"
    )
    assert code == 2, msg
    with pytest.raises(pipec.SpecError) as e:
        pipec.tune(2, 4, layout="Et|tL", **{name: 2})
    assert str(e.value) == msg.replace(flag, name).replace("--layout", "layout")
    assert str(e.value).startswith(f"{name} cannot be given with layout: ")


def test_compile_takes_num_layers_as_the_cli_does(tmp_path):
    """#40: ``pipec.compile`` takes ``num_layers`` and ``mtp_num_layers`` as ``pipec compile``
    takes ``--num-layers`` / ``--mtp-num-layers``: the same files, the split by hand (4 decoder
    layers on 2 stages, the MTP layer on the last), and the CLI's refusal of an uneven split."""
    s = pipec.compile("1f1b", 2, 4, num_layers=4, mtp_num_layers=1)
    assert s.layout == "Ett|ttmL"
    assert pipec.compile("1f1b", 2, 4).layout == "Et|tL"
    s.save(tmp_path / "py")
    p = subprocess.run(
        [_cli(), "compile", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
         "--num-layers", "4", "--mtp-num-layers", "1", "-o", tmp_path / "cli"],
        check=True, capture_output=True,
    )  # fmt: skip
    assert p.returncode == 0
    for f in ("manifest.json", "rank-0.json", "rank-1.json"):
        assert (tmp_path / "py" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes(), f
    code, msg = _cli_error(
        _cli(), "compile", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
        "--num-layers", "3", "-o", tmp_path / "bad",
    )  # fmt: skip
    assert code == 1
    with pytest.raises(pipec.SpecError) as e:
        pipec.compile("1f1b", 2, 4, num_layers=3)
    assert str(e.value) == msg
    with pytest.raises(pipec.SpecError, match="num_layers must be an integer"):
        pipec.compile("1f1b", 2, 4, num_layers=-1)


def test_report_peak_activations_are_activations():
    """#40: ``Report.peak_activations`` held parameters + activations. By hand, 1F1B at pp=4,
    M=8, one layer a stage: rank r keeps 4 - r microbatches' activations; with ``t.param=5``
    every rank also holds 5 units of parameters, which ``peak_memory`` adds and
    ``peak_activations`` does not (the CLI's ``simulate --json`` names them so)."""
    s = pipec.compile("1f1b", 4, 8)
    r = s.check(cost="t.param=5")
    assert r.peak_activations == [4, 3, 2, 1]
    assert r.peak_memory == [9, 8, 7, 6]
    sim = s.simulate(cost="t.param=5")
    assert max(r.peak_activations) == sim["peak_activations"]
    assert max(r.peak_memory) == sim["peak_memory"]
    assert not s.check(cost="t.param=5", memory_limit=8).valid
    assert s.check(cost="t.param=5", memory_limit=9).valid


def test_a_tuned_schedule_keeps_its_vpp_and_layout(tmp_path):
    """#40: a tuned plan's repr and attributes lost its chunks per rank and its split. The
    reference is tune's own report (``schedule.vpp``, ``layout``) and what ``pipec show``
    titles the saved directory."""
    s, rep = pipec.tune(4, 8, num_layers=16, target="megatron", kinds=["tuned"])
    assert rep["schedule"]["kind"] == "tuned" and rep["schedule"]["vpp"] == 2, rep["schedule"]
    assert s.vpp == 2 and s.num_stages == 8
    assert s.layout == rep["layout"]
    assert s.plan == "tuned loop vpp=2"
    assert repr(s) == (
        f"<pipec.Schedule tuned loop vpp=2, 4 ranks, 8 stages, microbatches=8, layout {rep['layout']}>"
    )
    s.save(tmp_path / "t")
    loaded = pipec.load(tmp_path / "t")
    assert (loaded.vpp, loaded.layout, loaded.plan, repr(loaded)) == (
        s.vpp,
        s.layout,
        s.plan,
        repr(s),
    )
    shown = subprocess.run(
        [_cli(), "show", tmp_path / "t"], check=True, capture_output=True, text=True
    ).stdout
    assert shown.splitlines()[0] == "tuned loop vpp=2, 4 ranks, 8 stages, microbatches=8"


def test_model_keys_and_p2p_modes_are_rusts():
    """``pipec.MODEL_KEYS`` and the ``megatron_p2p`` modes come from the native module: the
    keys are the ones the Rust cost language lists when it refuses a key, and every mode
    compiles."""
    with pytest.raises(pipec.SpecError) as e:
        pipec.cost_model(cost="[model]\nbogus = 1")
    known = re.search(r"\(known: ([^)]*)\)", str(e.value))
    assert known and known.group(1).split(", ") == list(pipec.MODEL_KEYS), str(e.value)
    assert pipec.MODEL_KEYS is _native.MODEL_KEYS
    assert len(_native.MEGATRON_P2P_MODES) == 6
    for mode in _native.MEGATRON_P2P_MODES:
        assert pipec.compile("interleaved-1f1b", 4, 8, vpp=2, megatron_p2p=mode).check().valid
    with pytest.raises(pipec.SpecError, match="one of batched, unbatched, overlap, "):
        pipec.compile("interleaved-1f1b", 4, 8, vpp=2, megatron_p2p="sometimes")


def test_model_tflops_gives_absolute_times():
    """``tflops`` (a float) makes the derived times absolute: each pass's FLOPs over
    ``tflops * 1e12`` FLOP/s. By hand for h=64, ffn=256, heads=4, seq=32: the forward is
    QKV and projection ``2 s h^2 (2 + 2)`` = 1,048,576, MLP ``4 s h ffn`` = 2,097,152 and the
    attention core ``4 s s h`` = 262,144, 3,407,872 FLOPs: 3.407872 us at 1 TFLOP/s."""
    shape = {"hidden": 64, "ffn": 256, "heads": 4, "seq": 32, "vocab": 128}
    c = pipec.cost_model(cost='time_unit = "us"', model={**shape, "tflops": 1.0})
    assert c["t"]["f"] == pytest.approx(3.407872, rel=1e-12)
    assert c["model"]["tflops"] == 1.0
    plain = pipec.cost_model(model=shape)
    assert plain["t"]["f"] == 1.0 and "tflops" not in plain["model"]
    with pytest.raises(pipec.SpecError, match="`tflops` must be"):
        pipec.cost_model(model={**shape, "tflops": float("nan")})
    with pytest.raises(pipec.SpecError, match="`hidden` must be an integer"):
        pipec.cost_model(model={**shape, "hidden": 64.0})
