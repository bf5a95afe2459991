"""Train a small model with a verified pipec schedule on torch's own pipeline runtime.

torchrun --nproc-per-node 2 python/examples/train_pipec.py      # CPU, gloo
"""

import pipec
import pipec.torch
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

dist.init_process_group("gloo")  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
rank, world = dist.get_rank(), dist.get_world_size()

# A verified schedule for this world: ZB-V (V-shaped, two stages per rank, zero bubble).
# pipec.load("out/zbv") reads a compiled directory instead, with every check pipec-run makes.
schedule = pipec.compile("zb-v", pp=world, microbatches=8)

# The model, one block per stage, built identically on every rank (same seed).
torch.manual_seed(0)
dim = 16
blocks = [
    torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
    for _ in range(schedule.num_stages)
]

# This rank's stages (for ZB-V on rank r: r and 2*pp-1-r), in the order build_schedule wants.
mine = pipec.torch.stage_indices(schedule, rank)
stages = [PipelineStage(blocks[s], s, schedule.num_stages, torch.device("cpu")) for s in mine]


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


# torch's _PipelineScheduleRuntime, running pipec's verified actions for this rank.
pipe = pipec.torch.build_schedule(schedule, stages, loss_fn)
optimizer = torch.optim.SGD([p for s in mine for p in blocks[s].parameters()], lr=0.5)

x = torch.randn(64, dim, generator=torch.Generator().manual_seed(1))
y = torch.tanh(x.flip(1))  # something to learn
has_first, has_last = 0 in mine, schedule.num_stages - 1 in mine
for step in range(30):
    optimizer.zero_grad()
    losses = []
    inputs = (x,) if has_first else ()
    targets = {"target": y, "losses": losses} if has_last else {}
    pipe.step(*inputs, **targets)  # 8 microbatches of 8 rows
    optimizer.step()
    if has_last and step % 5 == 4:
        print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.5f}")
dist.destroy_process_group()
