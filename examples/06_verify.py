"""06 — check it: 1 process and 2 processes train the same model, step by step.

    python examples/06_verify.py [--strategy ddp|allreduce|fsdp] [--accumulate 2] [--steps 30]

The diff from 02_ddp.py: the loop moves into a function ``train(strategy_name)`` that returns
the loss of every step and the final weights. This script runs it twice and compares:

- in this process, as one process with strategy "single": the reference;
- in 2 worker processes with ``sl.launch(train, nproc=2, ...)``: torchrun's elastic launcher
  as a function call; the workers see RANK / WORLD_SIZE as under torchrun. ``all_ranks=True``
  returns every rank's result, so the script also checks that the two replicas hold identical
  weights, bit for bit.

Run it under plain ``python``, not torchrun: it starts its own workers. The exit code is 0 when
the 2-process weights are within 1e-5 of the largest weight of the 1-process ones (the
difference left is float rounding from adding the gradients in another order), 1 otherwise.
``scaleloop verify`` does the same for the built-in models and your own ``--model``/``--data``,
and names the cause when they differ (docs/verification.md).
"""
import argparse
import sys

import torch
from torch import nn

import scaleloop as sl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--strategy", default="ddp", choices=["ddp", "allreduce", "fsdp"])
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--tolerance", type=float, default=1e-5)
args = parser.parse_args()


def train(strategy_name: str) -> dict:                                  # new: the loop, as a function
    torch.manual_seed(0)
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env)                                          # no-op for one process
    dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
    model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
    criterion = nn.BCEWithLogitsLoss()

    strategy = sl.strategy(strategy_name, env, accumulate=args.accumulate)
    model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    loader = strategy.loader(dataset, batch_size=128, shuffle=True, seed=0)   # global batch

    losses = []                                                         # new: every step's loss
    step_loss = torch.zeros(1)
    step = 0
    for epoch in range(100):
        loader.set_epoch(epoch)
        for batch in loader:
            x, y = batch
            with strategy.micro_step(model, batch):
                loss = criterion(model(x), y)
                strategy.backward(loss, batch)
            step_loss += loss.detach() * len(batch) / batch.place.step_samples
            if batch.last_micro:
                strategy.optimizer_step(optimizer)
                step += 1
                losses.append(sl.sum_over_ranks(step_loss, env).item())   # over all ranks
                step_loss.zero_()
            if step == args.steps:
                break
        if step == args.steps:
            break

    weights = {k: v.detach().cpu().clone() for k, v in strategy.full_state_dict(model).items()}
    strategy.close()                                                    # releases what the strategy set up
    sl.destroy_process_group()
    return {"losses": losses, "weights": weights}                       # new: returned, not saved


one = train("single")                                                   # new: the reference, here
ranks = sl.launch(train, nproc=2, args=(args.strategy,), all_ranks=True)   # new: 2 workers
two = ranks[0]

print(f"1 process (single) vs 2 processes ({args.strategy}), accumulate {args.accumulate}, "
      f"{args.steps} steps of global batch 128")
print("  step  loss (1 proc)  loss (2 procs)")
for i, (a, b) in enumerate(zip(one["losses"], two["losses"]), start=1):
    if i == 1 or i % 10 == 0:
        print(f"  {i:4d}  {a:13.6f}  {b:14.6f}")

scale = max(w.abs().max().item() for w in one["weights"].values())
print("  parameter      max |1 proc - 2 procs|  of the largest weight")
worst = 0.0
for name, w in one["weights"].items():
    diff = (w - two["weights"][name]).abs().max().item()
    worst = max(worst, diff / scale)
    print(f"  {name:13s}  {diff:21.3e}  {diff / scale:21.2e}")

# Every rank applied the same averaged gradient, so the replicas must be identical, not just close.
# (Under fsdp only rank 0 gets the gathered weights; full_state_dict is empty on the others.)
others = [r for r in ranks if r != 0 and ranks[r]["weights"]]
same = all(torch.equal(ranks[r]["weights"][k], two["weights"][k]) for r in others for k in two["weights"])
if others:
    print(f"  replicas: rank 1's weights {'equal' if same else 'DIFFER FROM'} rank 0's bit for bit")

ok = worst <= args.tolerance and same
print(f"verdict: {'PASS' if ok else 'FAIL'} (largest difference {worst:.1e} of the largest weight, "
      f"tolerance {args.tolerance:g})")
sys.exit(0 if ok else 1)
