"""04 — checkpoint and resume, on top of 03_accumulate_bf16.py.

    torchrun --nproc-per-node 2 examples/04_checkpoint.py --stop-after 12   # "crashes" after step 12
    torchrun --nproc-per-node 2 examples/04_checkpoint.py                   # resumes from step 10
    python examples/04_checkpoint.py                                         # also resumes, on 1 process

The diff from 03_accumulate_bf16.py:

- every ``--checkpoint-every`` optimizer steps (and at the end) the run's whole state goes into
  ``--ckpt-dir``: the model (unwrapped, so it loads into a plain SimpleNet), the optimizer,
  where the run stands (epoch, step inside the epoch, global step) and every rank's random
  number generators. scaleloop's checkpoint store writes it atomically: into a hidden
  temporary directory, fsynced, with a manifest of SHA-256 checksums, then renamed to
  ``step-N``; a process killed at any moment leaves the previous checkpoints intact.
- at start-up, rank 0 looks for the newest checkpoint that verifies and sends its bytes to
  every rank (so the ranks need no shared file system); every rank loads it and the loop
  continues mid-epoch with ``loader.set_epoch(epoch, start_step)``: the data order of an epoch
  depends only on the seed and the epoch, so the samples that remain are exactly known.
- ``--stop-after K`` stops the run after step K without a checkpoint, as a crash would: the
  steps after the last checkpoint are trained again on the same samples.

A resumed run ends with the weights of an uninterrupted one: bit for bit on the same number of
processes, and up to float rounding on another (the global batch, and so each step's samples,
do not depend on it). ``scaleloop train`` does all this itself (docs/checkpointing.md).
"""
import argparse
from pathlib import Path

import torch
from torch import nn

import scaleloop as sl
from scaleloop.checkpoint.state import capture_rng, from_bytes, restore_rng, to_bytes   # new
from scaleloop.checkpoint.store import newest_valid, prune, write_checkpoint            # new
from scaleloop.runtime.collectives import broadcast_object, gather_object              # new

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="save the final weights here")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--accumulate", type=int, default=4)
parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
parser.add_argument("--ckpt-dir", default="checkpoints-04", help="where checkpoints go")      # new
parser.add_argument("--checkpoint-every", type=int, default=5)                                # new
parser.add_argument("--stop-after", type=int, help="stop after this step, as a crash would")  # new
args = parser.parse_args()

torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()

strategy = sl.strategy("ddp", env, precision=args.precision, accumulate=args.accumulate)
model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
loader = strategy.loader(dataset, batch_size=128, shuffle=True, seed=0)
root = Path(args.ckpt_dir)


def save_checkpoint(step: int, epoch: int, step_in_epoch: int) -> None:                      # new
    """Every rank calls this: the RNG states are gathered from all of them (a collective)."""
    rngs = gather_object(capture_rng(env.device), env)
    if env.is_main:   # replicas: rank 0 holds everything else
        state = {"model": strategy.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "rng": rngs}
        path = write_checkpoint(root, step, {"state.pt": to_bytes(state)}, {"world_size": env.world_size})
        prune(root, keep=2)
        print(f"checkpoint: {path}")


def load_checkpoint() -> tuple[int, int, int]:                                               # new
    """The newest valid checkpoint into model and optimizer; returns (step, epoch, step_in_epoch)."""
    found = newest_valid(root, warn=print) if env.is_main else None
    data = broadcast_object(found.state_file.read_bytes() if found else None, env)
    if data is None:
        return 0, 0, 0                                  # nothing to resume: a fresh start
    state = from_bytes(data, str(root))                 # weights-only: tensors and plain values
    strategy.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if env.rank < len(state["rng"]):                    # a rank that did not exist keeps its seed
        restore_rng(state["rng"][env.rank], env.device)
    if env.is_main:
        print(f"resumed from {found.path} (written by {len(state['rng'])} process(es)): "
              f"epoch {state['epoch']}, step {state['step_in_epoch']} of the epoch")
    return state["step"], state["epoch"], state["step_in_epoch"]


step, start_epoch, start_step = load_checkpoint()                                            # new
step_loss = torch.zeros(1)
for epoch in range(start_epoch, 100):                                                        # new: start_epoch
    loader.set_epoch(epoch, start_step if epoch == start_epoch else 0)                       # new: mid-epoch
    for batch in loader:
        if step == args.steps:
            break
        x, y = batch
        with strategy.micro_step(model, batch):
            with strategy.autocast():
                loss = criterion(model(x), y)
            strategy.backward(loss, batch)
        step_loss += loss.detach().float() * len(batch) / batch.place.step_samples
        if batch.last_micro:
            strategy.optimizer_step(optimizer)
            step += 1
            step_loss = sl.sum_over_ranks(step_loss, env)
            if env.is_main and (step == 1 or step % 10 == 0):
                print(f"step {step}: loss {step_loss.item():.4f}")
            step_loss.zero_()
            if step % args.checkpoint_every == 0 or step == args.steps:                     # new
                save_checkpoint(step, epoch, batch.step + 1)
            if step == args.stop_after:                                                      # new
                if env.is_main:
                    print(f"stopping after step {step} (--stop-after); run again to resume")
                sl.destroy_process_group()
                raise SystemExit(0)
    if step == args.steps:
        break

if env.is_main:
    print(f"rank {env.rank}/{env.world_size}: {step} steps, {args.precision}, accumulate {args.accumulate}")
    if args.out:
        torch.save(strategy.unwrap(model).state_dict(), args.out)
sl.destroy_process_group()
