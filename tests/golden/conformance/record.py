#!/usr/bin/env python3
"""Regenerate tests/golden/conformance/ from the peers' own code.

Every value written here comes out of megatron-core's or torch's functions as installed; this
script only chooses the cases and lays the results out as the committed files do.

megatron/layouts.json: megatron.core.transformer.pipeline_parallel_layer_layout run unchanged.
  parse     PipelineParallelLayerLayout.parse_str_to_list; `expanded` is that function's own local
            `layout_str` after unrolling (read from its frame when it returns or raises), and
            layer letters are mapped back through its own local `char2layer_type`.
  construct PipelineParallelLayerLayout(layout, pp); a rejection also carries the message of
            Megatron-LM's training-side check (megatron.training.arguments.validate_args, run
            for real on a minimal argument list).
  validate  validate_layer_layout(num_layers, mtp_num_layers) with the layout's own decoder and
            MTP counts (None when it has no MTP layer), so only the structural checks can fail.
  ranks     get_layer_id_list / get_layer_offset per (pp_rank, vpp_rank); pretty_repr().
  The case list (id, layout, pp, vpp, note) is this script's input.

megatron/{interleaved_pp4_vpp2_m8_g4,1f1b_pp4_m8}.json: Megatron's schedules run unchanged, one
  pipeline rank at a time, with the compute, torch.distributed P2P and device stubs of
  tests/golden/megatron/record.py (imported from there; see its docstring) in mode "batched"
  (megatron-core's config defaults). P2PCommunicator's public methods are wrapped only to note
  which one the schedule called; `trace` lists each call that moved a tensor with what it moved:
  send_next/send_prev = [sender's chunk, microbatch], recv_prev/recv_next = [consumer's chunk,
  microbatch] (as the receiving compute consumed it). `microbatches` is the value
  get_pp_rank_microbatches returned to the interleaved schedule (for 1F1B, that function called as
  for a non-interleaved rank; asserted equal to the schedule's own warmup count). `order` of
  combined_1f1b comes from the combined-1F1B recorder (config.overlap_moe_expert_parallel_comm);
  an ["FB", fc, fm, bc, bm] entry is one fused forward+backward call. `schedule_table` is
  get_schedule_table, `cuda_graph_order` is convert_schedule_table_to_order
  (megatron.core.pipeline_parallel.schedules and megatron.core.transformer.cuda_graphs).

torch/*.csv: torch.distributed.pipelining's ScheduleInterleaved1F1B and ScheduleDualPipeV built
  for every rank from placeholder stages (only the attributes the constructors read: no world, no
  model), then written by the schedule's own _dump_csv (compute_only: pipeline_order;
  compute_comms: pipeline_order_with_comms, torch's own lowering with its defaults).

Usage:
  python tests/golden/conformance/record.py [--out DIR]     write every file under DIR
  python tests/golden/conformance/record.py --check         regenerate into a temp dir, compare
      byte for byte with the committed files, exit 1 on any difference
"""

import argparse
import contextlib
import filecmp
import importlib.util
import io
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

import megatron.core
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import (
    PipelineParallelLayerLayout,
)
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

# The Megatron recorder's patches pretend a process group exists; the training-argument check
# must see the truth (there is none) or it asks torch for a rank.
_DIST_IS_INITIALIZED = torch.distributed.is_initialized
HERE = os.path.dirname(os.path.abspath(__file__))
FILES = [
    "megatron/layouts.json",
    "megatron/interleaved_pp4_vpp2_m8_g4.json",
    "megatron/1f1b_pp4_m8.json",
    "torch/dualpipev_pp2_v2_m4.compute_only.csv",
    "torch/interleaved1f1b_pp2_v2_m2.compute_comms.csv",
    "torch/interleaved1f1b_pp2_v2_m2.compute_only.csv",
]
# The Megatron-LM commit the data was first recorded from (the README); megatron-core 0.19.2's
# files used here match it (docs/design.md), and --check proves the output is unchanged.
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


# --------------------------------------------------------------------------- layouts
LAYOUT_CASES = [
    # (id, layout, pp, vpp, note)
    (
        "dsv3_doc_pp16",
        "Et*3|(tt|)*29,m|L",
        16,
        2,
        "documented DeepSeek-V3 example (61 decoder layers + 1 MTP), PP16 VPP2",
    ),
    ("empty_stage_doc_pp4", "E||t|L", 4, None, "documented empty-stage example, PP4 VPP1"),
    (
        "unit_pp4_empty",
        "E|t|t*2|t||(t|)*2,t*2,L",
        4,
        2,
        "unit-test case with empty stage and group repetition",
    ),
    ("bad_symbol_X", "EtX|L", 2, None, "unknown symbol"),
    ("unmatched_open", "E(tt|L", 2, None, "unmatched '('"),
    ("stages_not_divisible", "E|t|L", 2, None, "3 stages, pp=2"),
    ("multiple_E", "Et|Et|t|L", 2, None, "E twice"),
    ("mtp_before_decoder", "Etm|tL", 2, None, "decoder after mtp"),
]


class _FrameLocals:
    """Reads chosen locals of one function's frame when it returns or raises (sys.settrace)."""

    def __init__(self, func, names):
        self.code, self.names, self.seen = func.__code__, names, None

    def _local(self, frame, event, arg):
        if event == "return":
            self.seen = {n: frame.f_locals.get(n) for n in self.names}
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code is self.code else None

    def __enter__(self):
        self._old = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._old)


def _training_arguments_message(layout, pp):
    """Megatron-LM's own training-side rejection (megatron.training.arguments.validate_args),
    run on a minimal argument list; returns its message, or None if it accepts the layout."""
    from megatron.training.arguments import parse_args, validate_args

    argv, is_init = sys.argv, torch.distributed.is_initialized
    torch.distributed.is_initialized = _DIST_IS_INITIALIZED
    # The smallest argument list validate_args accepts up to its layout check.
    sys.argv = ["pretrain", "--num-layers", "1", "--hidden-size", "8"]
    sys.argv += ["--num-attention-heads", "1", "--seq-length", "8"]
    sys.argv += ["--max-position-embeddings", "8", "--micro-batch-size", "1"]
    sys.argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "8"]
    sys.argv += ["--pipeline-model-parallel-size", str(pp)]
    sys.argv += ["--pipeline-model-parallel-layout", layout]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            args.world_size, args.rank = pp, 0
            try:
                validate_args(args)
            except AssertionError as e:
                return str(e)
    finally:
        sys.argv, torch.distributed.is_initialized = argv, is_init
    return None


def _error(phase, e):
    return {"phase": phase, "type": type(e).__name__, "message": str(e)}


def layout_case(cid, layout, pp, vpp, note):
    out = {"id": cid, "layout": layout, "pp": pp, "vpp": vpp, "note": note}
    parse = PipelineParallelLayerLayout.parse_str_to_list
    tracer = _FrameLocals(parse, ("layout_str", "char2layer_type"))
    err = None
    with tracer:
        try:
            stages = parse(layout)
        except AssertionError as e:
            err = e
    out["expanded"] = tracer.seen["layout_str"]
    if err is not None:
        out["result"], out["error"] = "error", _error("parse", err)
        return out
    letter = {t: c for c, t in tracer.seen["char2layer_type"].items()}
    out["num_stages"] = len(stages)
    out["stages_in_string_order"] = [[letter[t] for t in s] for s in stages]
    try:
        lay = PipelineParallelLayerLayout(layout, pp)
    except AssertionError as e:
        out["result"], out["error"] = "error", _error("construct", e)
        out["error"]["training_arguments_message"] = _training_arguments_message(layout, pp)
        return out
    detected = lay.virtual_pipeline_model_parallel_size
    # TransformerConfig's vpp conflict check (transformer_config.py): no case here has one.
    assert vpp is None or vpp == detected, f"{cid}: vpp {vpp} conflicts with layout {detected}"
    out["detected_vpp"] = detected
    out["num_layers"] = lay.flatten_layout.count(LayerType.decoder)
    out["mtp_num_layers"] = lay.flatten_layout.count(LayerType.mtp) or None
    try:
        mtp_standalone = lay.validate_layer_layout(out["num_layers"], out["mtp_num_layers"])
    except AssertionError as e:
        out["result"], out["error"] = "error", _error("validate", e)
        return out
    out["result"], out["mtp_standalone"] = "ok", mtp_standalone
    out["flatten_layout"] = [letter[t] for t in lay.flatten_layout]
    parallel_state.set_virtual_pipeline_model_parallel_world_size(detected)
    ranks = []
    for r in range(pp):
        for v in range(detected):
            kw = {"vp_stage": v, "pp_rank": r}
            ranks.append(
                {
                    "pp_rank": r,
                    "vpp_rank": v,
                    "stage_index": v * pp + r,
                    "layers": [letter[t] for t in lay.layout[r][v]],
                    "decoder_layer_ids": lay.get_layer_id_list(LayerType.decoder, **kw),
                    "decoder_layer_offset": lay.get_layer_offset(LayerType.decoder, **kw),
                    "mtp_layer_ids": lay.get_layer_id_list(LayerType.mtp, **kw),
                }
            )
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    out["ranks"] = ranks
    out["pretty_repr"] = lay.pretty_repr()
    return out


def layouts():
    cases = [layout_case(*c) for c in LAYOUT_CASES]
    doc = {
        "source": {
            "repo": "NVIDIA/Megatron-LM",
            "commit": MEGATRON_COMMIT,
            "files": [
                "megatron/core/transformer/pipeline_parallel_layer_layout.py",
                "megatron/core/transformer/enums.py",
                "megatron/core/transformer/transformer_config.py (vpp conflict check, reproduced)",
            ],
        },
        "note": (
            "A few published-behaviour examples from Megatron-LM's own layout parser (generated "
            "by running it). Error messages are Megatron's; pipec need not copy their wording, "
            "only reject the same inputs with a clear message."
        ),
        "cases": cases,
    }
    return json.dumps(doc, indent=1)


# --------------------------------------------------------------------------- schedules
def _load_p2p_recorder():
    path = os.path.join(HERE, "..", "megatron", "record.py")
    spec = importlib.util.spec_from_file_location("megatron_p2p_record", path)
    mod = importlib.util.module_from_spec(spec)
    sys.dont_write_bytecode = True  # leave no __pycache__ in tests/golden
    spec.loader.exec_module(mod)
    return mod


_GET_PP_RANK_MICROBATCHES = schedules.get_pp_rank_microbatches
P2P = None  # tests/golden/megatron/record.py, loaded once
COMM_METHODS = [
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
]


class CommCall:
    """Marks, in the rank's event list, one call of a P2PCommunicator method."""

    def __init__(self, name):
        self.name, self.end = name, None


def _wrap_comm(name):
    inner = getattr(P2PCommunicator, name)

    def wrapper(self, *a, **k):
        rec = P2P.R
        if getattr(rec, "in_comm", False):
            return inner(self, *a, **k)
        mark = CommCall(name)
        rec.events.append(mark)
        rec.in_comm = True
        try:
            return inner(self, *a, **k)
        finally:
            rec.in_comm = False
            mark.end = len(rec.events)

    return wrapper


def _install():
    global P2P
    if P2P is not None:
        return
    P2P = _load_p2p_recorder()
    P2P.install_patches()
    for name in COMM_METHODS:
        setattr(P2PCommunicator, name, _wrap_comm(name))

    def recording_get_pp_rank_microbatches(*a, **k):
        res = _GET_PP_RANK_MICROBATCHES(*a, **k)
        P2P.R.microbatches = res
        return res

    schedules.get_pp_rank_microbatches = recording_get_pp_rank_microbatches


def _mb(res):
    total, all_warm, warm, remaining = res
    return {"total": total, "warmup": warm, "remaining": remaining, "all_in_warmup": all_warm}


def _comm_entry(mark, events, rank, pp):
    entry = {"comm": mark.name}
    for ev in events:
        if isinstance(ev, P2P.Recv):
            payload = ev.payload
            assert payload is not None, f"rank {rank}: {mark.name} received a buffer never used"
            stage, m = (int(v) for v in payload[1:].split("."))
            key = "recv_prev" if payload[0] == "a" else "recv_next"
            stage = stage + 1 if payload[0] == "a" else stage - 1  # the consumer's stage
        elif isinstance(ev, str) and ev[0] == "s":
            payload = ev.split(":")[2]
            stage, m = (int(v) for v in payload[1:].split("."))
            key = "send_next" if payload[0] == "a" else "send_prev"
        else:
            continue
        assert key not in entry, f"rank {rank}: {mark.name} moved two {key}"
        entry[key] = [(stage - rank) // pp, m]
    order = ["comm", "send_next", "send_prev", "recv_prev", "recv_next"]
    return {k: entry[k] for k in order if k in entry} if len(entry) > 1 else None


def _render(events, rank, pp):
    """(order, trace) of one rank's recorded events."""
    order, trace = [], []
    for i, ev in enumerate(events):
        if isinstance(ev, CommCall):
            e = _comm_entry(ev, events[i + 1 : ev.end], rank, pp)
            if e is not None:
                trace.append(e)
        elif isinstance(ev, str) and ev[0] in "FBX" and "." in ev:
            if ev[0] == "X":
                f, b = ev[1:].split("/")
                op = ["FB", *(int(v) for v in f.split(".")), *(int(v) for v in b.split("."))]
            else:
                op = [ev[0], *(int(v) for v in ev[1:].split("."))]
            order.append(op)
            trace.append(op)
    return order, trace


def run_rank(fn, pp, vpp, M, g, rank, fo, combined):
    """Runs Megatron's schedule for one rank; returns (order, trace, microbatches, p2p)."""
    if fn == "interleaved":
        config = P2P.make_config(pp, vpp, g, "batched", combined)
        model = [P2P.Chunk(config, c) for c in range(vpp)]
        data = [None] * vpp
        func = schedules.forward_backward_pipelining_with_interleaving
    else:
        config = P2P.make_config(pp, None, None, "batched", False)
        model = P2P.Chunk(config, None)
        data = None
        func = schedules.forward_backward_pipelining_without_interleaving
    P2P.R = P2P.Recorder(rank, pp)
    P2P.R.vpp = vpp
    P2P.R.microbatches = None
    pgc = ProcessGroupCollection()
    pgc.tp = P2P.FakeGroup(0, 1)
    pgc.cp = P2P.FakeGroup(0, 1)
    p2p = P2PCommunicator(pp_group=P2P.FakeGroup(rank, pp), config=config)
    tracer = _FrameLocals(func, ("num_warmup_microbatches",))
    with tracer:
        func(
            forward_step_func=None,
            data_iterator=data,
            model=model,
            num_microbatches=M,
            seq_length=P2P.SEQ,
            micro_batch_size=P2P.MBS,
            forward_only=bool(fo),
            p2p_communicator=p2p,
            pg_collection=pgc,
        )
    rec, P2P.R = P2P.R, None
    assert not rec.anomalies, rec.anomalies
    mb = rec.microbatches
    if fn != "interleaved":
        # The 1F1B schedule computes its warmup inline (pp - rank - 1, also when forward-only);
        # the recorded file gives counts for its training run only.
        mb = _GET_PP_RANK_MICROBATCHES(M, 1, None, forward_only=False, p2p_communicator=p2p)
    assert mb[2] == tracer.seen["num_warmup_microbatches"], (mb, tracer.seen)
    order, trace = _render(rec.events, rank, pp)
    return order, trace, _mb(mb)


SOURCE_FILES = [
    "megatron/core/pipeline_parallel/schedules.py",
    "megatron/core/pipeline_parallel/combined_1f1b.py",
    "megatron/core/transformer/cuda_graphs.py (convert_schedule_table_to_order)",
]


def interleaved(pp, vpp, M, g):
    table = schedules.get_schedule_table(M, vpp, g)
    ranks = []
    for r in range(pp):
        order, trace, mb = run_rank("interleaved", pp, vpp, M, g, r, 0, 0)
        fo_order, _, fo_mb = run_rank("interleaved", pp, vpp, M, g, r, 1, 0)
        c_order, _, c_mb = run_rank("interleaved", pp, vpp, M, g, r, 0, 1)
        ranks.append(
            {
                "pp_rank": r,
                "microbatches": mb,
                "order": order,
                "trace": trace,
                "forward_only": {"microbatches": fo_mb, "order": fo_order},
                "combined_1f1b": {"microbatches": c_mb, "order": c_order},
                "cuda_graph_order": convert_schedule_table_to_order(mb["warmup"], vpp, table),
            }
        )
    doc = {
        "schedule": "interleaved_1f1b",
        "source": {"repo": "NVIDIA/Megatron-LM", "commit": MEGATRON_COMMIT, "files": SOURCE_FILES},
        "pp": pp,
        "vpp": vpp,
        "num_microbatches": M,
        "microbatch_group_size_per_vp_stage": g,
        "schedule_table": [list(e) for e in table],
        "ranks": ranks,
    }
    return dump_schedule_json(doc)


def onef1b(pp, M):
    ranks = []
    for r in range(pp):
        order, trace, mb = run_rank("1f1b", pp, 1, M, None, r, 0, 0)
        fo_order, fo_trace, _ = run_rank("1f1b", pp, 1, M, None, r, 1, 0)
        ranks.append(
            {
                "pp_rank": r,
                "microbatches": mb,
                "order": order,
                "trace": trace,
                "forward_only": {"order": fo_order, "trace": fo_trace},
            }
        )
    doc = {
        "schedule": "1f1b",
        "source": {"repo": "NVIDIA/Megatron-LM", "commit": MEGATRON_COMMIT, "files": SOURCE_FILES},
        "pp": pp,
        "vpp": 1,
        "num_microbatches": M,
        "ranks": ranks,
    }
    return dump_schedule_json(doc)


EXPANDED = {"source", "ranks", "trace", "forward_only", "combined_1f1b"}


def _compact(v):
    return json.dumps(v, separators=(",", ":"))


def dump_schedule_json(doc):
    """The committed layout: one-space indent; objects and the `ranks`/`trace` lists one member
    per line; every other value (and each trace entry) on one line."""

    def fmt(v, depth, expand):
        if not expand:
            return _compact(v)
        pad, inner = " " * depth, " " * (depth + 1)
        if isinstance(v, dict):
            items = [
                f"{inner}{json.dumps(k)}: {fmt(x, depth + 1, k in EXPANDED)}" for k, x in v.items()
            ]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        items = [f"{inner}{fmt(x, depth + 1, isinstance(x, dict) and 'pp_rank' in x)}" for x in v]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"

    return fmt(doc, 0, True) + "\n"


# --------------------------------------------------------------------------- torch
class PlaceholderStage(_PipelineStageBase):
    """The attributes torch's schedule constructors read; no module, no process group (the
    pattern of torch's own MockPipelineStage in test/distributed/pipelining)."""

    def __init__(self, stage_index, num_stages, group_size, group_rank):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.submod = torch.nn.Identity()

    def _unused(self, *a, **k):
        raise AssertionError("a schedule constructor touched the stage's runtime")

    _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = _unused


def torch_schedule(cls, pp, v, m, style):
    n = pp * v
    if style == "v":
        local = [[r, n - 1 - r] for r in range(pp)]
    else:
        local = [[r + k * pp for k in range(v)] for r in range(pp)]
    stages = [PlaceholderStage(s, n, pp, 0) for s in local[0]]
    return cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())


def torch_csvs(outdir):
    sched = torch_schedule(torch_schedules.ScheduleDualPipeV, 2, 2, 4, "v")
    sched._dump_csv(
        os.path.join(outdir, "torch/dualpipev_pp2_v2_m4.compute_only.csv"), "compute_only"
    )
    sched = torch_schedule(torch_schedules.ScheduleInterleaved1F1B, 2, 2, 2, "loop")
    base = os.path.join(outdir, "torch/interleaved1f1b_pp2_v2_m2")
    sched._dump_csv(base + ".compute_only.csv", "compute_only")
    sched._dump_csv(base + ".compute_comms.csv", "compute_comms")


# --------------------------------------------------------------------------- main
def record(outdir):
    os.makedirs(os.path.join(outdir, "megatron"), exist_ok=True)
    os.makedirs(os.path.join(outdir, "torch"), exist_ok=True)
    _install()
    texts = {
        "megatron/layouts.json": layouts(),
        "megatron/interleaved_pp4_vpp2_m8_g4.json": interleaved(4, 2, 8, 4),
        "megatron/1f1b_pp4_m8.json": onef1b(4, 8),
    }
    for name, text in texts.items():
        with open(os.path.join(outdir, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    torch_csvs(outdir)


def check():
    """Regenerates into a temp dir; returns the committed files that differ."""
    with tempfile.TemporaryDirectory() as d:
        record(d)
        return [
            n for n in FILES if not filecmp.cmp(os.path.join(d, n), os.path.join(HERE, n), False)
        ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=HERE, help="output directory (default: this directory)")
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    a = ap.parse_args()
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}")
    if a.check:
        diff = check()
        for n in diff:
            print(f"DIFFERS: {n}")
        print(f"{len(FILES) - len(diff)} of {len(FILES)} files reproduced byte for byte")
        sys.exit(1 if diff else 0)
    record(a.out)
    print(f"wrote {len(FILES)} files under {a.out}")


if __name__ == "__main__":
    main()
