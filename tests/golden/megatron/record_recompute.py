#!/usr/bin/env python3
"""Record megatron-core's own partial-recompute decision per forward as golden data for pipec.

With ``ModelParallelConfig.num_microbatches_with_partial_activation_checkpoints`` = N, Megatron's
``forward_backward_pipelining_without_interleaving`` (1F1B) and ``..._with_interleaving`` compute,
before each forward, ``checkpoint_activations_microbatch`` and hand it to ``forward_step``, which
passes it on to the user's ``forward_step_func`` as a third argument (when it is not None). This
script runs those functions UNCHANGED, one pipeline rank at a time, with the patches of
``record.py`` (compute, ``torch.distributed``'s P2P primitives, process-group and device plumbing;
see its docstring), and records, for every forward, the value Megatron passed to
``schedules.forward_step``. ``forward_backward_no_pipelining`` (pp = 1) is recorded too.

Every configuration is run first with N = None (megatron-core's default), then with each N; the
script checks that N changes nothing else: every rank's compute and P2P calls, as record.py
renders them, and any refusal are those of N = None (exit 1 and the configs named otherwise).

Output (gzip, UTF-8, one config per line, deterministic):
  line 1: "# megatron-core <v> torch <v> command: <cmd>"
  <fn> pp=<pp> vpp=<vpp|1> m=<M> g=<g|-> fo=<0|1> mode=<mode> n=<N|none> | <rank0> | <rank1> ...
  or   <same fields> ! <ExceptionType>: <message>
  <fn> is interleaved, 1f1b or nopipe; rank tokens, in the order of Megatron's forward_step
  calls on that rank: <c>.<m>@<k>=<flag>, c the model chunk (vp_stage, 0 without
  interleaving), m the microbatch, k the forward's position on the rank (0, 1, ...), flag
  1 (True), 0 (False) or - (None: not passed).

Usage:
  python record_recompute.py [--out recompute.txt.gz] [--only REGEX]
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron.core
import record  # tests/golden/megatron/record.py: its fakes and patches
import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

SCRIPT = os.path.abspath(__file__)
FLAGS = []  # (chunk, microbatch, flag) of each forward_step call of the current rank


def flag_token(flag):
    if flag is None:
        return "-"
    assert flag is True or flag is False, f"unexpected flag {flag!r}"
    return "1" if flag else "0"


def recording_forward_step(*args, checkpoint_activations_microbatch=None, **kwargs):
    """record.fake_forward_step, noting the checkpoint flag Megatron passed."""
    vp_stage = kwargs.get("vp_stage")
    chunk = 0 if vp_stage is None else vp_stage
    FLAGS.append((chunk, kwargs.get("current_microbatch"), checkpoint_activations_microbatch))
    return record.fake_forward_step(*args, **kwargs)


def install_patches():
    record.install_patches()
    schedules.forward_step = recording_forward_step


def run_config(fn, pp, vpp, M, g, fo, mode, n):
    """Returns (list of rank strings, None, calls) or (None, error string, None); calls is
    record.py's rendering of each rank's compute and P2P calls."""
    ranks, calls = [], []
    for rank in range(pp):
        if fn == "interleaved":
            config = record.make_config(pp, vpp, g, mode, False)
            model = [record.Chunk(config, c) for c in range(vpp)]
            data = [None] * vpp
            func = schedules.forward_backward_pipelining_with_interleaving
        else:
            config = record.make_config(pp, None, None, mode, False)
            model = record.Chunk(config, None)
            data = None
            func = (
                schedules.forward_backward_pipelining_without_interleaving
                if fn == "1f1b"
                else schedules.forward_backward_no_pipelining
            )
        config.num_microbatches_with_partial_activation_checkpoints = n
        record.R = record.Recorder(rank, pp)
        record.R.vpp = vpp if fn == "interleaved" else 1
        FLAGS.clear()
        pgc = ProcessGroupCollection()
        pgc.tp = record.FakeGroup(0, 1)
        pgc.cp = record.FakeGroup(0, 1)
        p2p = P2PCommunicator(pp_group=record.FakeGroup(rank, pp), config=config)
        try:
            func(
                forward_step_func=None,
                data_iterator=data,
                model=model,
                num_microbatches=M,
                seq_length=record.SEQ,
                micro_batch_size=record.MBS,
                forward_only=fo,
                p2p_communicator=p2p,
                pg_collection=pgc,
            )
        except Exception as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            if os.path.abspath(tb.tb_frame.f_code.co_filename) in (SCRIPT, record.SCRIPT):
                raise  # a bug in this recorder, not Megatron refusing the config
            msg = " ".join(str(e).split("\n"))
            return None, f"{type(e).__name__}: {msg}", None
        assert not record.R.anomalies, record.R.anomalies
        calls.append(record.R.render())
        ranks.append(" ".join(f"{c}.{m}@{k}={flag_token(f)}" for k, (c, m, f) in enumerate(FLAGS)))
        record.R = None
    return ranks, None, calls


# --------------------------------------------------------------------------- grid
def n_values(total):
    """N from -1 (Megatron accepts a negative N) to total + 2 (past every window: a window is at
    most total + 1)."""
    return list(range(-1, total + 3))


def group_sizes(pp, M):
    """Megatron's default group size (pp) and, where M allows, pp + 1 and M."""
    if M < pp:
        return [pp]  # a group size above M is refused by Megatron
    return sorted({pp, min(pp + 1, M), M})


def grid():
    """Yields (fn, pp, vpp, M, g, fo, mode, Ns) in output order; each is recorded with
    N = None first, then with every N of Ns.

    1f1b: pp 2..8, M 1..3pp, training and forward-only, N -1..M+2.
    interleaved: pp 2..8, vpp 2..4, M 1..2pp and 3pp, group sizes pp (default), pp+1 and M
    (where M >= pp), training; forward-only at the default group size; N -1..M*vpp+2.
    P2P mode batched (megatron-core's default), and for pp <= 4 also overlap (Megatron-LM's
    training default for interleaving; pipec refuses batched at pp = 2).
    nopipe (pp = 1): M 1..4, training and forward-only, N -1..M+2.
    """
    for pp in range(2, 9):
        for M in range(1, 3 * pp + 1):
            for fo in (0, 1):
                yield ("1f1b", pp, 1, M, None, fo, "batched", n_values(M))
    for pp in range(2, 9):
        for vpp in (2, 3, 4):
            for M in [*range(1, 2 * pp + 1), 3 * pp]:
                for g in group_sizes(pp, M):
                    for fo in (0, 1) if g == pp else (0,):
                        for mode in ("batched", "overlap") if pp <= 4 else ("batched",):
                            yield ("interleaved", pp, vpp, M, g, fo, mode, n_values(M * vpp))
    for M in range(1, 5):
        for fo in (0, 1):
            yield ("nopipe", 1, 1, M, None, fo, "batched", n_values(M))


def head(fn, pp, vpp, M, g, fo, mode, n):
    gs = "-" if g is None else str(g)
    ns = "none" if n is None else str(n)
    return f"{fn} pp={pp} vpp={vpp} m={M} g={gs} fo={fo} mode={mode} n={ns}"


def record_grid(out_path, only):
    install_patches()
    cmd = "python tests/golden/megatron/record_recompute.py" + (f" --only '{only}'" if only else "")
    lines = [
        f"# megatron-core {megatron.core.__version__.split('+')[0]} torch {torch.__version__} command: {cmd}"
    ]
    n_err = 0
    reordered = []
    rx = re.compile(only) if only else None
    for *cfg, ns in grid():
        base = None
        for n in [None, *ns]:
            h = head(*cfg, n)
            if rx and not rx.search(h) and n is not None:
                continue
            ranks, err, calls = run_config(*cfg, n)
            if n is None:
                base = (err, calls)
                if rx and not rx.search(h):
                    continue
            elif (err, calls) != base:
                reordered.append(h)
            if err is not None:
                n_err += 1
                lines.append(f"{h} ! {err}")
            else:
                lines.append(h + "".join(f" | {r}" for r in ranks))
    size = record.write_lines_gz(out_path, lines)
    print(f"{len(lines) - 1} configs ({n_err} refused), {size} bytes -> {out_path}")
    for h in reordered:
        print(f"calls differ from the same config with N = None: {h}")
    return not reordered


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(SCRIPT)
    ap.add_argument("--out", default=os.path.join(here, "recompute.txt.gz"))
    ap.add_argument("--only", default=None, help="regex on the config header")
    a = ap.parse_args()
    if a.only and a.out == ap.get_default("out"):
        ap.error("--only needs an explicit --out (do not overwrite the golden file)")
    sys.exit(0 if record_grid(a.out, a.only) else 1)


if __name__ == "__main__":
    main()
