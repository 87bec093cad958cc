"""Under torchrun: several short ``scaleloop.train`` runs with --strategy pipeline.

One launch for all of them (starting torch in fresh processes is most of a short run's cost).
Usage: pipeline_runs.py ROOT SET [RESUME_FROM]; SET names the runs of RUNS[SET]; each writes
ROOT/<name>. Rank 0 prints one JSON line: each run's strategy description and summary numbers.
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import scaleloop as sl
from scaleloop.models import SimpleNet
from scaleloop.runtime.collectives import gather_object
import scaleloop
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train

# The same settings as test_pipeline.py's references (one process).
from pipeline_settings import RUNS



def probe(env: sl.DistEnv) -> dict:
    """What each stage loads, and fp16's skipped steps: an inf in the LAST stage's gradient only
    (step 0) makes every stage skip that step and lower its scale alike; step 1 steps everywhere."""
    torch.manual_seed(0)
    strategy = scaleloop.strategy("pipeline", env, precision="fp16", microbatches=2)
    model, opt = strategy.setup(SimpleNet(6, 8, 3), lambda ps: torch.optim.SGD(ps, lr=0.1))
    data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    loader = strategy.loader(data, batch_size=8, shuffle=False)
    loader.set_epoch(0)
    loaded, steps = None, []
    for i, batch in enumerate(loader):
        x, y = batch
        loaded = {"inputs": x is not None, "target": y is not None}
        before = [p.detach().clone() for p in model.parameters()]
        strategy.forward_backward(model, batch, F.cross_entropy)
        if i == 0 and strategy.is_last:
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
        stepped = bool(strategy.optimizer_step(opt))
        changed = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        steps.append({"stepped": stepped, "changed": changed, "scale": strategy.precision.scaler.get_scale()})
    return {"loaded": gather_object(loaded, env), "fp16": gather_object(steps, env)}


root, which = Path(sys.argv[1]), sys.argv[2]
resume_from = sys.argv[3] if len(sys.argv) > 3 else None
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for name, settings in RUNS[which].items():
    settings = dict(settings)
    if settings.pop("resume_from_argv", False):
        settings["resume"] = resume_from
    if "resume_from_run" in settings:
        settings["resume"] = str(root / settings.pop("resume_from_run"))
    cfg = TrainConfig(**{**settings, "strategy": "pipeline", "nproc": env.world_size,
                         "out": str(root / name)}).validate()
    result = train(cfg, env, log=lambda _msg: None)
    described[name] = {"strategy": result.strategy, "steps": result.steps, "samples": result.samples,
                       "train_loss": result.train_loss,
                       "test_loss": result.test.loss if result.test else None}
if which == "two":
    described["probe"] = probe(env)
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
