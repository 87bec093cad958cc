"""Under torchrun with 2 processes: fsdp on models with an FSDP unit that only some ranks run.

Usage: usermodel_errors.py ROOT. Each run of usermodels' ``RareExpertTop`` (the expert's forward
runs on some ranks only) and ``RareExpertFirst`` (its backward does) must stop on every rank with
the same UsageError; rank 0 prints one JSON line: model -> [each rank's error line].
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/distributed, for the settings

import torch.distributed as torch_dist  # noqa: E402

import scaleloop as sl  # noqa: E402
from scaleloop.config import TrainConfig  # noqa: E402
from scaleloop.errors import UsageError  # noqa: E402
from scaleloop.loop.training import train  # noqa: E402
from scaleloop.runtime.collectives import gather_object  # noqa: E402
import usermodel_settings  # noqa: E402

root = Path(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env, timeout_s=60)
said = {}
for model in ("RareExpertTop", "RareExpertFirst"):
    cfg = TrainConfig(**{**usermodel_settings.BASE, "model": f"usermodels:{model}", "data": "digits",
                         "strategy": "fsdp", "nproc": 2, "out": str(root / model)}).validate()
    try:
        train(cfg, env, log=lambda _msg: None)
        mine = "trained"
    except UsageError as exc:
        mine = f"UsageError: {exc}"
    said[model] = gather_object(mine, env)
torch_dist.barrier()
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(said))
