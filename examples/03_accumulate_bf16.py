"""03 — gradient accumulation and mixed precision, on top of 02_ddp.py.

    torchrun --nproc-per-node 2 examples/03_accumulate_bf16.py [--accumulate 4] [--precision bf16] [--out weights.pt]
    python examples/03_accumulate_bf16.py            # one process works too

The diff from 02_ddp.py:

- ``accumulate=4``: each optimizer step of 128 samples is done in 4 micro-steps. With 2
  processes every rank sees 4 micro-batches of 16 (128 = 2 ranks x 4 micro-steps x 16). The
  micro-steps before the last run under DDP's ``no_sync()``, so gradients are all-reduced once
  per step, not 4 times, and ``strategy.backward(loss, batch)`` weights each micro-batch's loss
  by its share of the step, so the accumulated gradient is the mean over all 128 samples.
- ``precision="bf16"`` and ``with strategy.autocast():`` around the forward pass and the loss:
  matrix products run in bfloat16 (on the CPU too), the weights, gradients and optimizer stay
  float32. bf16 keeps fp32's exponent range, so it needs no loss scaling; with "fp16" the
  strategy adds a GradScaler and ``optimizer_step`` skips steps whose gradients overflowed.
- the loss printed is the mean over the whole step (all micro-steps, all ranks), not rank 0's
  share: ``sl.sum_over_ranks`` adds the ranks' parts.

With ``--precision fp32`` the weights equal 00_single.py's up to float rounding (the tests
check 1e-5 of the largest weight); in bf16 they are close, not equal.
"""
import argparse

import torch
from torch import nn

import scaleloop as sl

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="save the final weights here")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--accumulate", type=int, default=4)                          # new
parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])  # new
args = parser.parse_args()

torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")              # rank, world size: set by torchrun
sl.init_process_group(env)                            # join the group (Gloo on CPU)
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()

strategy = sl.strategy("ddp", env, precision=args.precision, accumulate=args.accumulate)  # new
model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
loader = strategy.loader(dataset, batch_size=128, shuffle=True, seed=0)   # still the global batch

step = 0
step_loss = torch.zeros(1)                                                  # new
for epoch in range(100):
    loader.set_epoch(epoch)
    for batch in loader:
        x, y = batch
        with strategy.micro_step(model, batch):       # no_sync on all but the last micro-step
            with strategy.autocast():                                       # new
                loss = criterion(model(x), y)
            strategy.backward(loss, batch)            # weighted by the micro-batch's share
        step_loss += loss.detach().float() * len(batch) / batch.place.step_samples  # new
        if batch.last_micro:
            strategy.optimizer_step(optimizer)
            step += 1
            step_loss = sl.sum_over_ranks(step_loss, env)                   # new: all ranks' parts
            if env.is_main and (step == 1 or step % 10 == 0):
                print(f"step {step}: loss {step_loss.item():.4f}")
            step_loss.zero_()
        if step == args.steps:
            break
    if step == args.steps:
        break

if env.is_main:
    print(f"rank {env.rank}/{env.world_size}: {step} steps, {args.precision}, accumulate {args.accumulate}")
    if args.out:
        torch.save(strategy.unwrap(model).state_dict(), args.out)
sl.destroy_process_group()                            # leave the group
