"""One srun task, started by hand: DistEnv from SLURM_*, a process group, an all-reduce, two DDP steps."""
import json

import torch
import torch.distributed as dist
from torch import nn

import scaleloop as sl

env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env, timeout_s=60)
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)

torch.manual_seed(0)
strategy = sl.strategy("ddp", env)
model, optimizer = strategy.setup(sl.SimpleNet(input_dim=8, hidden_dim=16, output_dim=1),
                                  lambda params: torch.optim.SGD(params, lr=0.5))
before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
data = sl.RandomDataset(64, input_dim=8, generator=torch.Generator().manual_seed(0))
loader = strategy.loader(data, batch_size=32, shuffle=False)
loader.set_epoch(0)
for batch in loader:  # 2 steps: 16 samples per rank each
    x, y = batch
    with strategy.micro_step(model, batch):
        strategy.backward(nn.functional.binary_cross_entropy_with_logits(model(x), y), batch)
    strategy.optimizer_step(optimizer)
after = torch.cat([p.detach().flatten() for p in model.parameters()])

print(json.dumps({
    "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
    "local_world_size": env.local_world_size, "master": [env.master_addr, env.master_port],
    "all_reduce": total.item(), "changed": (after - before).abs().max().item(),
    "params": after.tolist(),
}))
sl.destroy_process_group()
