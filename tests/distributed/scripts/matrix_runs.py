"""Under torchrun with 2 or 4 processes: the proof matrix's cells of that process count (matrix_cells.py).

One launch per process count (starting torch in fresh processes is most of a short run's cost).
Usage: matrix_runs.py ROOT; each run writes ROOT/<cell name>; rank 0 prints one JSON line: each
run's strategy description, the log lines that tell it resumed, and its seconds. A resumed cell
trains to matrix_cells.HALF steps, then again in the same directory to MAX_STEPS (it resumes).
The tp meshes are left out where torch cannot split TinyGPT's fused q/k/v (strided_tp_supported).
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/distributed, for the cells

import matrix_cells  # noqa: E402

import scaleloop as sl  # noqa: E402
import scaleloop.loop.result  # noqa: E402
from scaleloop.config import TrainConfig  # noqa: E402
from scaleloop.loop.training import train  # noqa: E402
from scaleloop.strategies.tensor import strided_tp_supported  # noqa: E402

# No curves.png: drawing it costs ~0.6 s a run, more than the run's 4 steps (the weights are what is compared).
scaleloop.loop.result.plot_curves = lambda *_args: None
root = Path(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
described = {}
for cell in matrix_cells.runs(env.world_size, tp=strided_tp_supported()):
    start, said = time.monotonic(), []
    out = str(root / cell.name)
    if cell.run == "resumed":
        train(TrainConfig(**matrix_cells.settings(cell, max_steps=matrix_cells.HALF), out=out).validate(), env,
              log=lambda _msg: None)
    result = train(TrainConfig(**matrix_cells.settings(cell), out=out).validate(), env, log=said.append)
    described[cell.name] = {"strategy": result.strategy, "steps": result.steps,
                            "resumed": [line for line in said if "resuming from" in line],
                            "seconds": round(time.monotonic() - start, 2)}
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(described))
