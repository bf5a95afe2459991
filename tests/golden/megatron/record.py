#!/usr/bin/env python3
"""Record Megatron-Core's real pipeline schedules as golden data for pipec.

Runs megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving
and ..._without_interleaving UNCHANGED, one pipeline rank at a time in one process, with no real
communication. Only compute, the torch.distributed p2p primitives and the process-group / device
plumbing are replaced by recorders. Megatron's own P2PCommunicator._communicate, _p2p_ops and
_batched_p2p_ops run for real, so op order inside a call, the even/odd ordering and the choice of
process group (pp group vs WORLD) are Megatron's own.

Patches (everything else is Megatron's code as installed):
  megatron.core.pipeline_parallel.schedules.forward_step   -> recorder (F token, tagged output)
  megatron.core.pipeline_parallel.schedules.backward_step  -> recorder (B token, tagged grad)
  megatron.core.pipeline_parallel.schedules.combined_1f1b_schedule_for_interleaved_pipelining
                                                           -> recorder (X token + hooks, see below)
  torch.distributed.isend / irecv / batch_isend_irecv / P2POp -> recorders returning FakeWork
  FakeWork.wait()                                           -> recorded as w<h>
  torch.distributed.is_initialized -> True   (megatron.core.utils.get_pg_rank/get_pg_size need it)
  torch.distributed.get_global_rank -> identity (group rank == global rank)
  torch.distributed.get_backend -> "nccl"
  torch.distributed.group -> namespace whose WORLD is a distinct FakeGroup (marked :W)
  torch.cuda.current_device -> "cpu";  torch.cuda.synchronize -> no-op
  torch.zeros / torch.empty -> same, with device="cuda"/cuda device rewritten to "cpu"
Process groups: P2PCommunicator(pp_group=FakeGroup(rank, pp), config) and a
ProcessGroupCollection with tp/cp = FakeGroup(0, 1) are passed explicitly.

Combined 1F1B (config.overlap_moe_expert_parallel_comm=True, interleaved, forward_only=False):
the recorder replaces combined_1f1b_schedule_for_interleaved_pipelining and reproduces its
structure: forward_step_helper_preprocess, backward_step_helper_preprocess, then the body of
TransformerModelChunkSchedulePlan.run (megatron/core/models/common/model_chunk_schedule_plan.py):
    pre_forward(f_vp)  ->  pre_backward(b_vp)  ->  [fused layers: X token]  ->
    post_forward(f_out, f_vp)  ->  post_backward(b_grad, b_vp)
then forward_step_helper_postprocess and backward_step_helper_postprocess. A call with only a
forward (warmup) or only a backward (cooldown) half records F or B instead of X.
combined=1 lines exist only for fo=0: with forward_only Megatron never takes the combined path.

Output (gzip, UTF-8, one config per line, deterministic):
  line 1: "# megatron-core <v> torch <v> command: <cmd>"
  <fn> pp=<pp> vpp=<vpp|1> m=<M> g=<g|-> fo=<0|1> combined=<0|1> mode=<mode> | <rank0> | <rank1> ...
  or   <same fields> ! <ExceptionType>: <message>
  rank tokens: F<c>.<m> B<c>.<m> X<fc>.<fm>/<bc>.<bm>  [ ]  s<h>:<peer>:<payload>[:W]
               r<h>:<peer>:<payload>[:W]  w<h>;  payload a<stage>.<mb> | g<stage>.<mb> | ?

Usage:
  python record.py [--out calls.txt.gz] [--only REGEX]     record the grid
  python record.py --selfcheck [--in calls.txt.gz]          FIFO-match every send with a recv
      per directed (src, dst, group) channel and replay all ranks with rendezvous semantics
      (w<h> blocks until the FIFO-matching op is issued by the peer); lists configs where a
      send would land in a recv expecting another payload, or that deadlock. Exit 1 if any
      FIFO problem (Megatron itself has some: pp=2 interleaved batched, see the report).
  python record.py --spotcheck DIR                          compare with conformance JSON files
"""

import argparse
import gzip
import io
import json
import os
import re
import sys
import types
import warnings
from collections import defaultdict

warnings.filterwarnings("ignore")

import megatron.core
import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

SCRIPT = os.path.abspath(__file__)
MODES = {
    # name: (batch_p2p_comm, overlap_p2p_comm, overlap_p2p_comm_warmup_flush,
    #        deallocate_pipeline_outputs)
    # Megatron-LM's training script sets deallocate_pipeline_outputs=True (then each forward's
    # send is waited at once); megatron-core's config default is False ("keep_outputs").
    "batched": (True, False, False, False),
    "unbatched": (False, False, False, False),
    "overlap": (False, True, False, True),
    "overlap_flush": (False, True, True, True),
    "overlap_keep_outputs": (False, True, False, False),
    "overlap_flush_keep_outputs": (False, True, True, False),
}


# --------------------------------------------------------------------------- fakes
class FakeGroup:
    def __init__(self, rank, size, world=False):
        self._rank, self._size, self.world = rank, size, world

    def rank(self):
        return self._rank

    def size(self):
        return self._size


FAKE_WORLD = FakeGroup(-1, -1, world=True)


class Recv:
    """A recorded irecv; payload is filled when the buffer is consumed by compute."""

    __slots__ = ("conflict", "h", "payload", "peer", "world")

    def __init__(self, h, peer, world):
        self.h, self.peer, self.world, self.payload, self.conflict = h, peer, world, None, None

    def token(self):
        p = self.payload if self.payload is not None else "?"
        return f"r{self.h}:{self.peer}:{p}" + (":W" if self.world else "")


class Recorder:
    """Per-rank recording state."""

    def __init__(self, rank, pp):
        self.rank, self.pp = rank, pp
        self.events = []
        self.next_h = 0
        self.tags = {}  # id(tensor) -> payload string (tensors produced by stubs)
        self.recvs = {}  # id(buffer) -> Recv
        self.keep = []  # keep every tensor alive so ids are never reused
        self.anomalies = []

    def new_tensor(self, tag):
        t = torch.zeros(1, requires_grad=True)
        self.tags[id(t)] = tag
        self.keep.append(t)
        return t

    def tag_of(self, t):
        return self.tags.get(id(t))

    def consume(self, t, payload, what):
        """Compute `what` consumed tensor t, which must carry `payload`."""
        if t is None:
            self.anomalies.append(f"{what}: input is None (expected {payload})")
            return
        rv = self.recvs.get(id(t))
        if rv is None:
            self.anomalies.append(f"{what}: input is not a received buffer (expected {payload})")
            return
        if rv.payload is None:
            rv.payload = payload
        elif rv.payload != payload:
            self.anomalies.append(f"{what}: buffer r{rv.h} consumed as {rv.payload} and {payload}")

    def send(self, tensor, peer, group):
        h = self.next_h
        self.next_h += 1
        tag = self.tag_of(tensor)
        if tag is None:
            tag = "?"
            self.anomalies.append(f"s{h}: sent tensor has no tag")
        self.events.append(f"s{h}:{peer}:{tag}" + (":W" if group is FAKE_WORLD else ""))
        return FakeWork(self, h)

    def recv(self, tensor, peer, group):
        h = self.next_h
        self.next_h += 1
        rv = Recv(h, peer, group is FAKE_WORLD)
        self.recvs[id(tensor)] = rv
        self.keep.append(tensor)
        self.events.append(rv)
        return FakeWork(self, h)

    def render(self):
        return " ".join(e if isinstance(e, str) else e.token() for e in self.events)


class FakeWork:
    def __init__(self, rec, h):
        self.rec, self.h = rec, h

    def wait(self, *a, **k):
        self.rec.events.append(f"w{self.h}")
        return True


R = None  # current Recorder


def _check_group(group):
    assert group is not None and isinstance(group, FakeGroup), f"unexpected group {group!r}"


def fake_isend(tensor=None, dst=None, group=None, tag=0, group_dst=None):
    _check_group(group)
    return R.send(tensor, dst if dst is not None else group_dst, group)


def fake_irecv(tensor=None, src=None, group=None, tag=0, group_src=None):
    _check_group(group)
    return R.recv(tensor, src if src is not None else group_src, group)


class FakeP2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.peer = peer if peer is not None else group_peer


def fake_batch_isend_irecv(p2p_op_list):
    R.events.append("[")
    works = []
    for op in p2p_op_list:
        if op.op is fake_isend:
            works.append(fake_isend(op.tensor, op.peer, op.group))
        elif op.op is fake_irecv:
            works.append(fake_irecv(op.tensor, op.peer, op.group))
        else:
            raise AssertionError(f"unexpected P2POp op {op.op!r}")
    R.events.append("]")
    return works


def _cpu_kwargs(kw):
    d = kw.get("device")
    if d is not None and (str(d).startswith("cuda") or isinstance(d, int)):
        kw["device"] = "cpu"
    return kw


_orig_zeros, _orig_empty = torch.zeros, torch.empty


def cpu_zeros(*a, **kw):
    return _orig_zeros(*a, **_cpu_kwargs(kw))


def cpu_empty(*a, **kw):
    return _orig_empty(*a, **_cpu_kwargs(kw))


# --------------------------------------------------------------------------- compute stubs
def _unwrap(x):
    if isinstance(x, (list, tuple)):
        assert len(x) == 1, f"expected one tensor, got {len(x)}"
        return x[0]
    return x


def fake_forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    config,
    cp_group_size=None,
    collect_non_loss_data=False,
    checkpoint_activations_microbatch=None,
    is_first_microbatch=False,
    current_microbatch=None,
    vp_stage=None,
    is_last_stage=True,
):
    c = 0 if vp_stage is None else vp_stage
    m = current_microbatch
    stage = c * R.pp + R.rank
    R.events.append(f"F{c}.{m}")
    inp = _unwrap(input_tensor)
    if stage > 0:
        R.consume(inp, f"a{stage - 1}.{m}", f"F{c}.{m}")
    elif inp is not None:
        R.anomalies.append(f"F{c}.{m}: first stage got an input tensor")
    out = R.new_tensor(f"a{stage}.{m}")
    num_tokens = torch.tensor(0, dtype=torch.int)
    if isinstance(input_tensor, list):
        return [out], num_tokens
    return out, num_tokens


def _backward_common(input_tensor, output_tensor, output_tensor_grad):
    """Returns (token_cm, input_tensor_grad, grad_tensor)."""
    out = _unwrap(output_tensor)
    tag = R.tag_of(out)
    assert tag is not None and tag[0] == "a", f"backward of untagged output {out!r}"
    stage, m = (int(v) for v in tag[1:].split("."))
    c = (stage - R.rank) // R.pp
    og = _unwrap(output_tensor_grad)
    if stage < R.pp * R.vpp - 1:
        R.consume(og, f"g{stage + 1}.{m}", f"B{c}.{m}")
    elif og is not None:
        R.anomalies.append(f"B{c}.{m}: last stage got an output grad")
    grad = R.new_tensor(f"g{stage}.{m}")
    inp = _unwrap(input_tensor)
    ig = None if inp is None else grad
    if isinstance(input_tensor, list):
        ig = [ig]
    return f"{c}.{m}", ig, grad


def fake_backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    cm, ig, _ = _backward_common(input_tensor, output_tensor, output_tensor_grad)
    R.events.append(f"B{cm}")
    return ig


def fake_combined_1f1b_schedule_for_interleaved_pipelining(
    config,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    forward_data_store,
    forward_step_helper_preprocess,
    forward_step_helper_postprocess,
    backward_step_helper_preprocess,
    backward_step_helper_postprocess,
    get_microbatch_id_in_model_chunk,
    get_model_chunk_id,
    check_first_val_step,
    is_first_microbatch_for_model_chunk,
    collect_non_loss_data,
    f_virtual_microbatch_id=None,
    b_virtual_microbatch_id=None,
    pre_forward=None,
    pre_backward=None,
    post_forward=None,
    post_backward=None,
):
    # -- as combined_1f1b_schedule_for_interleaved_pipelining: preprocess both halves
    fc = fm = None
    input_tensor = None
    if f_virtual_microbatch_id is not None:
        fm = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
        fc = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
        input_tensor = forward_step_helper_preprocess(f_virtual_microbatch_id, fc, fm)
    bc = None
    if b_virtual_microbatch_id is not None:
        bc = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
        b_in, b_out, b_out_grad = backward_step_helper_preprocess(b_virtual_microbatch_id, bc)
    # -- as TransformerModelChunkSchedulePlan.run
    if fc is not None and pre_forward is not None:
        pre_forward(fc)
    if bc is not None and pre_backward is not None:
        pre_backward(bc)
    f_out = None
    if fc is not None:
        stage = fc * R.pp + R.rank
        inp = _unwrap(input_tensor)
        if stage > 0:
            R.consume(inp, f"a{stage - 1}.{fm}", f"F{fc}.{fm}")
        f_out = R.new_tensor(f"a{stage}.{fm}")
    ig = b_grad = None
    if bc is not None:
        bcm, ig, b_grad = _backward_common(b_in, b_out, b_out_grad)
        assert bcm.split(".")[0] == str(bc), (bcm, bc)
    if fc is not None and bc is not None:
        R.events.append(f"X{fc}.{fm}/{bcm}")
    elif fc is not None:
        R.events.append(f"F{fc}.{fm}")
    elif bc is not None:
        R.events.append(f"B{bcm}")
    if fc is not None and post_forward is not None:
        post_forward(f_out, fc)  # return value unused, as in run()
    if bc is not None and post_backward is not None:
        post_backward(b_grad, bc)
    # -- as combined_forward_backward_step / combined_1f1b_...: postprocess
    output_tensor = None
    if fc is not None:
        output_tensor = f_out if not isinstance(input_tensor, list) else [f_out]
        forward_step_helper_postprocess(fc, output_tensor, torch.tensor(0, dtype=torch.int))
    if bc is not None:
        backward_step_helper_postprocess(b_virtual_microbatch_id)
    return output_tensor, ig


# --------------------------------------------------------------------------- patching
def install_patches():
    schedules.forward_step = fake_forward_step
    schedules.backward_step = fake_backward_step
    schedules.combined_1f1b_schedule_for_interleaved_pipelining = (
        fake_combined_1f1b_schedule_for_interleaved_pipelining
    )
    dist.isend = fake_isend
    dist.irecv = fake_irecv
    dist.batch_isend_irecv = fake_batch_isend_irecv
    dist.P2POp = FakeP2POp
    dist.is_initialized = lambda: True
    dist.get_global_rank = lambda group, group_rank: group_rank
    dist.get_backend = lambda group=None: "nccl"
    dist.group = types.SimpleNamespace(WORLD=FAKE_WORLD)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.zeros = cpu_zeros
    torch.empty = cpu_empty


class Chunk(torch.nn.Module):
    def __init__(self, config, vp_stage):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage


def make_config(pp, vpp, g, mode, combined):
    batch, overlap, flush, deallocate = MODES[mode]
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        microbatch_group_size_per_vp_stage=g,
        batch_p2p_comm=batch,
        overlap_p2p_comm=overlap,
        overlap_p2p_comm_warmup_flush=flush,
        batch_p2p_sync=False,
        deallocate_pipeline_outputs=deallocate,
        variable_seq_lengths=False,
        pipeline_dtype=torch.float32,
        overlap_moe_expert_parallel_comm=combined,
    )
    config.hidden_size = HIDDEN  # TransformerConfig field read by the schedules
    return config


SEQ, MBS, HIDDEN = 4, 1, 2


def run_config(fn, pp, vpp, M, g, fo, combined, mode):
    """Returns (list of rank strings, None, anomalies) or (None, error string, anomalies)."""
    global R
    anomalies = []
    ranks = []
    for rank in range(pp):
        if fn == "interleaved":
            config = make_config(pp, vpp, g, mode, combined)
            model = [Chunk(config, c) for c in range(vpp)]
            data = [None] * vpp
            func = schedules.forward_backward_pipelining_with_interleaving
        else:
            config = make_config(pp, None, None, mode, False)
            model = Chunk(config, None)
            data = None
            func = schedules.forward_backward_pipelining_without_interleaving
        R = Recorder(rank, pp)
        R.vpp = vpp if fn == "interleaved" else 1
        pgc = ProcessGroupCollection()
        pgc.tp = FakeGroup(0, 1)
        pgc.cp = FakeGroup(0, 1)
        p2p = P2PCommunicator(pp_group=FakeGroup(rank, pp), config=config)
        try:
            func(
                forward_step_func=None,
                data_iterator=data,
                model=model,
                num_microbatches=M,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=fo,
                p2p_communicator=p2p,
                pg_collection=pgc,
            )
        except Exception as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == SCRIPT:
                raise  # a bug in this recorder, not Megatron refusing the config
            msg = " ".join(str(e).split("\n"))
            return None, f"{type(e).__name__}: {msg}", anomalies
        anomalies += [f"rank {rank}: {a}" for a in R.anomalies]
        ranks.append(R.render())
        R = None
    return ranks, None, anomalies


# --------------------------------------------------------------------------- grid
def g_sample(pp, M):
    """Deterministic group sizes for one (pp, M): pp, pp+1, middle, M (when legal)."""
    if M < pp:
        return [pp]  # g > M: refused by Megatron
    return sorted({pp, min(pp + 1, M), (pp + M) // 2, M})


def interleaved_tuples():
    """(pp, vpp, M, g) in output order.

    pp=2: vpp 2..4, every M in 1..4pp, every g in pp..M (g=pp when M<pp: refused).
    pp=3,4: vpp {2,3} resp. {2,4}, every M in 1..4pp, g from g_sample.
    pp=5..9: one vpp per pp (5:2 6:3 7:4 8:5 9:6); M in {pp-1, pp, pp+1, 2pp, 2pp+1, 3pp}.
    pp=10..16: vpp 2 (even pp) or 3 (odd pp); M in {pp-1, pp, pp+1, 2pp, 2pp+1}.
    For pp>=5, g per M: pp-1:[pp] pp:[pp] pp+1:[pp,pp+1] 2pp:[pp,pp+1] 2pp+1:[pp,pp+1]
    3pp:[pp,2pp] (this includes refused remainders: 2pp%(pp+1), (2pp+1)%pp).
    """
    out = []
    for pp in range(2, 17):
        if pp <= 4:
            vpps = {2: [2, 3, 4], 3: [2, 3], 4: [2, 4]}[pp]
            Ms = list(range(1, 4 * pp + 1))
        elif pp <= 9:
            vpps = [pp - 3]
            Ms = [pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1, 3 * pp]
        else:
            vpps = [2 if pp % 2 == 0 else 3]
            Ms = [pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1]
        for vpp in vpps:
            for M in Ms:
                if pp == 2:
                    gs = list(range(pp, M + 1)) if M >= pp else [pp]
                elif pp <= 4:
                    gs = g_sample(pp, M)
                elif M == 3 * pp:
                    gs = [pp, 2 * pp]
                else:
                    gs = [g for g in (pp, pp + 1) if g <= M] or [pp]
                for g in gs:
                    out.append((pp, vpp, M, g))
    return out


def onef1b_pairs():
    """(pp, M): pp 2..5 every M in 1..4pp; pp 6..9 M in {1, pp-1, pp, pp+1, 2pp, 2pp+1, 3pp};
    pp 10..16 M in {1, pp-1, pp, pp+1, 2pp, 2pp+1}."""
    out = []
    for pp in range(2, 17):
        if pp <= 5:
            Ms = range(1, 4 * pp + 1)
        elif pp <= 9:
            Ms = [1, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1, 3 * pp]
        else:
            Ms = [1, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1]
        out += [(pp, M) for M in Ms]
    return out


def grid():
    """Yields (fn, pp, vpp, M, g, fo, combined, mode) in output order."""
    for pp, vpp, M, g in interleaved_tuples():
        for fo in (0, 1):
            for combined in (0, 1) if fo == 0 else (0,):
                for mode in MODES:
                    yield ("interleaved", pp, vpp, M, g, fo, combined, mode)
    for pp, M in onef1b_pairs():
        for fo in (0, 1):
            for mode in ("batched", "unbatched"):
                yield ("1f1b", pp, 1, M, None, fo, 0, mode)


def head(fn, pp, vpp, M, g, fo, combined, mode):
    gs = "-" if g is None else str(g)
    return f"{fn} pp={pp} vpp={vpp} m={M} g={gs} fo={fo} combined={combined} mode={mode}"


def record(out_path, only):
    install_patches()
    cmd = "python tests/golden/megatron/record.py" + (f" --only '{only}'" if only else "")
    lines = [
        f"# megatron-core {megatron.core.__version__} torch {torch.__version__} command: {cmd}"
    ]
    n_err = 0
    anomalies_all = []
    rx = re.compile(only) if only else None
    for cfg in grid():
        h = head(*cfg)
        if rx and not rx.search(h):
            continue
        ranks, err, anomalies = run_config(*cfg)
        if err is not None:
            n_err += 1
            lines.append(f"{h} ! {err}")
        else:
            lines.append(h + "".join(f" | {r}" for r in ranks))
        anomalies_all += [f"{h}: {a}" for a in anomalies]
    size = write_lines_gz(out_path, lines)
    print(f"{len(lines) - 1} configs ({n_err} refused), {size} bytes -> {out_path}")
    print(f"{len(anomalies_all)} consumption anomalies")
    for a in anomalies_all[:50]:
        print("  ", a)


def write_lines_gz(out_path: str, lines: list[str]) -> int:
    """Write ``lines`` (one per line) gzipped with no timestamp or name, so that a recording
    is byte-identical from run to run; the bytes written."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))
    with open(out_path, "wb") as f:
        f.write(buf.getvalue())
    return len(buf.getvalue())


# --------------------------------------------------------------------------- checks
TOKEN = re.compile(r"^([sr])(\d+):(\d+):([^:]+)(:W)?$")


def parse_line(line):
    if " ! " in line:
        h, err = line.split(" ! ", 1)
        return h, None, err
    parts = line.split(" | ")
    return parts[0], [p.split() for p in parts[1:]], None


def fifo_check(ranks):
    """Match sends to recvs FIFO per (src, dst, group). Returns list of problems."""
    chans = defaultdict(lambda: ([], []))  # key -> (send payloads, recv payloads)
    for rank, toks in enumerate(ranks):
        for t in toks:
            mt = TOKEN.match(t)
            if not mt:
                continue
            kind, _, peer, payload, w = mt.groups()
            peer = int(peer)
            if kind == "s":
                chans[(rank, peer, bool(w))][0].append(payload)
            else:
                chans[(peer, rank, bool(w))][1].append(payload)
    problems = []
    for (src, dst, w), (sends, recvs) in sorted(chans.items()):
        ch = f"{src}->{dst}" + (" WORLD" if w else "")
        for i in range(max(len(sends), len(recvs))):
            s = sends[i] if i < len(sends) else None
            r = recvs[i] if i < len(recvs) else None
            if s is None:
                problems.append(f"{ch} #{i}: recv {r} has no send")
            elif r is None:
                problems.append(f"{ch} #{i}: send {s} has no recv")
            elif r == "?":
                problems.append(f"{ch} #{i}: send {s} matched an unconsumed recv")
            elif s != r:
                problems.append(f"{ch} #{i}: send {s} matched recv expecting {r}")
    return problems


def progress_check(ranks):
    """Replay all ranks with rendezvous semantics: ops are issued without blocking, w<h> blocks
    until the FIFO-matching op (same (src, dst, group) channel, same position) has been issued
    by the peer. Returns None if every rank reaches its end, else a description of where each
    rank is stuck. Also returns the number of send/recv handles never waited."""
    match_pos = {}  # (rank, h) -> (peer, channel key, index)
    counts = defaultdict(int)
    for rank, toks in enumerate(ranks):
        for t in toks:
            mt = TOKEN.match(t)
            if mt:
                kind, h, peer, _, w = mt.groups()
                peer = int(peer)
                key = (rank, peer, bool(w)) if kind == "s" else (peer, rank, bool(w))
                idx = counts[(key, kind)]
                counts[(key, kind)] += 1
                match_pos[(rank, int(h))] = (peer, key, "r" if kind == "s" else "s", idx)
    issued = defaultdict(int)  # (key, kind) -> number issued so far
    ptr = [0] * len(ranks)
    unwaited = 0
    for rank, toks in enumerate(ranks):
        hs = {int(t[1:].split(":")[0]) for t in toks if TOKEN.match(t)}
        unwaited += len(hs - {int(t[1:]) for t in toks if t[0] == "w"})
    while True:
        moved = False
        for rank, toks in enumerate(ranks):
            while ptr[rank] < len(toks):
                t = toks[ptr[rank]]
                mt = TOKEN.match(t)
                if mt:
                    kind, _, peer, _, w = mt.groups()
                    peer = int(peer)
                    key = (rank, peer, bool(w)) if kind == "s" else (peer, rank, bool(w))
                    issued[(key, kind)] += 1
                elif t[0] == "w":
                    peer, key, other, idx = match_pos[(rank, int(t[1:]))]
                    if issued[(key, other)] <= idx:
                        break  # blocked
                ptr[rank] += 1
                moved = True
        if all(ptr[r] == len(ranks[r]) for r in range(len(ranks))):
            return None, unwaited
        if not moved:
            stuck = [
                f"rank {r} at {ranks[r][ptr[r]]}"
                for r in range(len(ranks))
                if ptr[r] < len(ranks[r])
            ]
            return "; ".join(stuck), unwaited


def selfcheck(in_path):
    n = bad = stuck_n = 0
    unwaited_cfgs = 0
    with gzip.open(in_path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.startswith("#"):
                continue
            h, ranks, err = parse_line(line.rstrip("\n"))
            if err is not None:
                continue
            n += 1
            problems = fifo_check(ranks)
            if problems:
                bad += 1
                print(f"{h}: {len(problems)} FIFO problems; first: {problems[0]}")
            stuck, unwaited = progress_check(ranks)
            if stuck:
                stuck_n += 1
                print(f"{h}: DEADLOCK under rendezvous semantics: {stuck}")
            unwaited_cfgs += unwaited > 0
    print(
        f"selfcheck: {n} recorded configs, {bad} with FIFO problems, {stuck_n} deadlocking, "
        f"{unwaited_cfgs} with isend handles never waited (informational)"
    )
    return bad


def to_trace(toks, pp, rank):
    """Convert rank tokens to the conformance JSON 'order' and comm groups."""
    order, comms, cur = [], [], None
    batch = False

    def chunk_of(kind, payload, recv):
        stage, mb = (int(v) for v in payload[1:].split("."))
        if recv:  # a consumer's chunk
            stage = stage + 1 if payload[0] == "a" else stage - 1
        return [(stage - rank) // pp, mb]

    for t in toks:
        if t[0] in "FB" and "." in t:
            c, m = t[1:].split(".")
            order.append([t[0], int(c), int(m)])
            cur = None
        elif t == "[":
            batch, cur = True, {}
            comms.append(cur)
        elif t == "]":
            batch, cur = False, None
        elif t[0] in "sr":
            kind, _, _, payload, _ = TOKEN.match(t).groups()
            if kind == "s":
                key = "send_next" if payload[0] == "a" else "send_prev"
            else:
                key = "recv_prev" if payload[0] == "a" else "recv_next"
            if not batch and cur is None:
                cur = {}
                comms.append(cur)
            cur[key] = chunk_of(kind, payload, kind == "r") if payload != "?" else "?"
        elif t[0] == "w" and not batch:
            cur = None
    return order, comms


def spotcheck(dirpath):
    install_patches()
    ok = True
    cases = [
        ("interleaved_pp4_vpp2_m8_g4.json", ("interleaved", 4, 2, 8, 4)),
        ("1f1b_pp4_m8.json", ("1f1b", 4, 1, 8, None)),
    ]
    for fname, (fn, pp, vpp, M, g) in cases:
        with open(os.path.join(dirpath, fname)) as f:
            ref = json.load(f)
        ranks, err, anomalies = run_config(fn, pp, vpp, M, g, 0, 0, "batched")
        assert err is None, err
        for rank, rr in enumerate(ref["ranks"]):
            toks = ranks[rank].split()
            order, comms = to_trace(toks, pp, rank)
            ref_comms = [
                {k: v for k, v in e.items() if k != "comm"}
                for e in rr["trace"]
                if isinstance(e, dict)
            ]
            ref_comms = [c for c in ref_comms if c]
            same_order = order == rr["order"]
            same_comms = comms == ref_comms
            ok &= same_order and same_comms
            print(
                f"{fname} rank {rank}: order {'OK' if same_order else 'DIFF'}, "
                f"comms {'OK' if same_comms else 'DIFF'} ({len(comms)} vs {len(ref_comms)})"
            )
            if not same_comms:
                for i, (a, b) in enumerate(zip(comms, ref_comms)):
                    if a != b:
                        print(f"   first diff at comm {i}: ours {a} ref {b}")
                        break
        print(f"   anomalies: {anomalies}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(SCRIPT)
    ap.add_argument("--out", default=os.path.join(here, "calls.txt.gz"))
    ap.add_argument("--only", default=None, help="regex on the config header")
    ap.add_argument("--selfcheck", action="store_true")
    ap.add_argument("--in", dest="inp", default=os.path.join(here, "calls.txt.gz"))
    ap.add_argument("--spotcheck", default=None, metavar="DIR")
    a = ap.parse_args()
    if a.selfcheck:
        sys.exit(1 if selfcheck(a.inp) else 0)
    if a.spotcheck:
        sys.exit(0 if spotcheck(a.spotcheck) else 1)
    if a.only and a.out == ap.get_default("out"):
        ap.error("--only needs an explicit --out (do not overwrite the golden file)")
    record(a.out, a.only)


if __name__ == "__main__":
    main()
