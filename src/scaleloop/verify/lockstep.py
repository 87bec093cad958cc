"""The lock-step comparison: one process takes every step from the distributed run's own state.

Free-running, two runs that do the same arithmetic in another order part by rounding, and each
step carries the difference into the next; Adam and AdamW step each element by about ``lr``
whatever its gradient's size, so rounding in a small gradient becomes a visible share of ``lr``,
step after step. A tolerance wide enough for that is a guess that correct code can still exceed.
In lock-step nothing is carried over:

- every worker saves the run's whole state at every step boundary through its strategy's own
  checkpoint code (:class:`StateSaver`): before step 1 the model as placed, after each step the
  model, the optimizer state and the fp16 loss scale, as ``scaleloop train`` checkpoints them
  (whole on rank 0, or each rank its shards);
- the verify process then trains one process step by step, loading before each step k the state
  the run had before it, through the one-process strategy's checkpoint load, which reads what any
  strategy wrote at any world size (:class:`StateLoader`). Its step k is one step from the run's own
  state, on the same samples: its loss, its gradients, and the weights and buffers after it are
  compared with the run's step k (``compare.compare_runs`` under ``Tolerance.per_step``), and
  its optimizer state after the step with the run's (``compare.optimizer_state_diff``).

Every part of the state is compared after every step from a common state, so runs that agree
here step by step train the same model; what remains between their free-running trajectories is
rounding that training compounds (shown beside the verdict, not judged).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from scaleloop.loop.build import Run
from scaleloop.runtime.dist import DistEnv
from scaleloop.verify.compare import OptimizerState, StateDiff, optimizer_state_diff

STATE_FILE = "state.pt"


def boundary_dir(root: Path, k: int) -> Path:
    """Where the run's state after ``k`` steps is kept (``k = 0``: before the first)."""
    return root / f"step-{k:04d}"


class StateSaver:
    """In every worker, at every step boundary: the run's state, saved as a checkpoint saves it.

    A collective: every rank calls it at the same boundary. Rank 0 writes ``state.pt``; a sharded
    strategy's ranks write their shards beside it (``torch.distributed.checkpoint``).
    """

    def __init__(self, root: Path, env: DistEnv) -> None:
        self.root = root
        self.env = env

    def __call__(self, run: Run, k: int) -> None:
        target = boundary_dir(self.root, k)
        if self.env.is_main:
            target.mkdir(parents=True, exist_ok=True)
        strategy = run.strategy
        # Saving makes every rank's buffers rank 0's under FSDP (a checkpoint does); verify's run is
        # one without checkpoints, so each rank keeps its own (unsynchronised statistics stay visible).
        own = [b.detach().clone() for b in run.model.buffers()]
        if k == 0:
            # Before the first step there is no optimizer state: only the model. (Through the optimizer,
            # a sharded save would first give it a state by an empty step, which the run would then carry.)
            model = strategy.full_state_dict(run.model)
            state: Optional[dict[str, Any]] = ({"model": {n: t.detach().cpu() for n, t in model.items()}}
                                               if self.env.is_main else None)
        else:
            state = strategy.save_checkpoint(run.model, run.optimizer, target if self.env.is_main else None)
        with torch.no_grad():
            for buffer, mine in zip(run.model.buffers(), own):
                buffer.copy_(mine)
        if state is not None:
            torch.save({**state, "scaler": strategy.precision.state_dict()}, target / STATE_FILE)


class StateLoader:
    """In the verify process, at every step boundary of the one-process run: its optimizer state
    against the run's, then the run's state loaded for the next step.

    ``diffs[k]`` is how the optimizer state after step k differs. A boundary whose state the run
    did not save (it stopped) is skipped.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.diffs: dict[int, StateDiff] = {}

    def __call__(self, run: Run, k: int) -> None:
        directory = boundary_dir(self.root, k)
        if not (directory / STATE_FILE).exists():
            return
        state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        mine = optimizer_state(run) if k > 0 else None
        if "optimizer" not in state and "sharded" not in state:
            state["optimizer"] = run.optimizer.state_dict()   # step 0: the model only, the optimizer fresh
        run.strategy.load_checkpoint(run.model, run.optimizer, state, directory)
        run.strategy.precision.load_state_dict(state.get("scaler") or {})
        if mine is not None:
            self.diffs[k] = optimizer_state_diff(mine, optimizer_state(run))


def optimizer_state(run: Run) -> OptimizerState:
    """The optimizer's state by parameter name (copies, on the CPU)."""
    names = {id(p): name for name, p in run.strategy.unwrap(run.model).named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for param, entry in run.optimizer.state.items():
        name = names.get(id(param), str(id(param)))
        out[name] = {kind: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                     for kind, v in entry.items()}
    return out


def saved_steps(root: Path) -> int:
    """How many steps can be taken from a state the run saved: its boundaries 0, 1, ... in a row."""
    k = 0
    while (boundary_dir(root, k) / STATE_FILE).exists():
        k += 1
    return k
