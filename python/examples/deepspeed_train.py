"""Train with a pipec schedule on DeepSpeed's PipelineEngine (run one process per rank with the
usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables, e.g. via the deepspeed launcher)."""

import os

import deepspeed
import pipec
import pipec.deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

if os.environ.get("DS_ACCELERATOR") == "cpu":  # on CPU: no JIT build of the shared-memory op
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend=os.environ.get("BACKEND", "gloo"))
pp, m = int(os.environ["WORLD_SIZE"]), 8
torch.manual_seed(0)
module = PipelineModule(
    layers=[LayerSpec(torch.nn.Linear, 16, 16) for _ in range(2 * pp)],
    num_stages=pp,
    loss_fn=torch.nn.functional.mse_loss,
)
config = {
    "train_batch_size": 2 * m,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": m,  # = the schedule's microbatches
}
opt = torch.optim.SGD(module.parameters(), lr=0.1)
engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
pipec.deepspeed.use(engine, pipec.compile("zb-h1", pp=pp, microbatches=m))
pipec.deepspeed.use(engine, pipec.compile("1f1b", pp=pp, microbatches=m, forward_only=True))
g = torch.Generator().manual_seed(1)
data = [(torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)) for _ in range(m)]
for step in range(3):
    loss = engine.train_batch(iter(data))  # zb-h1, split backward included
    if engine.global_rank == 0:
        print(f"step {step}: loss {loss.item():.6f}")
eval_loss = engine.eval_batch(iter(data))  # the forward-only schedule
if engine.global_rank == 0:
    print(f"eval: loss {eval_loss.item():.6f}")
torch.distributed.destroy_process_group()  # a clean exit: gloo's threads end before teardown
