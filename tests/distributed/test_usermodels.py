"""Models, batches and losses as users write them, on real 2-process groups (issue 16).

- keyword inputs with ``labels`` and a model that returns its own loss (Hugging Face style), in
  memory and through the DataLoader; several positional inputs; a regression with the user's
  loss and metric: 2 processes (ddp, fsdp) equal 1;
- a parameter that gets no gradient: ddp stops before the first optimizer step with one line
  naming it and the flags; with ``--find-unused-parameters`` or ``--static-graph`` (and under
  fsdp) the run equals 1 process;
- frozen parameters under ddp, fsdp, allreduce and pipeline: equal to 1 process, and unchanged;
- language-model targets with -100 padding under allreduce and pipeline (in pieces): equal to 1
  process, each step the mean over its real targets (loop.padding).

The 2-process runs share one torchrun launch (scripts/usermodel_runs.py); the 1-process
references run in this process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from procs import run, scaleloop
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv
from usermodel_settings import BASE, RUNS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usermodels")


@pytest.fixture(scope="module")
def two(root: Path) -> dict[str, str]:
    """Every run of RUNS on 2 processes (one torchrun launch); name -> strategy description."""
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "usermodel_runs.py"), str(root / "two")], cwd=SCRIPTS, timeout=300)
    assert res.returncode == 0, f"usermodel_runs.py failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one(root: Path):
    """``name -> run directory`` of the run on one process (strategy single), trained on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = root / "one" / name
            settings = {**BASE, **RUNS[name], "strategy": "single", "out": str(out)}
            settings.pop("find_unused_parameters", None)
            settings.pop("static_graph", None)
            settings.pop("microbatches", None)   # the pipeline's pieces: one process runs the batch whole
            sys.path.insert(0, str(SCRIPTS))
            try:
                train(TrainConfig(**settings).validate(), DistEnv(device=torch.device("cpu")), log=lambda _msg: None)
            finally:
                sys.path.remove(str(SCRIPTS))
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_equal_one(two: dict[str, str], one, root: Path, name: str) -> None:
    a, b = weights(one(name)), weights(root / "two" / name)
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values())
    diff = {k: (a[k] - b[k]).abs().max().item() / scale for k in a}
    assert max(diff.values()) <= 1e-5, f"{name} ({two[name]}) differs from one process: {diff}"


def test_ddp_options_are_in_the_description(two: dict[str, str]) -> None:
    assert two["unused-find"] == "ddp (find unused parameters)"
    assert two["unused-static"] == "ddp (static graph)"


@pytest.mark.parametrize("name, frozen", [("unused-find", "spare."), ("unused-fsdp", "spare."),
                                          ("frozen-ddp", "body."), ("frozen-fsdp", "body."),
                                          ("frozen-allreduce", "body."), ("frozen-pipeline", "1.")])
def test_parameters_without_gradients_stay_as_they_started(two: dict[str, str], root: Path, name: str,
                                                           frozen: str) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from scaleloop.loop.build import build_data_and_model

        _, model = build_data_and_model(TrainConfig(**{**BASE, **RUNS[name], "strategy": "single"}))
    finally:
        sys.path.remove(str(SCRIPTS))
    start, end = model.state_dict(), weights(root / "two" / name)
    kept = [k for k in start if k.startswith(frozen)]
    trained = [k for k in start if not k.startswith(frozen)]
    assert kept and trained
    assert all(torch.equal(start[k], end[k]) for k in kept), f"{name}: {frozen}* changed"
    assert not any(torch.equal(start[k], end[k]) for k in trained), f"{name}: a trained parameter did not move"


def test_a_parameter_without_gradient_stops_ddp_before_its_first_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run([sys.executable, "-m", "scaleloop", "train", "--model", "usermodels:Unused", "--strategy", "ddp",
               "--nproc", "2", "--epochs", "1", "--no-progress", "--out", str(out)], cwd=SCRIPTS, timeout=240)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("scaleloop: error: 2 parameter(s) got no gradient in the first step (spare.bias, "
                           "spare.weight)"), last
    assert "--find-unused-parameters" in last and "--static-graph" in last
    assert not list((out / "checkpoints").glob("step-*")), "a checkpoint was written after a wrong step"
    assert not (out / "model.pt").exists()
