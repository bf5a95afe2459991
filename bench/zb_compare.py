"""Compare `pipec tune` with the zero-bubble authors' scheduler on the recorded grid.

Usage: python bench/zb_compare.py PIPEC_BINARY [tests/golden/zb/auto_schedule.json]

For every case of the golden file (recorded from their code by `bench/zb_record.py`), runs
`pipec tune --target any --json` on their case with the mapping of docs/tune.md ("Against the
zero-bubble authors' scheduler"): pp stages of one decoder layer `t` with their f/b/w, `E` and
`L` what their first and last stage add, `p2p` their comm, `t.act = 1` and the limit in
activations. Prints, per grid and memory limit, how often tune is faster, equal or slower
than their makespan, overall and on their placement (one stage per rank: the best fitting
loop candidate with vpp = 1), then the slower cases, and the total time. Exit status 1 when
tune is slower on some case.
"""

import json
import subprocess
import sys
import time
from collections import defaultdict

TOL = 1e-9


def cost_spec(c):
    e, l = c["first"], c["last"]
    return (
        f"t.f={c['f']!r},t.b={c['b']!r},t.w={c['w']!r},p2p={c['comm']!r},t.act=1,"
        f"E.f={e[0]!r},E.b={e[1]!r},E.w={e[2]!r},L.f={l[0]!r},L.b={l[1]!r},L.w={l[2]!r}"
    )


def tune(binary, c):
    layout = "E" + "|".join(["t"] * c["pp"]) + "L"
    cmd = [
        binary,
        "tune",
        "--pp",
        str(c["pp"]),
        "--microbatches",
        str(c["microbatches"]),
        "--layout",
        layout,
        "--cost",
        cost_spec(c),
        "--target",
        "any",
        "--json",
    ]
    if c["limit"] is not None:
        cmd += ["--memory-limit", repr(c["limit"])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    d = json.loads(out)
    loop = min(
        (
            x["makespan"]
            for x in d["candidates"]
            if x["placement"] == "loop" and x["vpp"] == 1 and x["fits"]
        ),
        default=float("inf"),
    )
    return d["makespan"], loop


def verdict(ours, theirs):
    if ours > theirs * (1 + TOL):
        return "slower"
    if ours < theirs * (1 - TOL):
        return "faster"
    return "equal"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    binary = sys.argv[1]
    path = sys.argv[2] if len(sys.argv) == 3 else "tests/golden/zb/auto_schedule.json"
    with open(path) as f:
        cases = json.load(f)["cases"]
    table = defaultdict(lambda: defaultdict(int))
    slower = []
    start = time.time()
    for c in cases:
        if "error" in c:
            continue
        theirs = c["makespan"]
        overall, loop = tune(binary, c)
        key = (c["grid"], c["pp"], c["limit_x_1f1b"])
        row = table[key]
        row["cases"] += 1
        row["loop " + verdict(loop, theirs)] += 1
        row["overall " + verdict(overall, theirs)] += 1
        row["gain"] += 1 - overall / theirs
        for what, ours in (("loop", loop), ("overall", overall)):
            if verdict(ours, theirs) == "slower":
                slower.append(
                    (
                        what,
                        c["grid"],
                        c["pp"],
                        c["microbatches"],
                        c["f"],
                        c["b"],
                        c["w"],
                        c["comm"],
                        c["first"],
                        c["last"],
                        c["limit"],
                        ours,
                        theirs,
                    )
                )
    seconds = time.time() - start
    print(
        "| grid | pp | limit | cases | loop vpp=1: faster / equal / slower "
        "| overall: faster / equal / slower | overall, mean gain |"
    )
    print("|---|---|---|---|---|---|---|")
    total = defaultdict(int)
    for key in sorted(table, key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2])):
        r = table[key]
        for k, v in r.items():
            total[k] += v
        lim = "none" if key[2] is None else f"{key[2]:g}x"
        print(
            f"| {key[0]} | {key[1]} | {lim} | {r['cases']} | {r['loop faster']} / "
            f"{r['loop equal']} / {r['loop slower']} | {r['overall faster']} / "
            f"{r['overall equal']} / {r['overall slower']} | "
            f"{100 * r['gain'] / r['cases']:.1f}% |"
        )
    print(
        f"| all | | | {total['cases']} | {total['loop faster']} / {total['loop equal']} / "
        f"{total['loop slower']} | {total['overall faster']} / {total['overall equal']} / "
        f"{total['overall slower']} | {100 * total['gain'] / max(total['cases'], 1):.1f}% |"
    )
    for s in slower:
        print("slower:", s, f"+{100 * (s[-2] / s[-1] - 1):.2f}%")
    print(f"{len(cases)} cases in {seconds:.1f} s")
    sys.exit(1 if slower else 0)


if __name__ == "__main__":
    main()
