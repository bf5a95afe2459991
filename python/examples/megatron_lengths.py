"""Train a small Megatron-core GPT on packed documents of different lengths, planning every
step: each step's microbatches are packed from documents of random lengths, pipec compiles a
schedule from those lengths (every message sized by the plan, no shape exchange), and
pipec.megatron runs it with config.variable_seq_lengths = True.

torchrun --nproc-per-node 2 python/examples/megatron_lengths.py     # GPUs (NCCL)
"""

import os
import random

import pipec
import pipec.megatron
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo")
pp = dist.get_world_size()
parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
rank = parallel_state.get_pipeline_model_parallel_rank()
if cuda:
    tensor_parallel.model_parallel_cuda_manual_seed(0)
device = torch.device("cuda" if cuda else "cpu")

seq, vocab, microbatches, kind = 32, 64, 8, "zb-v"  # seq: the longest packed microbatch
layout = "|".join(["Ett"] + ["tt"] * (2 * pp - 2) + ["ttL"])
# The placement and layers do not depend on the lengths: any plan of this kind gives them.
first = pipec.compile(kind, pp=pp, microbatches=microbatches, layout=layout)
stages = pipec.megatron.stage_indices(first, rank)
layers = pipec.megatron.stage_layers(first)

config = TransformerConfig(
    num_layers=sum(s.num_layers for s in layers),
    hidden_size=32,
    num_attention_heads=4,
    use_cpu_initialization=True,
    pipeline_dtype=torch.float32,
    pipeline_model_parallel_size=pp,
    virtual_pipeline_model_parallel_size=len(stages),
    hidden_dropout=0.0,
    attention_dropout=0.0,
    batch_p2p_sync=False,
    variable_seq_lengths=True,  # microbatches of different lengths: the plan sizes them
    moe_token_dispatcher_type="alltoall",  # megatron-core refuses its default with the flag
)
torch.manual_seed(rank)
model = []
for c, stage in enumerate(stages):
    lay = layers[stage]
    block = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec()] * lay.num_layers, layer_norm=LayerNormImpl
    )
    chunk = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=lay.pre_process,
        post_process=lay.post_process,
        share_embeddings_and_output_weights=False,
        vp_stage=c,
    )
    model.append(chunk.to(device))


def pack(rng: random.Random) -> list[list[int]]:
    """One step's microbatches: documents of 2..12 tokens packed greedily into at most seq
    tokens each (the lengths of the documents in each microbatch)."""
    out = []
    for _ in range(microbatches):
        docs: list[int] = []
        while True:
            n = rng.randint(2, 12)
            if sum(docs) + n > seq:
                break
            docs.append(n)
        out.append(docs)
    return out


def microbatch(docs: list[int], g: torch.Generator):
    """Tokens [1, n] of the packed documents (each counts up from a random start: something
    to learn), positions restarting at each document, and a causal mask that keeps every
    document to itself (True = masked)."""
    n = sum(docs)
    starts = torch.randint(0, vocab, (len(docs),), generator=g)
    tokens = torch.cat([(s + torch.arange(d)) % vocab for s, d in zip(starts, docs)])[None]
    positions = torch.cat([torch.arange(d) for d in docs]).unsqueeze(0)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return tokens.to(device), positions.to(device), (~allowed)[None, None].to(device)


def forward_step(data_iterator, chunk):
    tokens, positions, mask = next(data_iterator)  # this microbatch's, whatever the order
    labels = tokens.roll(-1, dims=1)
    out = chunk(
        tokens if chunk.pre_process else None,
        positions,
        mask,
        labels=labels if chunk.post_process else None,
    )

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


optimizer = torch.optim.Adam([p for chunk in model for p in chunk.parameters()], lr=3e-3)
rng, g = random.Random(0), torch.Generator().manual_seed(1)  # the same batches on every rank
for step in range(9):
    lengths = pack(rng)  # this step's batch: one list of document lengths per microbatch
    data = [microbatch(docs, g) for docs in lengths]
    # A plan per step, from this step's lengths: every send and receive carries its tokens.
    schedule = pipec.compile(kind, pp=pp, lengths=lengths, layout=layout)
    forward_backward = pipec.megatron.forward_backward_func(schedule)
    optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[iter(data) for _ in model],  # one per chunk
        model=model,
        num_microbatches=microbatches,
        seq_length=seq,  # not used under variable_seq_lengths: each message is the plan's
        micro_batch_size=1,
    )
    optimizer.step()
    if losses and step % 3 == 2:  # the rank holding the last stage (rank 0 under ZB-V)
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        tokens = sum(map(sum, lengths))
        print(f"step {step + 1}: loss {loss.item():.4f} ({tokens} tokens)")
dist.destroy_process_group()
