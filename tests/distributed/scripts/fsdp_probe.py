"""Under torchrun with 2 processes: what FSDP must get right beyond "the weights match".

Rank 0 prints one JSON line; each check also asserts here, so a failure names itself.

1. Accumulation: a micro-step before the last leaves no sharded gradient (nothing was
   reduce-scattered); the last one does.
2. fp16: an inf in ONE rank's gradient shard makes EVERY rank skip the step (the GradScaler's
   inf check is reduced over ranks), and the scales stay equal.
3. Evaluation with uneven local batch counts (2 vs 1, and 1 vs 0): no hang, exact results.
4. The units: SimpleNet's Linears, ConvNet's features/head plus its BatchNorms (own fp32 units
   under bf16), TinyGPT's blocks; each rank holds half of each parameter.
5. full_state_dict: rank 0 gets the full tensors, rank 1 nothing.
6. ConvNet with (unsynchronised) BatchNorm: fsdp ends with DDP's weights AND buffers (rank 0's
   running statistics), though FSDP does not broadcast buffers at each forward as DDP does.
"""
import copy
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import TensorDataset

import scaleloop as sl
from scaleloop.data.info import DataInfo
from scaleloop.loop.evaluation import evaluate
from scaleloop.models import ConvNet, SimpleNet, TinyGPT
from scaleloop.runtime.collectives import gather_object
import scaleloop
from scaleloop.strategies import SingleDevice

env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
rank = env.rank
assert env.world_size == 2
report: dict = {}


def shards(model: nn.Module) -> dict:
    return {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}


# 1. accumulation: no reduce-scatter before the last micro-step
torch.manual_seed(0)
strategy = scaleloop.strategy("fsdp", env, precision="fp32", accumulate=2)
model, opt = strategy.setup(SimpleNet(6, 8, 3), lambda ps: torch.optim.SGD(ps, lr=0.1))
x = torch.randn(4, 6) + rank
with strategy.micro_step(model, 0):
    strategy.backward(model(x).pow(2).mean())
after_first = [p.grad is None for p in model.parameters()]
with strategy.micro_step(model, 1):
    strategy.backward(model(x).pow(2).mean())
after_last = [p.grad is not None for p in model.parameters()]
assert all(after_first), f"rank {rank}: a sharded gradient exists after a non-final micro-step"
assert all(after_last), f"rank {rank}: no sharded gradient after the last micro-step"
report["accumulate"] = {"no_grad_after_first": all(after_first), "grad_after_last": all(after_last)}

# 2. fp16: an inf on one rank only -> every rank skips the step
torch.manual_seed(0)
strategy = scaleloop.strategy("fsdp", env, precision="fp16")
model, opt = strategy.setup(SimpleNet(6, 8, 3), lambda ps: torch.optim.SGD(ps, lr=0.1))
results = []
for step in range(2):
    before = [p.detach().to_local().clone() for p in model.parameters()]
    with strategy.autocast():
        loss = model(torch.randn(4, 6) + rank).float().pow(2).mean()
    strategy.backward(loss)
    if step == 0 and rank == 1:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    norm = float(strategy.clip_grad_norm(model, opt, 1.0))
    stepped = bool(strategy.optimizer_step(opt))
    changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    results.append({"stepped": stepped, "changed": changed, "scale": strategy.precision.scaler.get_scale(),
                    "norm_finite": math.isfinite(norm)})
everyone = gather_object(results, env)
assert everyone[0] == everyone[1], f"ranks disagree on fp16 steps: {everyone}"
assert not everyone[0][0]["stepped"] and not everyone[0][0]["changed"], everyone
assert everyone[0][1]["stepped"] and everyone[0][1]["changed"], everyone
report["fp16"] = everyone

# 3. evaluation: uneven numbers of local batches
torch.manual_seed(0)
plain = SimpleNet(6, 8, 3)
reference = copy.deepcopy(plain)
strategy = scaleloop.strategy("fsdp", env, precision="fp32")
model, _ = strategy.setup(plain, lambda ps: torch.optim.SGD(ps, lr=0.1))
info = DataInfo(name="probe", task="classification", input_shape=(6,), num_classes=3)
g = torch.Generator().manual_seed(1)
evals = {}
for n in (3, 1):
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    got = evaluate(model, data, info, strategy, batch_size=1)
    want = evaluate(reference, data, info, SingleDevice(sl.DistEnv()), batch_size=1)
    assert got.samples == want.samples == n and got.accuracy == want.accuracy, (got, want)
    assert abs(got.loss - want.loss) <= 1e-6 * max(1.0, abs(want.loss)), (got, want)
    evals[n] = {"loss": got.loss, "reference": want.loss}
report["evaluate"] = evals

# 4. units
units = {}
torch.manual_seed(0)
strategy = scaleloop.strategy("fsdp", env, precision="fp32")
mlp, _ = strategy.setup(SimpleNet(6, 8, 3), lambda ps: torch.optim.SGD(ps, lr=0.1))
units["simplenet"] = sorted(n or "<root>" for n, m in mlp.named_modules() if isinstance(m, FSDPModule))
assert units["simplenet"] == ["<root>", "net.0", "net.2"], units
assert shards(mlp)["net.0.weight"] == (4, 6), shards(mlp)
strategy = scaleloop.strategy("fsdp", env, precision="bf16")
conv, conv_opt = strategy.setup(ConvNet(1, 10, (8, 8), width=4), lambda ps: torch.optim.SGD(ps, lr=0.1))
units["convnet_bf16"] = sorted(n or "<root>" for n, m in conv.named_modules() if isinstance(m, FSDPModule))
assert units["convnet_bf16"] == ["<root>", "features", "features.1", "features.5", "head"], units
out = conv(torch.randn(3, 1, 8, 8))
assert out.dtype == torch.bfloat16, out.dtype
strategy.backward(out.float().sum())
strategy.optimizer_step(conv_opt)
strategy = scaleloop.strategy("fsdp", env, precision="fp32")
gpt, _ = strategy.setup(TinyGPT(vocab_size=16, seq_len=8, d_model=16, n_layers=2, n_heads=2),
                        lambda ps: torch.optim.SGD(ps, lr=0.1))
units["tinygpt"] = sorted(n or "<root>" for n, m in gpt.named_modules() if isinstance(m, FSDPModule))
assert units["tinygpt"] == ["<root>", "blocks.0", "blocks.1"], units
report["units"] = units

# 5. the full weights on rank 0 only
full = strategy.full_state_dict(gpt)
if rank == 0:
    assert full["blocks.0.mlp.0.weight"].shape == (64, 16) and full["lm_head.weight"].shape == (16, 16), full.keys()
    assert all(t.device.type == "cpu" for t in full.values())
else:
    assert full == {}, list(full)
counts = gather_object(len(full), env)
assert counts[0] > 0 and counts[1] == 0, counts
report["full_state_dict_entries"] = counts



# 6. BatchNorm buffers: fsdp == ddp, in the weights, the buffers and the evaluation (which uses
#    the running statistics: rank 1 must evaluate with rank 0's, as under DDP)
conv_info = DataInfo(name="probe", task="classification", input_shape=(1, 8, 8), num_classes=10)
g = torch.Generator().manual_seed(2)
conv_test = TensorDataset(torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 10, (10,), generator=g))


def train_conv(name: str) -> tuple:
    torch.manual_seed(0)
    strategy = scaleloop.strategy(name, env, precision="fp32")
    model, opt = strategy.setup(ConvNet(1, 10, (8, 8), width=4), lambda ps: torch.optim.SGD(ps, lr=0.1))
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own samples
    for _ in range(3):
        x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        strategy.backward(F.cross_entropy(model(x), y))
        strategy.optimizer_step(opt)
    result = evaluate(model, conv_test, conv_info, strategy, batch_size=3)
    return strategy.full_state_dict(model), result


(by_fsdp, eval_fsdp), (by_ddp, eval_ddp) = train_conv("fsdp"), train_conv("ddp")
assert eval_fsdp.accuracy == eval_ddp.accuracy, (eval_fsdp, eval_ddp)
assert abs(eval_fsdp.loss - eval_ddp.loss) <= 1e-6 * abs(eval_ddp.loss), (eval_fsdp, eval_ddp)
if rank == 0:
    assert by_fsdp.keys() == by_ddp.keys()
    diffs = {k: float((by_fsdp[k].float() - by_ddp[k].float()).abs().max()) for k in by_ddp}
    assert max(diffs.values()) <= 1e-6, diffs
    report["convnet_fsdp_vs_ddp"] = {"weights": max(diffs.values()), "eval_loss": [eval_fsdp.loss, eval_ddp.loss]}

sl.destroy_process_group()
if rank == 0:
    print(json.dumps(report))
