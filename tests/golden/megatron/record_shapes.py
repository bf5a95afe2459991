#!/usr/bin/env python3
"""Record megatron-core's shape exchange (``config.variable_seq_lengths=True``) as golden data.

With ``variable_seq_lengths`` every ``P2PCommunicator._communicate`` call first runs
``_communicate_shapes``: the shapes of the tensors the call sends, and buffers for the shapes of
those it receives, posted as one ``batch_isend_irecv``, waited, then ``torch.cuda.synchronize()``.
This script runs megatron-core's real ``forward_backward_pipelining_with_interleaving`` and
``..._without_interleaving`` UNCHANGED, one pipeline rank at a time, with exactly the patches of
``record.py`` (compute, ``torch.distributed``'s P2P primitives and their ``wait()``, process
groups, devices; see its docstring) and ``variable_seq_lengths=True``. Megatron's own
``_communicate_shapes``, ``_communicate``, ``_p2p_ops`` and ``_batched_p2p_ops`` run for real.

What this script adds to ``record.py``'s recorder, and nothing else:
  * every tensor a recording ``forward_step`` / ``backward_step`` makes has the shape
    ``(0, n, 1)``, n naming it (no elements): the shape Megatron reads with ``.size()`` and
    sends says which tensor it announces. A sent shape is recorded with that tensor's name.
  * a received shape buffer (int64, 3 elements) is filled with ``(0, 1, BASE + h)``, h the
    receive's handle: Megatron sizes the data buffer from it with ``torch.empty``, so the
    receive posted with that buffer names the shape receive it was sized by, and the shape
    receive is recorded with the tensor that buffer turns out to carry (when compute consumes
    it, as ``record.py`` names every receive).
  * ``torch.cuda.synchronize()`` is recorded as ``S`` (a no-op here; on a GPU it waits for every
    kernel of the device, NCCL's in-flight receives and sends included).

Output (gzip, UTF-8, one config per line, deterministic):
  line 1: "# megatron-core <v> torch <v> command: <cmd>"
  <fn> pp=<pp> vpp=<vpp|1> m=<M> g=<g|-> fo=<0|1> combined=<0|1> mode=<mode> | <rank0> | ...
  or   <same fields> ! <ExceptionType>: <message>
  rank tokens: record.py's, plus shape ops  s<h>:<peer>:S<payload>  r<h>:<peer>:S<payload>
  (payload a<stage>.<mb> or g<stage>.<mb>: the tensor whose shape it is; ? if never known)
  and S (torch.cuda.synchronize).

The grid (``grid()``): 1F1B at pp 1-8 (pp = 1 runs the same function: no P2P call), M in
{1, pp, pp+1, 2pp}, training and forward-only, P2P modes batched and unbatched; interleaved at
pp 2-8, vpp 2 and 3, M in {pp, 2pp, 3pp}, group size pp (and pp+1 at M = 2pp), training
(plain and combined 1F1B) and forward-only, all six P2P modes of record.py's MODES.

Usage:
  python record_shapes.py [--out shapes.txt.gz] [--only REGEX]
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron.core
import record  # tests/golden/megatron/record.py: its fakes, patches and grid helpers
import torch

SCRIPT = os.path.abspath(__file__)
BASE = 1 << 20  # received shapes name their handle above this (data tensors count from 1)


class ShapeRecv(record.Recv):
    """A received shape: recorded with the payload of the data receive it sized."""

    __slots__ = ("data",)

    def __init__(self, h, peer, world):
        super().__init__(h, peer, world)
        self.data = None

    def token(self):
        p = self.data.payload if self.data is not None and self.data.payload else "?"
        return f"r{self.h}:{self.peer}:S{p}" + (":W" if self.world else "")


def is_shape_buffer(t):
    return t.dtype == torch.int64 and tuple(t.shape) == (3,)


class ShapeRecorder(record.Recorder):
    def __init__(self, rank, pp):
        super().__init__(rank, pp)
        self.names = []  # n - 1 -> tag of the tensor of shape (0, n, 1)
        self.shape_recvs = {}  # handle -> ShapeRecv

    def new_tensor(self, tag):
        self.names.append(tag)
        t = torch.zeros((0, len(self.names), 1), requires_grad=True)
        self.tags[id(t)] = tag
        self.keep.append(t)
        return t

    def send(self, tensor, peer, group):
        if not is_shape_buffer(tensor):
            return super().send(tensor, peer, group)
        h = self.next_h
        self.next_h += 1
        z, n, one = tensor.tolist()
        if z == 0 and one == 1 and 1 <= n <= len(self.names):
            tag = self.names[n - 1]
        else:
            tag = "?"
            self.anomalies.append(f"s{h}: a shape {tensor.tolist()} of no recorded tensor")
        self.events.append(f"s{h}:{peer}:S{tag}" + (":W" if group is record.FAKE_WORLD else ""))
        return record.FakeWork(self, h)

    def recv(self, tensor, peer, group):
        if is_shape_buffer(tensor):
            h = self.next_h
            self.next_h += 1
            rv = ShapeRecv(h, peer, group is record.FAKE_WORLD)
            tensor.copy_(torch.tensor([0, 1, BASE + h], dtype=torch.int64))
            self.shape_recvs[h] = rv
            self.keep.append(tensor)
            self.events.append(rv)
            return record.FakeWork(self, h)
        work = super().recv(tensor, peer, group)
        data = self.recvs[id(tensor)]
        s = tuple(tensor.shape)
        if len(s) == 3 and s[0] == 0 and s[1] == 1 and s[2] >= BASE:
            sr = self.shape_recvs.get(s[2] - BASE)
            if sr is None or sr.data is not None:
                self.anomalies.append(f"r{data.h}: sized by no single shape receive {s}")
            else:
                sr.data = data
        else:
            self.anomalies.append(f"r{data.h}: buffer of shape {s} sized by no shape receive")
        return work


def synchronize(*a, **k):
    record.R.events.append("S")


def install_patches():
    record.install_patches()
    record.Recorder = ShapeRecorder  # run_config makes one per rank
    torch.cuda.synchronize = synchronize
    make = record.make_config

    def make_config(*a, **k):
        config = make(*a, **k)
        config.variable_seq_lengths = True
        return config

    record.make_config = make_config


def grid():
    """Yields (fn, pp, vpp, M, g, fo, combined, mode) in output order."""
    for pp in range(2, 9):
        for vpp in (2, 3):
            for M in (pp, 2 * pp, 3 * pp):
                for g in (pp, pp + 1) if M == 2 * pp else (pp,):
                    for fo in (0, 1):
                        for combined in (0, 1) if fo == 0 else (0,):
                            for mode in record.MODES:
                                yield ("interleaved", pp, vpp, M, g, fo, combined, mode)
    for pp in range(1, 9):
        for M in sorted({1, pp, pp + 1, 2 * pp}):
            for fo in (0, 1):
                for mode in ("batched", "unbatched"):
                    yield ("1f1b", pp, 1, M, None, fo, 0, mode)


def record_grid(out_path, only):
    install_patches()
    cmd = "python tests/golden/megatron/record_shapes.py" + (f" --only '{only}'" if only else "")
    version = megatron.core.__version__.split("+")[0]
    lines = [f"# megatron-core {version} torch {torch.__version__} command: {cmd}"]
    n_err = 0
    anomalies = []
    rx = re.compile(only) if only else None
    for cfg in grid():
        h = record.head(*cfg)
        if rx and not rx.search(h):
            continue
        ranks, err, an = record.run_config(*cfg)
        if err is not None:
            n_err += 1
            lines.append(f"{h} ! {err}")
        else:
            lines.append(h + "".join(f" | {r}" for r in ranks))
        anomalies += [f"{h}: {a}" for a in an]
    size = record.write_lines_gz(out_path, lines)
    print(f"{len(lines) - 1} configs ({n_err} refused), {size} bytes -> {out_path}")
    print(f"{len(anomalies)} anomalies")
    for a in anomalies[:50]:
        print("  ", a)
    return not anomalies


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(SCRIPT)
    ap.add_argument("--out", default=os.path.join(here, "shapes.txt.gz"))
    ap.add_argument("--only", default=None, help="regex on the config header")
    a = ap.parse_args()
    if a.only and a.out == ap.get_default("out"):
        ap.error("--only needs an explicit --out (do not overwrite the golden file)")
    sys.exit(0 if record_grid(a.out, a.only) else 1)


if __name__ == "__main__":
    main()
