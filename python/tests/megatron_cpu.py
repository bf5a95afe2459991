"""Test-only patches that let megatron-core 0.19.2's real schedule and model code run on a CPU
over gloo. Each patch counts its hits (``HITS``) so that the tests can check that it takes
effect: a megatron-core that no longer goes through one of them fails the tests loudly instead
of silently testing something else.

  1. ``torch.cuda.current_device`` -> ``"cpu"``: Megatron's P2P receive buffers.
  2. the CUDA RNG tracker's ``fork`` -> a no-op context: attention dropout (probability 0).
  3. ``torch.zeros`` / ``torch.empty`` with ``device="cuda..."`` -> CPU: the token counter
     every schedule function allocates.
  4. ``batch_p2p_sync=False`` in the model config (set by the tests); ``torch.cuda.synchronize``
     raises if Megatron calls it anyway, except where a test sets ``SHAPE_SYNC["allowed"]``:
     under ``variable_seq_lengths`` Megatron's shape exchange (``_communicate_shapes``)
     synchronizes after waiting every request, which on a CPU is nothing to do (counted in
     ``HITS["shape_sync"]``).

Import this module before building models or calling a schedule.
"""

from __future__ import annotations

import contextlib
import warnings

warnings.filterwarnings("ignore")

import torch
from megatron.core.tensor_parallel import random as _mrandom

HITS = {"current_device": 0, "rng_fork": 0, "cuda_device_arg": 0, "synchronize": 0, "shape_sync": 0}
SHAPE_SYNC = {"allowed": False}


def _current_device():
    HITS["current_device"] += 1
    return "cpu"


@contextlib.contextmanager
def _fork(self, name=None):
    HITS["rng_fork"] += 1
    yield


def _on_cpu(fn):
    def wrapped(*a, **kw):
        d = kw.get("device")
        if d is not None and str(d).startswith("cuda"):
            HITS["cuda_device_arg"] += 1
            kw["device"] = "cpu"
        return fn(*a, **kw)

    return wrapped


def _synchronize(*a, **k):
    if SHAPE_SYNC["allowed"]:
        HITS["shape_sync"] += 1
        return
    HITS["synchronize"] += 1
    raise AssertionError("torch.cuda.synchronize called although batch_p2p_sync=False")


torch.cuda.current_device = _current_device
_mrandom.CudaRNGStatesTracker.fork = _fork
torch.zeros, torch.empty = _on_cpu(torch.zeros), _on_cpu(torch.empty)
torch.cuda.synchronize = _synchronize
