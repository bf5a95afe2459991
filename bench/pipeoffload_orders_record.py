"""Record the compute order of PipeOffload's grouped interleaved 1F1B (their
`group_interleaved_1f1b.create_schedule`, no offload, no recompute) over a grid, as the golden
data pipec's `group-interleaved` generator is checked against (tests/integration/schedules.rs).

Usage:
    python bench/pipeoffload_orders_record.py UPSTREAM > tests/golden/pipeoffload/orders.json

UPSTREAM as for `bench/pipeoffload_record.py` (whose loader this uses: their files imported
unchanged, `megatron.*` stand-ins). Per configuration, exactly what their runtime's interleaved
branch calls: `GraphConfig` with uniform costs (f = b = w = 1 on every rank), then
`create_schedule(config, cpu_offload=False, recompute_granularity=None, ...,
interleave_group_size=G, offload_chunk_num=0)`. Each rank's order is written as one string of
tokens `F5.3` = type (F, B = bwd_D, W = bwd_W), global virtual stage (`chunk * pp + rank`),
microbatch. Configurations their code refuses (an assertion) are recorded with `error`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeoffload_record as rec

# pp 1..8 (odd ones too); M below, at and above pp and non-multiples of the group; every chunk
# count their runtime takes and one; every group size their code accepts (1..pp).
PPS = (1, 2, 3, 4, 5, 6, 8)
VPPS = (1, 2, 3, 4)


def microbatches(pp):
    return sorted({1, 2, max(pp - 1, 1), pp, pp + 1, 2 * pp, 2 * pp + 3, 4 * pp})


def order(up, pp, m, vpp, g):
    cfg = rec.config(up, pp, m, vpp, 1.0)
    with contextlib.redirect_stdout(io.StringIO()):
        lo = up.group_interleaved_1f1b.create_schedule(
            cfg,
            cpu_offload=False,
            recompute_granularity=None,
            recompute_method=None,
            recompute_num_layers=None,
            interleave_group_size=g,
            offload_chunk_num=0,
        )
    return [
        " ".join(f"{up.COMPUTE[n.type]}{n.layer_group_idx}.{n.microbatch}" for n in nodes)
        for nodes in lo
    ]


def record(upstream):
    up = rec.Upstream(upstream)
    cases = {}
    for pp in PPS:
        for m in microbatches(pp):
            for vpp in VPPS:
                for g in range(1, pp + 1):
                    key = f"pp{pp}-m{m}-vpp{vpp}-g{g}"
                    try:
                        cases[key] = {"ranks": order(up, pp, m, vpp, g)}
                    except AssertionError as e:
                        cases[key] = {"error": f"AssertionError: {e}"}
    return {"commit": up.commit, "source": rec.SCHED + "/group_interleaved_1f1b.py", "cases": cases}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream")
    ap.add_argument("--allow-other-commit", action="store_true")
    a = ap.parse_args(argv)
    out = record(a.upstream)
    if out["commit"] != rec.EXPECTED_COMMIT and not a.allow_other_commit:
        sys.exit(f"their code is at {out['commit']}, recorded at {rec.EXPECTED_COMMIT}")
    rec.write(out, sys.stdout)


if __name__ == "__main__":
    main()
