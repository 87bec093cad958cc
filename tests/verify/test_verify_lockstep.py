"""The lock-step comparison in one process: the run's state saved at every step boundary, and each
step of another run taken from it (``verify.lockstep``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.verify.compare import TOLERANCES, StateDiff, compare_runs
from scaleloop.verify.lockstep import STATE_FILE, StateLoader, StateSaver, boundary_dir, saved_steps
from scaleloop.verify.recorder import RECORD_FILE, Recorder, step_file
from scaleloop.verify.steps import RunSpec, run_steps

CFG = TrainConfig(data="random", n_samples=96, model="simplenet", hidden_dim=16, batch_size=32, device="cpu",
                  progress=False, tensorboard=False, checkpoints=False, epochs=2, optimizer="adam", lr=0.01)


def _losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / RECORD_FILE).read_text())["losses"]


def _params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(step_file(run_dir, step), weights_only=True)["params"]


def test_every_step_starts_from_the_state_saved_before_it(tmp_path: Path) -> None:
    env = DistEnv()
    run, states, lock = tmp_path / "run", tmp_path / "states", tmp_path / "lock"
    run_steps(CFG, env, RunSpec("single", 1, 3), Recorder(env, run), boundary=StateSaver(states, env))
    assert saved_steps(states) == 4   # before step 1, and after each of 3
    assert "optimizer" not in torch.load(boundary_dir(states, 0) / STATE_FILE, weights_only=True)
    # Move the weights saved after step 1: the one process's step 2 starts from them (and so differs),
    # and its step 3 starts from the run's own state after step 2 again: nothing carries over.
    saved = torch.load(boundary_dir(states, 1) / STATE_FILE, weights_only=True)
    saved["model"] = {name: t + 0.5 for name, t in saved["model"].items()}
    torch.save(saved, boundary_dir(states, 1) / STATE_FILE)
    state_loader = StateLoader(states)
    run_steps(CFG, env, RunSpec("single", 1, 3), Recorder(env, lock), boundary=state_loader)
    ours, theirs = _losses(lock), _losses(run)
    assert ours[0] == theirs[0] and ours[2] == theirs[2] and ours[1] != theirs[1]
    for step, equal in ((1, True), (2, False), (3, True)):
        a, b = _params(lock, step), _params(run, step)
        assert all(torch.equal(a[n], b[n]) for n in a) == equal, step
    # The optimizer state after each step against the run's: only step 2, from other weights, differs.
    assert state_loader.diffs[1] == state_loader.diffs[3] == StateDiff()
    assert state_loader.diffs[2].rel > 1e-3 and state_loader.diffs[2].worst.startswith("exp_a")
    rows = compare_runs(lock, run, ours, theirs, 3, TOLERANCES["fp32"].per_step())
    assert [bool(r.failures(TOLERANCES["fp32"].per_step())) for r in rows] == [False, True, False]


def test_a_run_that_stopped_early_is_taken_in_lock_step_as_far_as_it_saved(tmp_path: Path) -> None:
    env = DistEnv()
    states = tmp_path / "states"
    run_steps(CFG, env, RunSpec("single", 1, 2), Recorder(env, tmp_path / "run"), boundary=StateSaver(states, env))
    (boundary_dir(states, 2) / STATE_FILE).unlink()
    assert saved_steps(states) == 2
    state_loader = StateLoader(states)
    run_steps(CFG, env, RunSpec("single", 1, 2), Recorder(env, tmp_path / "lock"), boundary=state_loader)
    assert list(state_loader.diffs) == [1]   # after step 2 there is nothing of the run's to compare with
