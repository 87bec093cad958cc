"""A nanoGPT-style training loop written by hand: the baseline scaleloop is measured against.

    python handwritten.py DIR [--steps 300] ...               # one process
    torchrun --nproc-per-node 2 handwritten.py DIR ...        # DDP, as nanoGPT's train.py runs it

Random windows from ``DIR/train.bin`` (uint16 tokens, read through np.memmap), drawn per step
from a seeded generator as nanoGPT's ``get_batch`` draws them; the same model scaleloop trains
(``TinyGPT``); AdamW with weight decay on the 2-D tensors, warm-up and cosine to a floor,
gradient clipping. Prints one JSON line: ms per step from the end of step 10 to the last (no start-up, no
evaluation), and the validation loss on ``val.bin``'s first sequential windows.
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from scaleloop.models import TinyGPT

parser = argparse.ArgumentParser()
parser.add_argument("data_dir")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=16)       # windows per step, all ranks together
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--d-model", type=int, default=128)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--min-lr", type=float, default=1e-4)
parser.add_argument("--warmup", type=int, default=30)
parser.add_argument("--eval-windows", type=int, default=256)
args = parser.parse_args()

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
torch.manual_seed(0)
train = np.memmap(Path(args.data_dir) / "train.bin", dtype=np.uint16, mode="r")
val = np.memmap(Path(args.data_dir) / "val.bin", dtype=np.uint16, mode="r")
per_rank = args.batch_size // world
draws = torch.Generator().manual_seed(1000 + rank)


def get_batch(tokens: np.ndarray, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([torch.from_numpy(tokens[s:s + args.seq_len].astype(np.int64)) for s in starts.tolist()])
    y = torch.stack([torch.from_numpy(tokens[s + 1:s + 1 + args.seq_len].astype(np.int64)) for s in starts.tolist()])
    return x, y


def lr_at(step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


model = TinyGPT(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers)
params = list(model.parameters())
optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
net = DistributedDataParallel(model) if distributed else model
model.train()
FIRST = 10   # timed from the end of step 10 on, as scaleloop's first log row (--log-every 10) is
marks: dict[int, float] = {}
for step in range(args.steps):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step)
    x, y = get_batch(train, torch.randint(len(train) - args.seq_len - 1, (per_rank,), generator=draws))
    loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step + 1 in (FIRST, args.steps):
        loss.item()   # (the CPU computes eagerly; on a GPU this would wait for the step)
        marks[step + 1] = time.perf_counter()
seconds = marks[args.steps] - marks[FIRST]

model.eval()
with torch.no_grad():   # val.bin's first windows, on rank 0 (the same number scaleloop's sample holds)
    starts = torch.arange(args.eval_windows) * args.seq_len
    x, y = get_batch(val, starts)
    val_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
if rank == 0:
    print(json.dumps({"loop": "handwritten", "world": world, "timed_s": seconds,
                      "ms_per_step": 1000 * seconds / (args.steps - FIRST), "val_loss": val_loss}), flush=True)
if distributed:
    dist.destroy_process_group()
