"""Under torchrun with 4 processes: short ``scaleloop.train`` runs of TinyGPT laid out by ``--mesh``.

One launch for all of them (starting torch in 4 fresh processes is most of a short run's cost).
Usage: mesh_runs.py ROOT; each run writes ROOT/<name>; rank 0 prints one JSON line with each
run's strategy description. ``resume`` continues ``first-half`` (written by fsdp=2,tp=2) on fsdp=4.
The models with conditional computation of usermodel_settings.CONDITIONAL_4 train here too.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/distributed, for the settings

import usermodel_settings  # noqa: E402

import scaleloop as sl  # noqa: E402
from scaleloop.config import TrainConfig  # noqa: E402
from scaleloop.loop.training import train  # noqa: E402
from scaleloop.strategies.tensor import strided_tp_supported  # noqa: E402

# The same settings as BASE in test_mesh_dist.py (for the single-process references).
BASE = dict(data="tokens", model="tinygpt", n_samples=48, seq_len=8, vocab_size=32, epochs=1, max_steps=3,
            batch_size=8, accumulate=2, optimizer="sgd", lr=0.5, test_fraction=0.25, progress=False,
            tensorboard=False, log_every=1, device="cpu", nproc=4)
RUNS = {
    "tp": {"mesh": "tp=4"},
    "fsdp-tp": {"mesh": "fsdp=2,tp=2", "clip_grad": 0.05, "activation_checkpointing": True, "cpu_offload": True},
    "hsdp": {"mesh": "dp=2,fsdp=2"},
    "dp-tp": {"mesh": "dp=2,tp=2"},
    # pipeline x data parallel: 2 stages, each replicated twice; 2 pieces per micro-step, 1F1B
    "pp-dp": {"mesh": "pp=2,dp=2", "microbatches": 2, "pipeline_schedule": "1f1b"},
    "first-half": {"mesh": "fsdp=2,tp=2", "max_steps": 2},
}

# torch 2.11 cannot run TinyGPT's fused q/k/v split (strategies/tensor.py): its tp runs are left out there.
if not strided_tp_supported():
    RUNS = {name: changes for name, changes in RUNS.items() if "tp" not in changes["mesh"]}

root = Path(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for name, changes in RUNS.items():
    cfg = TrainConfig(**{**BASE, **changes, "out": str(root / name)}).validate()
    described[name] = train(cfg, env, log=lambda _msg: None).strategy
for name, changes in usermodel_settings.CONDITIONAL_4.items():
    cfg = TrainConfig(**{**usermodel_settings.BASE, **changes, "nproc": 4, "out": str(root / name)}).validate()
    described[name] = train(cfg, env, log=lambda _msg: None).strategy
# The first half's checkpoint, continued on another mesh shape (2x2 -> 4): step 3 here, step 4 on 1 process.
if "first-half" in RUNS:
    cfg = TrainConfig(**{**BASE, "mesh": "fsdp=4", "out": str(root / "first-half")}).validate()
    said: list = []
    described["resume"] = train(cfg, env, log=said.append).strategy
    described["resume_log"] = [line for line in said if "resuming from" in line or "written by" in line]
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
