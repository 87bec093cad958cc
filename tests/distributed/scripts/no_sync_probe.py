"""Under torchrun: count DDP's gradient all-reduces per micro-step with a communication hook."""
import json
import sys

import torch
import torch.distributed as dist

import scaleloop as sl

accumulate = int(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
strategy = sl.strategy("ddp", env, accumulate=accumulate)
model, optimizer = strategy.setup(sl.SimpleNet(8, 16, 1), lambda p: torch.optim.SGD(p, lr=0.1))

micro_of_call: list[int] = []
current = {"micro": -1}


def counting_hook(state, bucket):
    micro_of_call.append(current["micro"])
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(env.world_size))


model.register_comm_hook(None, counting_hook)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = strategy.loader(data, batch_size=16 * accumulate, shuffle=False)
loader.set_epoch(0)
for batch in loader:
    x, y = batch
    current["micro"] = batch.place.micro
    with strategy.micro_step(model, batch):
        strategy.backward(torch.nn.functional.mse_loss(model(x), y), batch)
    if batch.last_micro:
        strategy.optimizer_step(optimizer)
if env.is_main:
    print(json.dumps({"micro_of_call": micro_of_call, "batches": len(loader)}))
# Every rank done with its hooked all-reduces before the group is torn down: exiting while a
# peer still has Gloo work in flight can abort the process ("terminate called ...").
dist.barrier()
sl.destroy_process_group()
