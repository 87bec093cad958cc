"""08 — a language model on a token file: evaluation every N steps, AdamW with weight decay on the
matrices only, warm-up and cosine down to a floor. The same script on 1 or N processes.

    python examples/08_language_model.py [--steps 60] [--eval-every 20]
    torchrun --nproc-per-node 2 examples/08_language_model.py

The diff from 02_ddp.py is the data and the settings people train language models with:

- the data is a **token file**: a flat array of uint16 token ids (``train.bin``, and ``val.bin``
  for validation), the layout nanoGPT's data preparation writes. With no ``--data-dir`` the
  script makes one from this repository's own documentation, one token per byte (a vocabulary of
  256). ``TokenFileDataset`` maps the file (never reads it whole) and cuts it into windows:
  random ones for training (window i starts at a seeded hash of i, so the step plan gives every
  step the same windows on 1 or N ranks), consecutive ones for validation;
- **evaluation every N steps** on ``val.bin``, with ``sl.evaluate``: exact over ranks (each
  window counted once, the losses summed in float64), so 1 and N processes print the same value
  for the same model; the models themselves differ by float rounding (N ranks add their
  gradients in another order, and Adam's steps carry that on), so the printed losses agree to
  about three digits;
- **weight decay on the matrices only** (embeddings and linear weights, 2 or more dimensions),
  not on biases and LayerNorm scales: two parameter groups;
- **warm-up, then cosine decay to a floor** (``--min-lr``), not to zero.

``scaleloop train --data tokenfile --data-dir DIR --model tinygpt --eval-every 20
--weight-decay 0.1 --lr-schedule cosine --warmup-steps 6 --min-lr 3e-4`` runs the same
recipe from the command line (docs/optimizer.md, docs/models-and-data.md).
"""
import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import scaleloop as sl
from scaleloop.data.tokenfile import TokenFileDataset

parser = argparse.ArgumentParser()
parser.add_argument("--data-dir", help="holds train.bin and val.bin (uint16 tokens); default: made from the docs")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=32)                 # windows per step, all ranks
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--min-lr", type=float, default=3e-4)
parser.add_argument("--warmup", type=int, default=6)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--out", help="save the final weights here")
args = parser.parse_args()


def write_token_files(directory: Path) -> None:
    """train.bin and val.bin from the repository's docs: one uint16 token per byte, 90% / 10%."""
    root = Path(__file__).resolve().parent.parent
    text = b"".join(p.read_bytes() for p in sorted([root / "README.md", *(root / "docs").glob("*.md")]))
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * 0.9)
    tokens[:cut].tofile(directory / "train.bin")
    tokens[cut:].tofile(directory / "val.bin")


def lr_factor(step: int) -> float:
    """Warm-up from 0 to the peak over --warmup steps, then a cosine from the peak to --min-lr."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    floor = args.min_lr / args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


torch.manual_seed(0)
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
scratch = tempfile.TemporaryDirectory() if args.data_dir is None else None
data_dir = Path(args.data_dir or scratch.name)
if scratch is not None:
    write_token_files(data_dir)   # every rank writes its own copy: nothing is shared between them
train = TokenFileDataset(data_dir / "train.bin", args.seq_len, vocab_size=256, windows="random", seed=0)
val = TokenFileDataset(data_dir / "val.bin", args.seq_len, vocab_size=256, windows="sequential")
info = sl.DataInfo("docs", "lm", (args.seq_len,), 256)
model = sl.TinyGPT(vocab_size=256, seq_len=args.seq_len, d_model=64, n_layers=2, n_heads=4)
criterion = nn.CrossEntropyLoss()


def adamw(params):
    """Two groups: weight decay on tensors of 2 or more dimensions only (the strategy's own
    parameters, so that this works whatever it wrapped the model in)."""
    params = list(params)
    decayed = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": args.weight_decay},
                              {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


strategy = sl.strategy("ddp" if env.is_distributed else "single", env)
model, optimizer = strategy.setup(model, adamw)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
loader = strategy.loader(train, batch_size=args.batch_size, shuffle=True, seed=0)

step, epoch = 0, 0
while step < args.steps:
    loader.set_epoch(epoch)
    for batch in loader:
        x, y = batch
        with strategy.micro_step(model, batch):
            logits = model(x)
            loss = criterion(logits.flatten(0, 1), y.flatten())
            strategy.backward(loss, batch)
        if batch.last_micro:
            strategy.clip_grad_norm(model, optimizer, 1.0)
            strategy.optimizer_step(optimizer)
            schedule.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                result = sl.evaluate(model, val, info, strategy, batch_size=64)   # every rank takes part
                model.train()
                if env.is_main:
                    print(f"step {step}: val loss {result.loss:.4f}, next-token accuracy {result.accuracy:.2%}, "
                          f"lr {schedule.get_last_lr()[0]:.2e}", flush=True)
        if step == args.steps:
            break
    epoch += 1

if env.is_main:
    print(f"rank {env.rank}/{env.world_size}: {step} steps, val loss {result.loss:.4f}")
    if args.out:
        torch.save(strategy.unwrap(model).state_dict(), args.out)
strategy.close()
sl.destroy_process_group()
if scratch is not None:
    scratch.cleanup()
