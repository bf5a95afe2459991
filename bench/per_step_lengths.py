"""Issue #38's per-step planning from Python: the time of ``pipec.tune(..., lengths=...)`` (and
of ``pipec.compile(..., lengths=...)`` where this build has it) at pp=8, M=64 and pp=32,
M=512, median of several runs with fresh lengths every run, as a training loop would call it.
Prints figures, asserts nothing (bench/HISTORY.md).

    python bench/per_step_lengths.py [RUNS]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import pipec

COST = "seq=8192,f=1,b=1,w=1,t.attn_f=0.25,t.attn_b=0.5,p2p=0.05"


def bimodal(rng: random.Random, m: int) -> list[int]:
    """Chat (100-1000 tokens) with one long-context sample (6k-8k) in five."""
    return [
        rng.randint(6144, 8192) if rng.random() < 0.2 else rng.randint(100, 1000) for _ in range(m)
    ]


def median_ms(runs: int, call) -> float:
    call(0)
    times = []
    for i in range(runs):
        t = time.perf_counter()
        call(i + 1)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    rng = random.Random(38)
    steps = {m: [bimodal(rng, m) for _ in range(runs + 1)] for m in (64, 512)}
    try:
        ms = median_ms(
            runs,
            lambda i: pipec.compile(
                "interleaved-1f1b", pp=8, microbatches=64, vpp=2, lengths=steps[64][i]
            ),
        )
        print(f"pipec.compile interleaved-1f1b pp=8 vpp=2 M=64 lengths=: {ms:.2f} ms")
    except TypeError:
        print("pipec.compile has no lengths= in this build")
    for pp, m in ((8, 64), (32, 512)):
        n = runs if m <= 64 else max(3, runs // 3)
        ms = median_ms(
            n, lambda i, pp=pp, m=m: pipec.tune(pp, None, cost=COST, lengths=steps[m][i])
        )
        ms0 = median_ms(n, lambda i, pp=pp, m=m: pipec.tune(pp, m, cost=COST))
        print(f"pipec.tune pp={pp} M={m}: {ms:.1f} ms with lengths, {ms0:.1f} ms without")


if __name__ == "__main__":
    main()
