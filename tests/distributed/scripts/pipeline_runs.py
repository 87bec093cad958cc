"""Under torchrun: several short ``scaleloop.train`` runs with --strategy pipeline.

One launch for all of them (starting torch in fresh processes is most of a short run's cost).
Usage: pipeline_runs.py ROOT SET [RESUME_FROM]; SET names the runs of RUNS[SET]; each writes
ROOT/<name>. Rank 0 prints one JSON line: each run's strategy description and summary numbers.
"""
import json
import sys
from pathlib import Path

import scaleloop as sl
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train

# The same settings as test_pipeline.py's references (one process).
from pipeline_settings import RUNS

root, which = Path(sys.argv[1]), sys.argv[2]
resume_from = sys.argv[3] if len(sys.argv) > 3 else None
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for name, settings in RUNS[which].items():
    settings = dict(settings)
    if settings.pop("resume_from_argv", False):
        settings["resume"] = resume_from
    cfg = TrainConfig(**{**settings, "strategy": "pipeline", "nproc": env.world_size,
                         "out": str(root / name)}).validate()
    result = train(cfg, env, log=lambda _msg: None)
    described[name] = {"strategy": result.strategy, "steps": result.steps, "samples": result.samples,
                       "train_loss": result.train_loss,
                       "test_loss": result.test.loss if result.test else None}
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
