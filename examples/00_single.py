"""00 — the plain loop on one device: the tutorial's SimpleNet on its RandomDataset.

    python examples/00_single.py [--out weights.pt]
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
env = sl.DistEnv.from_env(device="cpu")
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()

strategy = sl.strategy("single", env)
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
