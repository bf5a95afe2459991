"""Train a small Megatron-core GPT with a verified pipec schedule (ZB-V: V placement, split
backward) through Megatron's forward_step/backward_step.

torchrun --nproc-per-node 2 python/examples/megatron_train.py     # GPUs (NCCL)
"""

import os

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

# 2*pp stages of two decoder layers; ZB-V puts stages r and 2*pp-1-r on rank r.
layout = "|".join(["Ett"] + ["tt"] * (2 * pp - 2) + ["ttL"])
schedule = pipec.compile("zb-v", pp=pp, microbatches=8, layout=layout)
stages = pipec.megatron.stage_indices(schedule, rank)  # rank 0: [0, 2*pp-1]
layers = pipec.megatron.stage_layers(schedule)

seq, mbs, vocab = 16, 2, 64
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
)

# One GPTModel per stage, in stage_indices order (chunk c is the c-th stage of this rank):
# exactly that stage's layers, the embedding where it has E, the output layer where it has L.
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
    model.append(chunk.cuda() if cuda else chunk)

device = torch.device("cuda" if cuda else "cpu")
position_ids = torch.arange(seq, device=device).expand(mbs, seq)
mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)


def forward_step(data_iterator, chunk):
    tokens = next(data_iterator)  # every chunk draws its microbatches in order
    labels = tokens.roll(-1, dims=1)  # something to learn: the next token
    out = chunk(
        tokens if chunk.pre_process else None,
        position_ids,
        mask,
        labels=labels if chunk.post_process else None,
    )

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        # clone(): megatron-core divides the returned loss by the microbatch count in place,
        # and detach() shares its storage.
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


forward_backward = pipec.megatron.forward_backward_func(schedule)
optimizer = torch.optim.Adam([p for chunk in model for p in chunk.parameters()], lr=3e-3)
g = torch.Generator().manual_seed(1)
data = [torch.randint(0, vocab, (mbs, seq), generator=g).to(device) for _ in range(8)]
for step in range(15):
    optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[iter(data) for _ in model],  # one per chunk
        model=model,
        num_microbatches=8,
        seq_length=seq,
        micro_batch_size=mbs,
    )
    optimizer.step()
    if losses and step % 5 == 4:  # the rank holding the last stage (rank 0 under ZB-V)
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        print(f"step {step + 1}: loss {loss.item():.4f}")
dist.destroy_process_group()
