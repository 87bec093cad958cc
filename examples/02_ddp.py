"""02 — the same loop under DistributedDataParallel, started by torchrun.

    torchrun --nproc-per-node 2 examples/02_ddp.py [--out weights.pt]

The diff from 00_single.py (01_dataparallel.py was the one-process, many-GPU detour): join the
process group, ask for "ddp", leave the group at the end.
The loader shards each global batch of 128 over the ranks (64 each with 2 processes), and DDP
averages the gradients, so the weights equal 00_single.py's. (The loss printed is rank 0's own,
on its 64 samples, so it differs from 00's; 03_accumulate_bf16.py prints the whole step's.)
"""
import argparse

import torch
from torch import nn

import scaleloop as sl

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="save the final weights here")
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")              # rank, world size: set by torchrun
sl.init_process_group(env)                            # new: join the group (Gloo on CPU)
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()

strategy = sl.strategy("ddp", env)                   # new: "ddp" instead of "single"
model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
loader = strategy.loader(dataset, batch_size=128, shuffle=True, seed=0)   # global batch

step = 0
for epoch in range(100):
    loader.set_epoch(epoch)
    for batch in loader:
        x, y = batch
        with strategy.micro_step(model, batch):
            loss = criterion(model(x), y)
            strategy.backward(loss, batch)
        if batch.last_micro:
            strategy.optimizer_step(optimizer)
            step += 1
        if step == args.steps:
            break
    if step == args.steps:
        break

if env.is_main:
    print(f"rank {env.rank}/{env.world_size}: {step} steps, last loss {loss.item():.4f}")
    if args.out:
        torch.save(strategy.unwrap(model).state_dict(), args.out)
sl.destroy_process_group()                            # new: leave the group
