"""Under torchrun with 2 processes: short ``scaleloop.train`` runs of the models in usermodels.py.

One launch for all of them. Usage: usermodel_runs.py ROOT [GROUP[,GROUP...]]; each run writes
ROOT/<name>; rank 0 prints one JSON line with each run's strategy description. The runs are the
GROUPs (default RUNS) of usermodel_settings.py, which the tests' 1-process references train too.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/distributed, for the settings

import scaleloop as sl  # noqa: E402
from scaleloop.config import TrainConfig  # noqa: E402
from scaleloop.loop.training import train  # noqa: E402
import usermodel_settings  # noqa: E402

root = Path(sys.argv[1])
group = {name: changes for part in (sys.argv[2] if len(sys.argv) > 2 else "RUNS").split(",")
         for name, changes in getattr(usermodel_settings, part).items()}
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for name, changes in group.items():
    cfg = TrainConfig(**{**usermodel_settings.BASE, **changes, "nproc": 2, "out": str(root / name)}).validate()
    described[name] = train(cfg, env, log=lambda _msg: None).strategy
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
