#!/usr/bin/env python3
"""Time torch.distributed.pipelining's own Python path for an interleaved 1F1B schedule and
pipec's `compile` (generate, lower, verify, write JSON) on the same schedule.

torch's ScheduleInterleaved1F1B constructor computes every rank's order
(`_calculate_single_rank_operations`) and lowers it for `_PipelineScheduleRuntime`
(`_prepare_schedule_with_comms`: `_validate_schedule`, `_add_send_recv` and, in torch 2.15,
the comm/compute simulation); we also time `_validate_schedule`, `_add_send_recv` and
`_simulate_comms_compute` on their own. Stages are mocks, as torch's own test_schedule.py
does, so no process group is needed.

Usage: python bench/torch_compare.py [PIPEC_BINARY]   (needs torch; not part of CI)
"""

import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase


class MockStage(_PipelineStageBase):
    """The mock of torch's test_schedule.py: only the attributes schedules read."""

    def __init__(self, group_size, group_rank, num_stages, stage_index):
        self.submod = None
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None
        self.stage_index = stage_index

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, n_microbatches):
        pass

    def _prepare_backward_infra(self, n_microbatches):
        pass


def torch_times(pp, vpp, m):
    stages = [MockStage(pp, 0, pp * vpp, c * pp) for c in range(vpp)]
    t0 = time.perf_counter()
    sched = S.ScheduleInterleaved1F1B(stages, m)
    construct = time.perf_counter() - t0
    order = sched.pipeline_order
    t0 = time.perf_counter()
    S._validate_schedule(order, pp, pp * vpp, m)
    validate = time.perf_counter() - t0
    compute = {r: [a for a in acts if a is not None] for r, acts in order.items()}
    t0 = time.perf_counter()
    comms = S._add_send_recv(compute, lambda s: s % pp, pp * vpp)
    add = time.perf_counter() - t0
    t0 = time.perf_counter()
    S._simulate_comms_compute(comms, lambda s: s % pp, pp * vpp)
    simulate = time.perf_counter() - t0
    return construct, validate, add, simulate


def pipec_time(binary, pp, vpp, m):
    best = None
    for _ in range(3):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            subprocess.run(
                [
                    binary,
                    "compile",
                    "--schedule",
                    "interleaved-1f1b",
                    "--pp",
                    str(pp),
                    "--vpp",
                    str(vpp),
                    "--microbatches",
                    str(m),
                    "-o",
                    os.path.join(d, "s"),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
    return best


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/pipec"
    print(f"torch {torch.__version__}")
    # torch's path = constructor (order + _validate_schedule + _add_send_recv, which it calls)
    # + _simulate_comms_compute; validate and add_send_recv are also shown alone, not added.
    print(
        f"{'size':<22} {'torch ctor s':>12} {'validate s':>10} {'add_send_recv s':>15} "
        f"{'simulate s':>10} {'torch path s':>12} {'pipec compile s':>15} {'speedup':>8}"
    )
    for name, pp, vpp, m in [
        ("S pp=8 vpp=2 M=64", 8, 2, 64),
        ("pp=16 vpp=2 M=128", 16, 2, 128),
        ("M pp=32 vpp=4 M=256", 32, 4, 256),
    ]:
        c, v, a, s = torch_times(pp, vpp, m)
        p = pipec_time(binary, pp, vpp, m)
        total = c + s
        print(
            f"{name:<22} {c:>12.3f} {v:>10.3f} {a:>15.3f} {s:>10.3f} {total:>12.3f} {p:>15.4f} "
            f"{total / p:>7.0f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
