"""Microbatches of different lengths on torch's own pipeline runtime (issue #38), CPU, gloo.

2 ranks build a float64 model of one Linear+Tanh per stage; each microbatch is a
``[tokens, 6]`` tensor of its own length (packed lengths, 3 to 9 tokens), and
``pipec.torch.build_schedule`` sizes every receive from the plan's ``tokens``. Two SGD steps;
every microbatch loss and every parameter gradient is compared with the same model run without
pipelining, microbatch by microbatch (relative error <= 1e-10, float64). Without the resizing
torch would receive every microbatch at the first one's size, and gloo refuses the mismatch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import launch

TOL = 1e-10
LAUNCH_TIMEOUT = 240
PACKED = [[3, 4], [5], [2, 2, 2], [9], [1, 7], [4]]

CASES = [
    ("lengths-1f1b", {"schedule": "1f1b"}),
    ("lengths-interleaved-1f1b", {"schedule": "interleaved-1f1b", "vpp": 2}),
    ("lengths-zb-v", {"schedule": "zb-v"}),
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
            "compile": dict(kw, pp=2, lengths=PACKED),
        }
        for name, kw in CASES
    ]
    return launch.train_all(configs, 2, out, LAUNCH_TIMEOUT)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_lengths_train_like_the_unpipelined_model(trained, name):
    results, _, logs = trained
    for r in range(2):
        res = results.get((name, r))
        if res is None:
            pytest.fail(f"{name}: rank {r} reported nothing (hang or crash)\n{logs}")
        if not res["ok"]:
            pytest.fail(f"{name}: rank {r}: {res['error']}\n{logs}")
        assert res["max_grad_rel_err"] <= TOL
        assert res["max_loss_rel_err"] <= TOL
        assert res["grads_compared"] > 0
    assert sum(results[(name, r)]["losses_compared"] for r in range(2)) == 2 * len(PACKED)


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
