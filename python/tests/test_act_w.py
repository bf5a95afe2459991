"""Activations freed in two parts (``K.act_w``, issue #39; docs/memory.md): ``fwd`` allocates
``act``, ``bwd_D`` frees ``act - act_w`` after it ran, ``bwd_W`` frees ``act_w``, a fused
``bwd`` frees ``act``. Checked through the Python API against a hand count and against a
test-local replay of that rule over the instructions.
"""

from __future__ import annotations

import pipec
import pytest

SPLIT = "t.act=1,t.act_w=0.5"  # the zero-bubble authors' example: half freed at B


def _order(s, r: int) -> str:
    return " ".join(
        f"{i['op']}{i['stage']},{i['mb']}"
        for i in s.instructions(r)
        if i["op"] in ("fwd", "bwd", "bwd_D", "bwd_W")
    )


def test_zb_h1_peaks_by_hand():
    """ZB-H1, pp=3, M=6, one layer per stage (``t.act=1``: a forward holds 1 unit).

    The compute order per rank (pinned below, the order the count is made on):

    - rank 0: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5, all fused ``bwd``: live after each op
      1 2 3 2 3 2 3 2 3 2 1 0, peak 3 with or without ``act_w`` (a fused backward frees
      everything at once).
    - rank 1: F0 F1 D0 F2 B1 F3 B2 F4 B3 F5 D4 W0 D5 W4 W5. With ``act_w = 0.5``:
      1 2 1.5 2.5 1.5 2.5 1.5 2.5 1.5 2.5 2 1.5 1 0.5 0, peak 2.5 (microbatch 0 keeps 0.5
      from its D to its W, beside two whole forwards). With ``act_w = act`` (the default) a
      D frees nothing: 1 2 2 3 2 3 2 3 2 3 3 2 2 1 0, peak 3.
    - rank 2: F0 D0 F1 D1 F2 B2 F3 B3 F4 B4 F5 D5 W0 W1 W5. With ``act_w = 0.5``:
      1 0.5 1.5 1 2 1 2 1 2 1 2 1.5 1 0.5 0, peak 2 (microbatches 0 and 1 keep 0.5 each
      beside one whole forward). Default: 1 1 2 2 3 2 3 2 3 2 3 3 2 1 0, peak 3.

    So the split rule lowers the peaks from [3, 3, 3] to [3, 2.5, 2].
    """
    s = pipec.compile("zb-h1", 3, 6)
    assert _order(s, 0) == (
        "fwd0,0 fwd0,1 fwd0,2 bwd0,0 fwd0,3 bwd0,1 fwd0,4 bwd0,2 fwd0,5 bwd0,3 bwd0,4 bwd0,5"
    )
    assert _order(s, 1) == (
        "fwd1,0 fwd1,1 bwd_D1,0 fwd1,2 bwd1,1 fwd1,3 bwd1,2 fwd1,4 bwd1,3 fwd1,5 bwd_D1,4 "
        "bwd_W1,0 bwd_D1,5 bwd_W1,4 bwd_W1,5"
    )
    assert _order(s, 2) == (
        "fwd2,0 bwd_D2,0 fwd2,1 bwd_D2,1 fwd2,2 bwd2,2 fwd2,3 bwd2,3 fwd2,4 bwd2,4 fwd2,5 "
        "bwd_D2,5 bwd_W2,0 bwd_W2,1 bwd_W2,5"
    )

    assert s.check(cost="t.act=1").peak_activations == [3, 3, 3]
    split = [3, 2.5, 2]
    # Every way the Python API takes the cost model counts by the same rule.
    assert s.check(cost=SPLIT).peak_activations == split
    compiled = pipec.compile("zb-h1", 3, 6, cost=SPLIT)
    assert compiled.check().peak_activations == split
    assert [r["peak_activations"] for r in s.simulate(SPLIT)["ranks"]] == split
    assert s.simulate(SPLIT)["peak_activations"] == 3
    # act_w = act is the default, byte for byte.
    assert s.check(cost="t.act=1,t.act_w=1").peak_activations == [3, 3, 3]


def _replay(s, r: int, act: float, act_w: float) -> float:
    """The rule, applied to rank ``r``'s instructions with every stage holding one layer."""
    live = peak = 0.0
    for i in s.instructions(r):
        op = i["op"]
        if op == "fwd":
            live += act
            peak = max(peak, live)
        elif op == "bwd_D":
            live -= act - act_w
        elif op == "bwd_W":
            live -= act_w
        elif op == "bwd":
            live -= act
    assert abs(live) < 1e-12, "every forward's activations are freed by the end"
    return peak


@pytest.mark.parametrize(
    "kind,pp,m",
    [("zb-h1", 4, 8), ("zb-h2", 4, 8), ("zb-v", 3, 6), ("1f1b", 4, 8), ("zb-1p", 2, 6)],
)
@pytest.mark.parametrize("act_w", [0.25, 0.5, 1.0])
def test_peaks_are_the_rule_replayed(kind, pp, m, act_w):
    s = pipec.compile(kind, pp, m)
    got = s.check(cost=f"t.act=1,t.act_w={act_w}").peak_activations
    assert got == pytest.approx([_replay(s, r, 1.0, act_w) for r in range(pp)], abs=1e-12)
