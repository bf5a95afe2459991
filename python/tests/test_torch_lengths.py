"""Microbatches of different lengths on torch's own pipeline runtime (issue #38), CPU, gloo.

2 ranks build a float64 model of one Linear+Tanh per stage; each microbatch is a
``[tokens, 6]`` tensor of its own length (packed lengths, 3 to 9 tokens), and
``pipec.torch.build_schedule`` sizes every receive from the plan's ``tokens``. Two SGD steps;
every microbatch loss and every parameter gradient is compared with the same model run without
pipelining, microbatch by microbatch (relative error <= 1e-10, float64). Without the resizing
torch would receive every microbatch at the first one's size, and gloo refuses the mismatch.

The same in another microbatch order (``microbatch_order=ORDER``, and the order
``pipec.tune(..., target="torch")`` chooses): ``build_schedule`` renumbers the microbatches for
torch, whose loss list follows the last stage's forwards, and the caller still passes and gets
back microbatch i at position i. Were the inputs handed over unpermuted, torch would receive
each microbatch at another one's length; were the losses not put back, they would be compared
with another microbatch's reference.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import launch

TOL = 1e-10
LAUNCH_TIMEOUT = 240
PACKED = [[3, 4], [5], [2, 2, 2], [9], [1, 7], [4]]

ORDER = [2, 0, 5, 3, 1, 4]
#: Costs under which tune, at pp=2 over PACKED, reorders (test_tune_reorders_for_torch).
TUNE = {"pp": 2, "microbatches": None, "cost": "f=1,b=1,w=1,p2p=0.1", "target": "torch"}
#: The same with activations weighed and a limit under which tune's torch plan both reorders
#: and offloads (the memory actions are renumbered for torch too).
TUNE_OFFLOAD = dict(TUNE, cost="f=1,b=1,w=1,p2p=0.1,t.act=1", memory_limit="4.33")

CASES = [
    ("lengths-1f1b", {"schedule": "1f1b"}),
    ("lengths-interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}),
    ("lengths-zb-v", {"schedule": "zb-v"}),
    ("ordered-1f1b", {"schedule": "1f1b", "microbatch_order": ORDER}),
    (
        "ordered-interleaved-1f1b",
        {"schedule": "interleaved-1f1b", "vpp": 2, "microbatch_order": ORDER},
    ),
    ("ordered-zb-v", {"schedule": "zb-v", "microbatch_order": ORDER}),
    ("tuned-for-torch", TUNE),
    ("tuned-for-torch-offload", TUNE_OFFLOAD),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lengths")
    configs = [
        {
            "name": name,
            "pp": 2,
            "tol": TOL,
            "lengths": True,
            **(
                {"tune": dict(kw, lengths=PACKED)}
                if name.startswith("tuned-")
                else {"compile": dict(kw, pp=2, lengths=PACKED)}
            ),
        }
        for name, kw in CASES
    ]
    return launch.train_all(configs, 2, out, LAUNCH_TIMEOUT)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_lengths_train_like_the_unpipelined_model(trained, name):
    results = trained[0]
    for res in launch.rank_results(trained, name, 2):
        assert res["max_grad_rel_err"] <= TOL
        assert res["max_loss_rel_err"] <= TOL
        assert res["grads_compared"] > 0
    assert sum(results[(name, r)]["losses_compared"] for r in range(2)) == 2 * len(PACKED)
    # Each rank renumbered the microbatches for torch exactly when the plan is reordered: in
    # the last stage's forward order, which for these kinds is the order they enter.
    if name.startswith("ordered-"):
        want = ORDER
    elif name.startswith("tuned-"):
        want = pipec_tune_order(dict(CASES)[name])
    else:
        want = None
    assert [results[(name, r)]["relabelled"] for r in range(2)] == [want, want]


def pipec_tune_order(kw: dict = TUNE) -> list[int]:
    import pipec

    _, report = pipec.tune(**kw, lengths=PACKED)
    return report["microbatch_order"]


def test_tune_reorders_for_torch():
    """The tuned case above is a reordered plan: under these costs tune picks an order other
    than the index order for torch, and so under the default target (with lengths: the
    frameworks that run them, which run every order)."""
    import pipec

    assert pipec_tune_order() != list(range(len(PACKED)))
    s, report = pipec.tune(**TUNE_OFFLOAD, lengths=PACKED)
    assert report["microbatch_order"] != list(range(len(PACKED)))
    assert any(i.op.name == "offload" for r in range(2) for i in s.instructions(r))
    _, default = pipec.tune(**dict(TUNE, target=None), lengths=PACKED)
    assert default["microbatch_order"] != list(range(len(PACKED)))


def test_relabelled_actions_are_the_index_order_plans():
    """Independently of the renaming code: a plan compiled with ``microbatch_order=ORDER`` and
    relabelled for torch (torch id k for the user's ORDER[k]) has the actions, rank by rank,
    of the same kind compiled in index order."""
    import pipec
    import pipec.torch as pt

    for kw in ({"schedule": "1f1b"}, {"schedule": "zb-v"}):
        plain = pt.actions(pipec.compile(pp=2, lengths=PACKED, **kw))
        s = pipec.compile(pp=2, lengths=PACKED, microbatch_order=ORDER, **kw)
        compute = pt.actions(s, compute_only=True)
        order = pt._torch_order(compute, s.num_stages - 1)
        assert order == ORDER
        torch_of = [order.index(u) for u in range(len(order))]
        got = {r: [pt._relabel(a, torch_of) for a in line] for r, line in pt.actions(s).items()}
        assert got == plain, kw


def test_all_ranks_exited_cleanly(trained):
    _, ok, logs = trained
    assert ok, logs


def _fake_stage(index: int, recv_infos: dict, grad_infos: dict, sent: dict):
    """A stage with torch's four message methods, recording what they are asked for."""
    import types

    def recv(infos):
        return lambda mb: [info.tensor_meta.shape for info in infos[mb]]

    return types.SimpleNamespace(
        stage_index=index,
        is_first=index == 0,
        is_last=False,
        args_recv_info=recv_infos,
        grad_recv_info=grad_infos,
        get_fwd_recv_ops=recv(recv_infos),
        get_bwd_recv_ops=recv(grad_infos),
        get_fwd_send_ops=lambda mb: sent.get(("act", mb), []),
        get_bwd_send_ops=lambda mb: sent.get(("grad", mb), []),
    )


def test_each_receive_is_sized_from_the_plan_and_each_send_held_to_it():
    """In one process, on stand-ins for torch's stages: before torch builds microbatch m's
    receive, its descriptor's size along ``token_dim`` is the plan's tokens (the sums of
    ``PACKED``), and a send of another size is refused before it is posted."""
    import types

    import pipec
    import pipec.torch as pt
    import torch
    from torch.distributed.pipelining import _recv_buffers as rb
    from torch.distributed.pipelining import _utils

    sched = pipec.compile("1f1b", 2, lengths=PACKED)
    meta = _utils._TensorMeta.from_tensor(torch.zeros(1, 5, 6))
    m = len(PACKED)
    acts = {mb: (rb._RecvInfo("x", 0, meta),) for mb in range(m)}
    second = _fake_stage(1, acts, {}, {})
    second.is_last = True
    pt._size_messages(sched, [second], 1, 1)
    for mb, seqs in enumerate(PACKED):
        assert second.get_fwd_recv_ops(mb) == [torch.Size([1, sum(seqs), 6])]
        assert acts[mb][0].allocate_buffer("cpu").shape == (1, sum(seqs), 6)

    grads = {mb: (rb._RecvInfo("g", 1, meta),) for mb in range(m)}
    good = types.SimpleNamespace(tensor=torch.zeros(1, sum(PACKED[2]), 6))
    bad = types.SimpleNamespace(tensor=torch.zeros(1, 5, 6))
    first = _fake_stage(0, {}, grads, {("act", 2): [good], ("act", 3): [bad]})
    pt._size_messages(sched, [first], 0, 1)
    assert first.get_bwd_recv_ops(4) == [torch.Size([1, sum(PACKED[4]), 6])]
    assert first.get_fwd_send_ops(2) == [good]
    with pytest.raises(pipec.PipecError) as e:
        first.get_fwd_send_ops(3)
    assert str(e.value).startswith(
        "rank 0, stage 0, microbatch 3: the act to send has shape (1, 5, 6), but the plan "
        "sends 9 tokens along dimension 1"
    )
