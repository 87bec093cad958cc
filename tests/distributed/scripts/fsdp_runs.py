"""Under torchrun with 2 processes: several short ``scaleloop.train`` runs with --strategy fsdp.

One launch for all of them (starting torch in fresh processes is most of a short run's cost).
Usage: fsdp_runs.py ROOT; each run writes ROOT/<name>; rank 0 prints one JSON line with each
run's strategy description.
"""
import json
import sys
from pathlib import Path

import scaleloop as sl
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train

# The same settings as SIX in test_fsdp.py (for the single-process references).
BASE = dict(data="random", n_samples=1000, model="simplenet", epochs=1, max_steps=6, batch_size=64,
            optimizer="adam", lr=0.01, progress=False, tensorboard=False, log_every=1, device="cpu",
            strategy="fsdp", nproc=2)
RUNS = {
    "accumulate1": {},
    "accumulate2": {"accumulate": 2},
    "clip": {"accumulate": 2, "clip_grad": 0.05},
    "first-half": {"max_steps": 3},  # resumed on one process by the test
}

root = Path(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for name, changes in RUNS.items():
    cfg = TrainConfig(**{**BASE, **changes, "out": str(root / name)}).validate()
    described[name] = train(cfg, env, log=lambda _msg: None).strategy
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
