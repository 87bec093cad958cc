"""05 — fully sharded data parallelism (FSDP2), on top of 04_checkpoint.py.

    torchrun --nproc-per-node 2 examples/05_fsdp.py --stop-after 12   # "crashes" after step 12
    torchrun --nproc-per-node 2 examples/05_fsdp.py                   # resumes from step 10
    python examples/05_fsdp.py                                         # resumes on 1 process

The diff from 04_checkpoint.py:

- ``"fsdp"`` instead of ``"ddp"``: every parameter is cut into one piece per rank, and each
  rank keeps only its piece, its piece's gradient and its piece's optimizer state. Before a
  layer runs, its pieces are all-gathered; after backward its gradients are reduce-scattered
  (averaged over ranks, each rank receiving its own piece). Still data parallel: each rank
  trains on its half of the global batch, and N processes train the model one process would.
  The first line printed says how much of the model each rank holds.
- the checkpoint: no rank holds the whole model or optimizer state, so no rank can write it
  alone. Rank 0 creates the temporary checkpoint directory; ``strategy.save_checkpoint`` tells
  every rank its name and every rank writes its own pieces into it (one ``__<rank>_0.distcp``
  file each, through torch.distributed.checkpoint); rank 0 adds ``state.pt`` (position, RNG
  states) and the checksummed manifest, then renames it into place. On resume every rank reads
  the pieces it needs (``strategy.load_checkpoint``), whatever the number of processes that wrote
  them: a checkpoint of 2 processes resumes on 1, or on 4. Every rank must see the directory:
  on several machines it has to be on a shared file system.
- the final weights: ``strategy.full_state_dict(model)`` gathers the pieces into rank 0's CPU
  memory (every rank takes part), so ``--out`` holds a plain SimpleNet state_dict.
- with bf16, FSDP casts the gathered parameters to bf16 for compute and reduces gradients in
  fp32 (its MixedPrecisionPolicy); ``strategy.autocast()`` is then a no-op, and stays in the
  loop so that the same loop runs under every strategy.
"""
import argparse
from pathlib import Path

import torch
from torch import nn

import scaleloop as sl
from scaleloop.checkpoint.state import capture_rng, from_bytes, restore_rng, to_bytes
from scaleloop.checkpoint.store import (begin_checkpoint, finish_checkpoint, newest_valid,   # new
                                        prune)
from scaleloop.runtime.collectives import broadcast_object, gather_object

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="save the final weights here")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--accumulate", type=int, default=4)
parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
parser.add_argument("--ckpt-dir", default="checkpoints-05", help="where checkpoints go")
parser.add_argument("--checkpoint-every", type=int, default=5)
parser.add_argument("--stop-after", type=int, help="stop after this step, as a crash would")
args = parser.parse_args()

torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
dataset = sl.RandomDataset(2_000, input_dim=20, generator=torch.Generator().manual_seed(0))
model = sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1)
criterion = nn.BCEWithLogitsLoss()
total = sum(p.numel() for p in model.parameters())                                     # new

strategy = sl.strategy("fsdp", env, precision=args.precision, accumulate=args.accumulate)   # new: fsdp
model, optimizer = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
loader = strategy.loader(dataset, batch_size=128, shuffle=True, seed=0)
root = Path(args.ckpt_dir)
held = gather_object(sum(p.to_local().numel() for p in model.parameters()), env)     # new
if env.is_main:                                                                         # new
    print(f"{strategy.describe()} x {env.world_size}: of the {total:,} parameters, "
          + ", ".join(f"rank {r} holds {n:,}" for r, n in enumerate(held)))


def save_checkpoint(step: int, epoch: int, step_in_epoch: int) -> None:
    """Every rank calls this: each writes its own pieces (a collective)."""
    tmp = begin_checkpoint(root, step) if env.is_main else None                        # new
    entries = strategy.save_checkpoint(model, optimizer, tmp)                          # new: every rank, into rank 0's tmp
    rngs = gather_object(capture_rng(env.device), env)
    if env.is_main:
        state = {**entries,   # new: {"sharded": ...}, the model and optimizer are the .distcp files
                 "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "rng": rngs}
        path = finish_checkpoint(root, step, tmp, {"state.pt": to_bytes(state)},     # new
                                 {"world_size": env.world_size})
        prune(root, keep=2)
        print(f"checkpoint: {path} ({', '.join(sorted(p.name for p in path.glob('*.distcp')))})")


def load_checkpoint() -> tuple[int, int, int]:
    """The newest valid checkpoint into model and optimizer; returns (step, epoch, step_in_epoch)."""
    found = newest_valid(root, warn=print) if env.is_main else None
    data = broadcast_object((str(found.path), found.state_file.read_bytes()) if found else None, env)
    if data is None:
        return 0, 0, 0
    path, state = Path(data[0]), from_bytes(data[1], data[0])
    strategy.load_checkpoint(model, optimizer, state, path)   # new: each rank reads the pieces it needs
    if env.rank < len(state["rng"]):
        restore_rng(state["rng"][env.rank], env.device)
    if env.is_main:
        print(f"resumed from {path} (written by {len(state['rng'])} process(es)): "
              f"epoch {state['epoch']}, step {state['step_in_epoch']} of the epoch")
    return state["step"], state["epoch"], state["step_in_epoch"]


step, start_epoch, start_step = load_checkpoint()
step_loss = torch.zeros(1)
for epoch in range(start_epoch, 100):
    loader.set_epoch(epoch, start_step if epoch == start_epoch else 0)
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
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint(step, epoch, batch.step + 1)
            if step == args.stop_after:
                if env.is_main:
                    print(f"stopping after step {step} (--stop-after); run again to resume")
                strategy.close()
                sl.destroy_process_group()
                raise SystemExit(0)
    if step == args.steps:
        break

weights = strategy.full_state_dict(model)          # new: every rank helps gather the pieces
if env.is_main:
    print(f"rank {env.rank}/{env.world_size}: {step} steps, {args.precision}, accumulate {args.accumulate}")
    if args.out:
        torch.save(weights, args.out)
strategy.close()                                    # new: ends the one-process group fsdp starts itself
sl.destroy_process_group()
