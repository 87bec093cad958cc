"""01 — the same loop with nn.DataParallel: one process drives every GPU of the machine.

    python examples/01_dataparallel.py [--out weights.pt]

The diff from 00_single.py: the device is the GPU when there is one, and the strategy is "dp"
instead of "single". DataParallel copies the model to every visible GPU at each forward,
splits the batch of 128 between them, and adds the gradients up on GPU 0: the arithmetic of
one step on the whole batch, so the weights match 00_single.py's.

DataParallel needs CUDA. Without a GPU this script says so and runs "single" on the CPU
(scaleloop itself refuses --strategy dp on a CPU rather than silently do something else, so
the fallback is spelled out here, where you can see it). PyTorch recommends one process per
GPU instead (02_ddp.py): DataParallel runs the replicas in threads of one Python process and
sends every batch and gradient through GPU 0.
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
gpus = torch.cuda.device_count()                                   # new
env = sl.DistEnv.from_env(device="cuda" if gpus else "cpu")        # new: the GPU when there is one
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()

if gpus:                                                           # new
    print(f"nn.DataParallel over {gpus} GPU(s)")
    strategy = sl.strategy("dp", env)
else:
    print("no CUDA GPU: nn.DataParallel needs one, so this runs 'single' on the CPU")
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
        # unwrap: the user's model inside nn.DataParallel, so the keys have no "module." prefix
        torch.save(strategy.unwrap(model).state_dict(), args.out)
