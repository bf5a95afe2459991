"""A buffer plan's receive slots on torch's pipeline runtime (issue #39), CPU, gloo.

``pipec.compile(..., buffer_plan=True)`` gives every receive a ``slot`` of its rank's pool;
``pipec.torch.build_schedule`` then allocates one tensor per slot that holds a receive, once,
and lands every receive in its slot. The ranks train the float64 Linear+Tanh model of
test_torch_train (1F1B, interleaved 1F1B, ZB-V at pp=2 and pp=4; with microbatch lengths, in
index and in another order) for two SGD steps, every loss and gradient within 1e-10 of the
unpipelined model, and report, from outside pipec, the storage of every tensor torch's runtime
receives into and how often torch's own receive allocation ran. The references come from the
plan's instructions alone: the distinct storages received into on a rank are exactly as many as
the plan's slots that hold a receive there, the same in both steps, each as large as the
largest message the plan gives it (``ROWS x DIM`` float64, or its microbatch's tokens x
``DIM`` with lengths), and torch allocates no receive at all. Without a plan (the control)
torch allocates one buffer per receive, every step.

The bookkeeping that refuses a slot re-received into before its message is consumed is checked
in one process, replaying a rank's torch actions with torch's own receive descriptors.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("torch")

import launch
import pipec

TOL = 1e-10
LAUNCH_TIMEOUT = 300
WORLD = 4
ROWS, DIM, F64 = 2, 6, 8  # torch_worker's microbatch rows and width, float64 bytes
STEPS = 2
PACKED = [[3, 4], [5], [2, 2, 2], [9], [1, 7], [4]]
ORDER = [2, 0, 5, 3, 1, 4]

#: (name, compile kwargs, whether the worker trains with lengths)
CASES = [
    ("1f1b-pp2", {"schedule": "1f1b", "pp": 2, "microbatches": 4, "buffer_plan": True}, False),
    (
        "interleaved-pp4",
        {
            "schedule": "interleaved-1f1b",
            "vpp": 2,
            "pp": 4,
            "microbatches": 8,
            "buffer_plan": True,
        },
        False,
    ),
    ("zb-v-pp2", {"schedule": "zb-v", "pp": 2, "microbatches": 4, "buffer_plan": True}, False),
    ("zb-v-pp4", {"schedule": "zb-v", "pp": 4, "microbatches": 8, "buffer_plan": True}, False),
    ("1f1b-pp4", {"schedule": "1f1b", "pp": 4, "microbatches": 8, "buffer_plan": True}, False),
    (
        "lengths-1f1b",
        {"schedule": "1f1b", "pp": 2, "lengths": PACKED, "buffer_plan": True},
        True,
    ),
    (
        "lengths-zb-v-ordered",
        {
            "schedule": "zb-v",
            "pp": 2,
            "lengths": PACKED,
            "microbatch_order": ORDER,
            "buffer_plan": True,
        },
        True,
    ),
    # Forward-only, through .eval (twice).
    (
        "eval-zb-v",
        {"schedule": "zb-v", "pp": 2, "microbatches": 4, "forward_only": True, "buffer_plan": True},
        False,
    ),
    # The control: the same 1F1B without a plan.
    ("no-plan-1f1b", {"schedule": "1f1b", "pp": 2, "microbatches": 4}, False),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("slots")
    configs = [
        {
            "name": name,
            "pp": kw["pp"],
            "tol": TOL,
            "slots": True,
            "lengths": lengths,
            "eval": kw.get("forward_only", False),
            "compile": kw,
        }
        for name, kw, lengths in CASES
    ]
    return launch.train_all(configs, WORLD, out, LAUNCH_TIMEOUT)


def _receives(s, r: int) -> list:
    return [i for i in s.instructions(r) if i["op"] == "recv"]


def _message_bytes(s, i) -> int:
    """A received tensor's bytes, from the plan: ``ROWS x DIM`` float64, or its microbatch's
    tokens (the plan's ``tokens``) x ``DIM`` with lengths."""
    rows = ROWS if s.lengths is None else i.tokens
    return rows * DIM * F64


@pytest.mark.parametrize("name,kw,lengths", CASES, ids=[c[0] for c in CASES])
def test_receives_land_in_the_plans_slots(trained, name, kw, lengths):
    s = pipec.compile(**kw)
    pp = kw["pp"]
    for r, res in enumerate(launch.rank_results(trained, name, pp)):
        assert res["max_grad_rel_err"] <= TOL and res["max_loss_rel_err"] <= TOL
        if s.forward_only:
            assert res["losses_compared"] == (STEPS if s.num_stages - 1 in res["stages"] else 0)
        else:
            assert res["grads_compared"] > 0
        recvs = _receives(s, r)
        assert recvs, f"{name}: rank {r} receives nothing"
        steps = res["recv_storages"]
        assert [len(x) for x in steps] == [len(recvs)] * STEPS  # one tensor per message
        if not kw.get("buffer_plan"):
            # torch allocates a buffer for every receive, every step.
            assert res["pool"] is None
            assert res["torch_recv_allocs"] == STEPS * len(recvs)
            continue
        want: dict[int, int] = {}
        for i in recvs:
            want[i.slot] = max(want.get(i.slot, 0), _message_bytes(s, i))
        assert res["torch_recv_allocs"] == 0
        assert {int(k): v for k, v in res["pool"]["sizes"].items()} == want
        pool = res["pool"]["storages"]
        assert len(set(pool)) == len(want)
        # Every receive of both steps lands in the pool, and uses all of it.
        assert [sorted(set(x)) for x in steps] == [pool] * STEPS


def test_the_cases_share_slots():
    """The plans above put several receives in one slot (else the pool would be torch's own
    per-receive allocation, renamed), and with lengths one slot holds messages of different
    sizes (so a receive uses a view of its own size)."""
    for name, kw, _ in CASES:
        s = pipec.compile(**kw)
        if not kw.get("buffer_plan"):
            continue
        for r in range(kw["pp"]):
            recvs = _receives(s, r)
            assert len({i.slot for i in recvs}) < len(recvs), (name, r)
        if s.lengths is not None:
            sizes = {}
            for i in _receives(s, 0):
                sizes.setdefault(i.slot, set()).add(i.tokens)
            assert any(len(v) > 1 for v in sizes.values()), name


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs


# --------------------------------------------------------------------------- one process


def _replay(s, rank: int, pool_of=None):
    """Run rank ``rank``'s torch actions against a :class:`pipec.torch.SlotPool` on stages
    that hold torch's own receive descriptors (``_RecvInfo``): each ``RECV`` has the pool
    retain a slot view for every descriptor and torch allocate from it
    (``allocate_buffer``, as ``_get_recv_ops`` does), and writes a marker there (the message
    arriving); each consuming pass (``F`` of a stage whose input comes from another rank,
    ``B``/``I`` of one whose output gradient does) takes the tensor as torch does
    (``take_buffer``) after the pool copied it out. Returns the number of messages checked:
    each consumed tensor holds its own marker and is not a view of a slot."""
    import pipec.torch as pt
    import torch
    from torch.distributed.pipelining._recv_buffers import _RecvInfo
    from torch.distributed.pipelining._utils import _TensorMeta

    meta = _TensorMeta.from_tensor(torch.zeros(ROWS, DIM, dtype=torch.float64))
    m, n = s.num_microbatches, s.num_stages
    mine = s.stages_of(rank)
    stages = [
        types.SimpleNamespace(
            stage_index=i,
            device="cpu",
            is_first=i == 0,
            is_last=i == n - 1,
            args_recv_info={mb: (_RecvInfo("x", i - 1, meta),) for mb in range(m)},
            grad_recv_info={mb: (_RecvInfo("g", i + 1, meta),) for mb in range(m)},
        )
        for i in mine
    ]
    by_index = {st.stage_index: st for st in stages}
    pool = (pool_of or pt.SlotPool)(s, stages, rank)
    marker = {}
    checked = 0
    T = pt._ComputationType
    for action in pt.actions(s)[rank]:
        for a in action.sub_actions or (action,):
            ty, i, mb = a.computation_type, a.stage_index, a.microbatch_index
            if ty in (T.RECV_F, T.RECV_B):
                grad = ty == T.RECV_B
                st = by_index[i]
                infos = (st.grad_recv_info if grad else st.args_recv_info)[mb]
                with pool.receiving(st, grad, mb):
                    for info in infos:
                        buf = info.allocate_buffer("cpu")
                        marker[(i, grad, mb)] = float(len(marker) + 1)
                        buf.fill_(marker[(i, grad, mb)])
                continue
            if ty == T.FORWARD and i - 1 >= 0 and i - 1 not in by_index:
                grad = False
            elif ty in (T.FULL_BACKWARD, T.BACKWARD_INPUT) and i + 1 < n and i + 1 not in by_index:
                grad = True
            else:
                continue
            st = by_index[i]
            pool.consume(st, grad, mb)
            infos = (st.grad_recv_info if grad else st.args_recv_info)[mb]
            for info in infos:
                t = info.take_buffer()
                assert torch.all(t == marker[(i, grad, mb)]), (i, grad, mb)
                assert all(
                    t.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                    for b in pool.buffers.values()
                )
                checked += 1
    assert pool.pending() == {}
    return pool, checked


@pytest.mark.parametrize(
    "kw",
    [
        {"schedule": "zb-v", "pp": 4, "microbatches": 8},
        {"schedule": "interleaved-1f1b", "vpp": 2, "pp": 4, "microbatches": 8},
        {"schedule": "1f1b", "pp": 4, "microbatches": 8},
    ],
    ids=["zb-v", "interleaved", "1f1b"],
)
def test_replayed_plan_never_overwrites_a_live_message(kw):
    s = pipec.compile(**kw, buffer_plan=True)
    for r in range(kw["pp"]):
        pool, checked = _replay(s, r)
        recvs = _receives(s, r)
        assert checked == len(recvs)
        assert set(pool.buffers) == {i.slot for i in recvs}


def test_a_slot_received_into_while_live_is_refused():
    """The same replay on a plan whose rank 1 receives all go to slot 0: ZB-V at pp=4 has up to
    three receives live at once there (docs/format.md, "Buffer plan"), so the second lands on
    the first before it is consumed and the pool names the slot and both messages."""
    import pipec.torch as pt

    s = pipec.compile("zb-v", 4, 8, buffer_plan=True)

    class OneSlot(pt.SlotPool):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.plan = {key: (0, tokens) for key, (_, tokens) in self.plan.items()}

    with pytest.raises(
        pipec.PipecError,
        match=r"buffer slot 0 would receive the \w+ of stage \d+, microbatch \d+ while it still holds the \w+ of stage \d+, microbatch \d+",
    ):
        _replay(s, 1, OneSlot)
