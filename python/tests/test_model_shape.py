"""Costs and memory from a model's shape (the ``[model]`` table, ``pipec.tune(model=...)``)
against Megatron-LM's own theoretical memory report, executed: megatron-core 0.19.2's wheel
ships ``megatron/training/theoretical_memory_usage.py`` (Megatron-LM d98e8a64), whose
``compute_weight_and_optimizer_memory`` counts parameters, gradients and optimizer state, and
whose ``compute_activation_memory`` (sequence parallel + selective recompute) and
``compute_activation_memory_without_sp`` are Korthikanti et al. 2022, Table 2. Shapes: GPT-3
175B (Brown et al., 2020) and Llama-3 70B (Meta, 2024) at tp=8, pp=8.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pipec
import pytest

try:
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.theoretical_memory_usage import (
        compute_activation_memory,
        compute_activation_memory_without_sp,
        compute_weight_and_optimizer_memory,
    )
except ImportError as e:  # pragma: no cover - CI installs megatron-core
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"megatron-core not installed: {e}", allow_module_level=True)

GPT3 = {"hidden": 12288, "ffn": 49152, "heads": 96, "seq": 2048, "vocab": 50257}
LLAMA3 = {
    "hidden": 8192,
    "ffn": 28672,
    "heads": 64,
    "kv_heads": 8,
    "seq": 8192,
    "vocab": 128256,
    "swiglu": True,
    "normalization": "RMSNorm",
}
TP, PP, DP = 8, 8, 8


def megatron_args(shape: dict, num_layers: int, pp: int, dist_opt: bool, sp=True, **kw):
    """The ``args`` Megatron's report reads, for ``shape``."""
    tp = shape.get("tp", TP)
    a = SimpleNamespace(
        hidden_size=shape["hidden"],
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=shape["heads"],
        kv_channels=shape["hidden"] // shape["heads"],
        group_query_attention="kv_heads" in shape,
        num_query_groups=shape.get("kv_heads", shape["heads"]),
        swiglu=shape.get("swiglu", False),
        normalization=shape.get("normalization", "LayerNorm"),
        seq_length=shape["seq"],
        micro_batch_size=shape.get("micro_batch", 1),
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        rank=0,
        num_layers=num_layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=DP,
        world_size=tp * pp * DP,
        use_distributed_optimizer=dist_opt,
        sequence_parallel=sp,
        recompute_granularity="selective",
        untie_embeddings_and_output_weights=True,
        num_experts=None,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        moe_ffn_hidden_size=None,
        moe_latent_size=None,
        moe_router_topk=2,
        mtp_num_layers=None,
        multi_latent_attention=False,
        add_bias_linear=False,
        expert_tensor_parallel_size=tp,
        expert_model_parallel_size=1,
    )
    a.padded_vocab_size = vocab_size_with_padding(shape["vocab"], a, logging_enabled=False)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def derived(shape: dict, **extra) -> dict:
    return pipec.cost_model(model={"tp": TP, "dp": DP, **shape, **extra})


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1.0)


@pytest.mark.parametrize("name,shape", [("gpt3-175b", GPT3), ("llama3-70b", LLAMA3)])
@pytest.mark.parametrize("dist_opt", [False, True])
def test_parameter_bytes_are_megatrons(name, shape, dist_opt):
    """``t.param``: Megatron's most-loaded shard grows by exactly one layer per stage when
    the model grows by ``pp`` layers; ``E.param``: the rest of the first stage (less
    Megatron's share of the final norm, which it spreads over the stages and pipec puts on
    the last); ``L.param``: the output layer and the final norm."""
    c = derived(shape, distributed_optimizer=dist_opt)
    mem = c["memory"]
    w1 = compute_weight_and_optimizer_memory(megatron_args(shape, PP, PP, dist_opt))
    w2 = compute_weight_and_optimizer_memory(megatron_args(shape, 2 * PP, PP, dist_opt))
    assert close(mem["t"]["param"], w2 - w1)
    bpp = 6 + 12 / DP if dist_opt else 18
    norm = (1 if shape.get("normalization") == "RMSNorm" else 2) * shape["hidden"]
    assert close(mem["E"]["param"], w1 - mem["t"]["param"] - norm * bpp / PP)
    assert close(mem["L"]["param"] - mem["E"]["param"], norm * bpp)
    assert mem["m"] == mem["t"]


def layer_activation_megatron(shape: dict, sp: bool) -> float:
    """One layer's activation bytes by Megatron's report: the growth of the first stage's
    figure from one layer to two (pp=1, so no in-flight factor), per tp rank."""
    f = compute_activation_memory if sp else compute_activation_memory_without_sp
    one = f(megatron_args(shape, 1, 1, False, sp=sp), num_microbatches=1)
    two = f(megatron_args(shape, 2, 1, False, sp=sp), num_microbatches=1)
    # The without-SP estimate multiplies everything by a 5% allowance for temporaries.
    return (two - one) / (1 if sp else 1.05)


def test_gpt3_activation_bytes_are_megatrons():
    """GPT-3 (multi-head attention, GeLU MLP, the paper's assumptions): Table 2's
    ``sbh 34/t`` (sequence parallel, selective recompute) and ``sbh (10 + 24/t)`` (tensor
    parallel only) exactly as Megatron computes them; the embedding's and the output
    layer's per-microbatch bytes as its first-stage (pp microbatches in flight) and pp=1
    terms."""
    c = derived(GPT3, recompute="selective")
    assert close(c["memory"]["t"]["act"], layer_activation_megatron(GPT3, sp=True))
    c_nosp = derived(GPT3, recompute="selective", sequence_parallel=False)
    assert close(c_nosp["memory"]["t"]["act"], layer_activation_megatron(GPT3, sp=False))
    layer = layer_activation_megatron(GPT3, sp=True)
    args = megatron_args(GPT3, 1, PP, False)
    first = compute_activation_memory(args, num_microbatches=None)
    assert close(c["memory"]["E"]["act"], (first - layer) / PP)
    single = compute_activation_memory(megatron_args(GPT3, 1, 1, False), num_microbatches=1)
    assert close(c["memory"]["L"]["act"], single - layer - c["memory"]["E"]["act"])


def test_llama3_activation_bytes_adapt_megatrons_for_gqa_and_swiglu():
    """Megatron's estimate assumes multi-head attention and a two-matrix MLP (its TODO says
    so); pipec counts K and V for ``kv_heads`` heads and SwiGLU's three intermediates, which
    differ from Megatron's ``sbh (18 + 4 ffn/h) / t`` by ``sbh (4 (g/a - 1) + 2 ffn/h) / t``."""
    s, h, a, g, f = LLAMA3["seq"], LLAMA3["hidden"], LLAMA3["heads"], 8, LLAMA3["ffn"]
    c = derived(LLAMA3, recompute="selective")
    delta = s * h * (4 * (g / a - 1) + 2 * f / h) / TP
    assert close(c["memory"]["t"]["act"], layer_activation_megatron(LLAMA3, sp=True) + delta)


def test_gpt3_rank0_peak_is_megatrons_whole_report():
    """The whole figure: ``pipec.tune`` of 1F1B on Megatron's even split (12 layers per
    stage, embedding first) peaks on rank 0 at Megatron's weight-and-optimizer memory plus
    its first-stage activation memory (pp microbatches in flight), but for the final norm's
    share Megatron spreads over the stages."""
    shape = {**GPT3, "tp": TP, "dp": DP, "distributed_optimizer": True, "recompute": "selective"}
    _, report = pipec.tune(
        PP, 64, layout="Et*12|(t*12|)*6,t*12,L", model=shape, kinds=["1f1b"], target="any"
    )
    args = megatron_args(GPT3, 96, PP, True)
    megatron = compute_weight_and_optimizer_memory(args) + compute_activation_memory(
        args, num_microbatches=64
    )
    final_norm_share = 2 * GPT3["hidden"] * (6 + 12 / DP) / PP
    assert close(report["peak_memory"][0], megatron - final_norm_share)


def test_model_keyword_errors_and_precedence():
    with pytest.raises(pipec.SpecError, match="unknown key 'layers'"):
        pipec.cost_model(model={**GPT3, "layers": 96})
    with pytest.raises(pipec.SpecError, match=r"`dtype` must be one of"):
        pipec.cost_model(model={**GPT3, "dtype": "bf8"})
    with pytest.raises(pipec.SpecError, match="lacks vocab"):
        pipec.cost_model(model={k: v for k, v in GPT3.items() if k != "vocab"})
    with pytest.raises(pipec.SpecError, match="model must be a dict"):
        pipec.cost_model(model=[("hidden", 1)])
    with pytest.raises(pipec.SpecError, match="described twice"):
        pipec.cost_model(cost="[model]\nhidden=1", model=GPT3)
    # Explicit keys (measured, e.g. ``pipec calibrate`` output) win over the formulas.
    c = pipec.cost_model(cost="t.f = 3.5\nE.param = 1GiB", model=GPT3)
    base = pipec.cost_model(model=GPT3)
    assert c["t"]["f"] == 3.5 and c["t"]["b"] == base["t"]["b"]
    assert c["memory"]["E"]["param"] == 2**30
    assert c["memory"]["L"] == base["memory"]["L"]
    assert c["model"]["sequence_parallel"] is False and c["model"]["dtype"] == "bf16"
