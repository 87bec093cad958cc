"""Under torchrun (or plain python): exact evaluation of a 101-sample set; rank 0 prints JSON.

The model is float64 so that the per-sample outputs do not depend on how rows are batched
(float32 matmul kernels may round a row differently for another batch shape); what is left
to differ between world sizes is then only how evaluation splits, sums and gathers.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

import scaleloop as sl
from scaleloop.data.info import DataInfo
from scaleloop.loop.evaluation import evaluate
from scaleloop.runtime.collectives import gather_padded, gather_tensor, shard_indices, sum_over_ranks

N, CLASSES = 101, 3

env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
rank, world = env.rank, env.world_size

g = torch.Generator().manual_seed(0)
x = torch.randn(N, 8, generator=g, dtype=torch.float64)
y = torch.randint(0, CLASSES, (N,), generator=g)
tensors = TensorDataset(x, y)


class Plain(Dataset):
    """Read sample by sample: evaluate's DataLoader path."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return x[i], y[i]


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)).double()
strategy = sl.strategy("ddp" if world > 1 else "single", env)
model, _ = strategy.setup(net, lambda p: torch.optim.SGD(p, lr=0.1))
info = DataInfo("eval-exact", "classification", (8,), CLASSES)
report = {"world": world}
# batch 8: several uneven local batches per rank
for name, ds in (("evaluate", tensors), ("evaluate_loader", Plain())):
    r = evaluate(model, ds, info, strategy, batch_size=8)
    report[name] = {"loss": r.loss, "accuracy": r.accuracy, "samples": r.samples}

# A user's own metric: logits of this rank's block, gathered into dataset order.
mine = shard_indices(N, env)
with torch.no_grad():
    logits = torch.cat([model(xb) for xb, _ in DataLoader(Subset(tensors, mine), batch_size=16)]
                       or [torch.empty(0, CLASSES, dtype=torch.float64)])
all_logits = gather_tensor(logits, env)
order = gather_tensor(torch.tensor(list(mine), dtype=torch.int64), env)
assert torch.equal(order, torch.arange(N)), order
assert all_logits.shape == (N, CLASSES), all_logits.shape
correct = gather_tensor(logits.argmax(1) == y[mine.start:mine.stop], env)
assert correct.dtype == torch.bool and correct.shape == (N,)
counts = sum_over_ranks([float(F.cross_entropy(logits, y[mine.start:mine.stop], reduction="sum")),
                         float(correct[mine.start:mine.stop].sum())], env)
report["gathered"] = {"loss": float(F.cross_entropy(all_logits, y)),
                      "accuracy": float(correct.double().mean()),
                      "summed_loss": float(counts[0]) / N, "summed_accuracy": float(counts[1]) / N}

# torch's DistributedSampler: round-robin, padded by repeating; gather_padded undoes both.
for shuffle in (False, True):
    sampler = DistributedSampler(tensors, num_replicas=world, rank=rank, shuffle=shuffle, seed=1)
    idx = torch.tensor(list(sampler), dtype=torch.int64)
    with torch.no_grad():
        padded_logits = model(x[idx])
    seen = gather_padded(idx, env, N)
    if shuffle:
        assert torch.equal(seen.sort().values, torch.arange(N)), seen
    else:
        assert torch.equal(seen, torch.arange(N)), seen
        assert torch.allclose(gather_padded(padded_logits, env, N), all_logits, rtol=1e-12, atol=0)

# Different row counts per rank, rank 0 with none.
ragged = gather_tensor(torch.full((rank, 2), rank), env)
assert ragged.tolist() == [[r, r] for r in range(world) for _ in range(r)], ragged

if env.is_main:
    torch.save(all_logits, sys.argv[1])
    print(json.dumps(report))
sl.destroy_process_group()
