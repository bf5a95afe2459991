"""The CUDA-graph capture order (#39) against megatron-core's own.

``tests/golden/megatron/capture_order.txt.gz`` is megatron-core 0.19.2's ``_order`` for every
configuration of its 1F1B and interleaved schedules in the recorder's grid
(``record_capture_order.py``). Here: the recorder reproduces a subset with the installed
megatron-core; ``Schedule.capture_order`` equals it on a sample of configurations (the Rust
test ``megatron_capture`` compares every one); and ``pipec.megatron`` hands its order to
megatron-core's real ``TECudaGraphHelper._get_cuda_graph_input_data``, which passes it on
unchanged to the point where Transformer Engine's capture begins (``_get_sample_arguments``,
stubbed here: capturing needs Transformer Engine and a GPU).
"""

from __future__ import annotations

import gzip
import re
import types
from pathlib import Path

import pytest
from golden_record import rerecord

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (test.sh installs it)")

import pipec
import pipec.megatron as pm

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "megatron"
SUBSET = r"^(1f1b pp=3 |interleaved pp=2 vpp=2 |interleaved pp=4 vpp=3 m=8 )"


def _golden() -> dict[str, list[list[float]] | str]:
    lines = gzip.decompress((GOLDEN / "capture_order.txt.gz").read_bytes()).decode().splitlines()
    out: dict[str, list[list[float]] | str] = {}
    for line in lines[1:]:
        if " ! " in line:
            head, err = line.split(" ! ", 1)
            out[head] = err
        else:
            head, *ranks = line.split(" | ")
            out[head] = [[float(x) for x in r.split()] for r in ranks]
    return out


GOLD = _golden()


def _compile(head: str) -> pipec.Schedule:
    fn, *kv = head.split()
    k = dict(t.split("=") for t in kv)
    pp, vpp, m, g = (int(k[x]) for x in ("pp", "vpp", "m", "g"))
    if fn == "1f1b":
        return pipec.compile("1f1b", pp, m)
    return pipec.compile(
        "interleaved-1f1b", pp, m, vpp=vpp, group_size=g, combined=k["ep_overlap"] == "1"
    )


def test_capture_order_golden_is_reproduced_by_megatrons_code(tmp_path):
    got, want = rerecord("record_capture_order.py", SUBSET, "capture_order.txt.gz", tmp_path)
    rx = re.compile(SUBSET)
    want = [line for line in want if rx.search(line)]
    assert len(want) >= 40, len(want)
    assert got == want, "megatron-core now orders its CUDA-graph capture otherwise"


@pytest.mark.parametrize(
    "head",
    [
        "1f1b pp=1 vpp=1 m=3 g=1 ep_overlap=0 wgrad=0",
        "1f1b pp=4 vpp=1 m=6 g=4 ep_overlap=0 wgrad=0",
        "interleaved pp=2 vpp=2 m=5 g=3 ep_overlap=0 wgrad=0",
        "interleaved pp=4 vpp=3 m=8 g=4 ep_overlap=0 wgrad=0",
        "interleaved pp=4 vpp=2 m=10 g=5 ep_overlap=0 wgrad=0",
        "interleaved pp=3 vpp=4 m=6 g=3 ep_overlap=1 wgrad=0",
    ],
)
def test_schedule_capture_order_is_megatrons(head):
    want = GOLD[head]
    assert isinstance(want, list), want
    s = _compile(head)
    for r, w in enumerate(want):
        got = s.capture_order(r)
        assert got == w, (head, r)
        assert all(isinstance(x, int) for x in got)


def test_capture_order_half_steps_and_refusals():
    zbv = pipec.compile("zb-v", 2, 4)
    order = zbv.capture_order(0)
    # Chunk 1 is stage 0, chunk 2 stage 3; each W a half step after its chunk's backward.
    assert sorted({x for x in order if x != int(x)}) == [-2.5, -1.5]
    assert order.count(1) == order.count(-1) == order.count(-1.5) == 4
    # DualPipe fuses some backwards and splits others: a fused one is its two halves.
    dp = pipec.compile("dualpipe", 4, 8)
    for r in range(4):
        o = dp.capture_order(r)
        for c in (1, 2):
            assert o.count(c) == o.count(-c) == o.count(-c - 0.5) == 4
    with pytest.raises(pipec.PipecError, match="cannot express this program"):
        pipec.compile("looped-bfs", 2, 4, vpp=2).capture_order(0)
    with pytest.raises(pipec.PipecError, match="forward-only program has no capture order"):
        pipec.compile("1f1b", 2, 4, forward_only=True).capture_order(0)
    with pytest.raises(ValueError, match="rank"):
        zbv.capture_order(2)


class _Stop(Exception):
    pass


def _handed(monkeypatch, s: pipec.Schedule, rank: int, **config):
    """Run megatron-core's real TECudaGraphHelper._get_cuda_graph_input_data, wrapped by
    pipec.megatron, on a helper without a model: the order it passes on to
    _get_sample_arguments (Transformer Engine's capture starts there)."""
    from megatron.core.transformer import cuda_graphs

    pm.forward_backward_func(s)  # hands the schedule's order over
    monkeypatch.setattr(cuda_graphs, "get_num_microbatches", lambda: s.num_microbatches)
    monkeypatch.setattr(cuda_graphs, "log_on_each_pipeline_stage", lambda **kw: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: rank)
    seen = {}

    def sample(order, chunk_id_list):
        seen["order"] = order
        raise _Stop

    chunks = len(s.stages_of(rank))
    cfg = types.SimpleNamespace(microbatch_group_size_per_vp_stage=s.pp, **config)
    group = types.SimpleNamespace(size=lambda: s.pp, rank=lambda: rank)
    helper = types.SimpleNamespace(
        pp_group=group,
        config=cfg,
        num_model_chunks=chunks,
        num_layers_per_chunk=[1] * chunks,
        p2p_communicator=types.SimpleNamespace(
            pp_group=group, virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None
        ),
        tp_group=None,
        dp_cp_group=None,
        _get_sample_arguments=sample,
    )
    with pytest.raises(_Stop):
        cuda_graphs.TECudaGraphHelper._get_cuda_graph_input_data(helper)
    return seen["order"]


def test_megatron_captures_in_the_handed_order(monkeypatch):
    head = "interleaved pp=4 vpp=2 m=8 g=4 ep_overlap=0 wgrad=0"
    s = _compile(head)
    for r in range(4):
        assert _handed(monkeypatch, s, r, overlap_moe_expert_parallel_comm=False) == GOLD[head][r]
    # A schedule Megatron has no table for: GPipe, every forward then every backward.
    gp = pipec.compile("gpipe", 2, 4)
    for r in range(2):
        got = _handed(monkeypatch, gp, r, overlap_moe_expert_parallel_comm=False)
        assert got == [1, 1, 1, 1, -1, -1, -1, -1]


def test_handing_over_refuses_what_megatron_cannot_capture(monkeypatch):
    with pytest.raises(pipec.PipecError, match="splits the backward"):
        _handed(monkeypatch, pipec.compile("zb-v", 2, 4), 0, overlap_moe_expert_parallel_comm=False)
    with pytest.raises(pipec.PipecError, match="overlap_moe_expert_parallel_comm"):
        _handed(monkeypatch, pipec.compile("1f1b", 2, 4), 0, overlap_moe_expert_parallel_comm=True)
    # Before the first instruction of a step: the same refusal, and none without TE graphs.
    te = types.SimpleNamespace(
        cuda_graph_impl="transformer_engine", overlap_moe_expert_parallel_comm=False
    )
    with pytest.raises(pipec.PipecError, match="splits the backward"):
        pm._check_graphs(pipec.compile("zb-h1", 2, 4), te, 1)
    pm._check_graphs(pipec.compile("zb-h1", 2, 4), types.SimpleNamespace(cuda_graph_impl="none"), 0)
    pm._check_graphs(pipec.compile("1f1b", 2, 4), te, 0)
