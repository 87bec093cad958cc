"""Models, batches and losses as users write them, on real 2-process groups (issue 16).

- keyword inputs with ``labels`` and a model that returns its own loss (Hugging Face style), in
  memory and through the DataLoader; several positional inputs; a regression with the user's
  loss and metric: 2 processes (ddp, fsdp) equal 1;
- a parameter that gets no gradient: ddp stops before the first optimizer step with one line
  naming it and the flags; with ``--find-unused-parameters`` or ``--static-graph`` (and under
  fsdp) the run equals 1 process;
- frozen parameters under ddp, fsdp, allreduce and pipeline: equal to 1 process, and unchanged;
- language-model targets with -100 padding under allreduce and pipeline (in pieces): equal to 1
  process, each step the mean over its real targets (loop.losses);
- conditional computation (issue 28): an auxiliary head used on some steps only, an expert that
  some ranks route no sample to, under allreduce, fsdp, --mesh, the pipeline and ddp
  --find-unused-parameters, with SGD with momentum and with Adam: 2 processes equal 1 (a
  parameter no rank used is not stepped, its momentum and Adam state untouched, as in one
  process); a unit of its own that only some ranks run stops fsdp with one line on every rank, not
  a hang; ddp without the flag names the parameter, the rank and the step, and verify takes the
  flags.

The 2-process runs share one torchrun launch (scripts/usermodel_runs.py); the 1-process
references run in this process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from procs import run
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv
from usermodel_settings import BASE, CONDITIONAL, RUNS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ALL = {**RUNS, **CONDITIONAL}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usermodels")


@pytest.fixture(scope="module")
def two(root: Path) -> dict[str, str]:
    """Every run of RUNS on 2 processes (one torchrun launch); name -> strategy description."""
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "usermodel_runs.py"), str(root / "two"), "RUNS,CONDITIONAL"], cwd=SCRIPTS, timeout=500)
    assert res.returncode == 0, f"usermodel_runs.py failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one(root: Path):
    """``name -> run directory`` of the run on one process (strategy single), trained on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = root / "one" / name
            settings = {**BASE, **ALL[name], "strategy": "single", "out": str(out)}
            for option in ("find_unused_parameters", "static_graph", "mesh"):   # the distributed run's own
                settings.pop(option, None)
            settings.pop("microbatches", None)   # the pipeline's pieces: one process runs the batch whole
            sys.path.insert(0, str(SCRIPTS))
            try:
                train(TrainConfig(**settings).validate(), DistEnv(device=torch.device("cpu")), log=lambda _msg: None)
            finally:
                sys.path.remove(str(SCRIPTS))
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize("name", list(RUNS) + list(CONDITIONAL))
def test_two_processes_equal_one(two: dict[str, str], one, root: Path, name: str) -> None:
    a, b = weights(one(name)), weights(root / "two" / name)
    assert a.keys() == b.keys()
    # Relative to the largest weight; counters (AuxHead's buffer of calls) must be equal.
    scale = max(t.abs().max().item() for t in a.values() if t.is_floating_point())
    assert all(torch.equal(a[k], b[k]) for k in a if not a[k].is_floating_point()), name
    diff = {k: (a[k] - b[k]).abs().max().item() / scale for k in a if a[k].is_floating_point()}
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
    assert last.startswith("scaleloop: error: parameter(s) spare.weight, spare.bias got no gradient on rank "), last
    assert " at step 1: add --find-unused-parameters " in last, last
    assert "--find-unused-parameters" in last and "--static-graph" in last
    assert not list((out / "checkpoints").glob("step-*")), "a checkpoint was written after a wrong step"
    assert not (out / "model.pt").exists()


def test_the_conditional_runs_leave_a_parameter_unused_on_every_rank_and_on_one(two: dict[str, str]) -> None:
    """What the comparisons above cover: steps where the aux head or the expert got a gradient on
    no rank (one process gives it none) and steps where only one rank used the expert."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from usermodels import _routed
        from scaleloop.loop.build import build_data_and_model

        data, _ = build_data_and_model(TrainConfig(**{**BASE, **CONDITIONAL["expert-fsdp-adam"]}))
    finally:
        sys.path.remove(str(SCRIPTS))
    from scaleloop.data.sampler import StepSampler

    seen = set()
    for accumulate in (1, 2):   # the expert runs with and without accumulation
        used = [[False] * BASE["max_steps"] for _ in range(2)]
        for rank in range(2):
            sampler = StepSampler(len(data.train), BASE["batch_size"], world_size=2, rank=rank, accumulate=accumulate)
            for micro in sampler.micro_batches(0):
                if micro.step < BASE["max_steps"]:
                    x = torch.stack([data.train[int(i)][0] for i in micro.indices])
                    used[rank][micro.step] |= _routed(x.flatten(1)).numel() > 0
        seen |= {sum(ranks) for ranks in zip(*used)}
    assert seen == {0, 1, 2}, seen   # the expert used on no rank, on one, on both


def test_a_unit_that_only_some_ranks_run_stops_fsdp_with_one_line_not_a_hang(tmp_path: Path) -> None:
    """The expert as an FSDP unit of its own, called only where a sample is routed to it (its
    forward runs on some ranks only), or first, leaving its input untouched where none is (its
    backward does): every rank stops at the same point with the same line, well before --timeout."""
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "usermodel_errors.py"), str(tmp_path)], cwd=SCRIPTS, timeout=200)
    assert res.returncode == 0, f"usermodel_errors.py failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    said = json.loads(res.stdout.strip().splitlines()[-1])
    top, first = said["RareExpertTop"], said["RareExpertFirst"]
    for ranks in (top, first):
        assert ranks[0] == ranks[1] and ranks[0].startswith("UsageError: fsdp: the ranks parted in step 1: "), ranks
        assert "must not be a unit of its own" in ranks[0] and "\n" not in ranks[0]
    assert "the forward of unit 'expert'" in top[0], top[0]
    assert "the end of the backward" in first[0], first[0]


def test_ddp_without_the_flag_names_the_parameter_the_rank_and_the_step_in_verify(tmp_path: Path) -> None:
    """The expert used on one rank only: DDP's next forward would fail ("Expected to have finished
    reduction") and the ranks' collectives part (Gloo aborts); the rank without it stops first."""
    res = run([sys.executable, "-m", "scaleloop.verify", "--model", "usermodels:RareExpert", "--data", "digits",
               "--batch-size", "32", "--steps", "3", "--device", "cpu"], cwd=SCRIPTS, timeout=240)
    assert res.returncode == 1, f"{res.stdout}\n{res.stderr}"
    out = res.stdout + res.stderr
    assert "Aborted" not in out and "crashed" not in out, out
    assert ("UsageError: parameter(s) moe.expert.weight, moe.expert.bias got no gradient on rank 1 at step 1: "
            "add --find-unused-parameters" in out), out


@pytest.mark.parametrize("model, flag", [("usermodels:RareExpert", "--find-unused-parameters"),
                                         ("usermodels:Unused", "--static-graph")])
def test_verify_takes_the_ddp_flags_and_passes(tmp_path: Path, model: str, flag: str) -> None:
    res = run([sys.executable, "-m", "scaleloop.verify", "--model", model, "--data", "digits", flag,
               "--batch-size", "32", "--steps", "3", "--device", "cpu"], cwd=SCRIPTS, timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    option = "find unused parameters" if "find" in flag else "static graph"
    assert "verdict: PASS - 2 processes (ddp) train the same model as 1 process over 3 step(s)" in res.stdout, \
        res.stdout
    assert option in res.stdout or "ddp" in res.stdout


def test_a_mesh_names_itself_and_the_flag_when_a_rank_skips_a_unit(tmp_path: Path) -> None:
    # Issue 41.11: --mesh dp=2 said "fsdp: the ranks parted ... or ddp --find-unused-parameters",
    # and refused --find-unused-parameters.
    res = run([sys.executable, "-m", "scaleloop", "train", "--model", "usermodels:RareExpertTop", "--mesh", "dp=2",
               "--nproc", "2", "--max-steps", "2", "--batch-size", "32", "--no-progress", "--out", str(tmp_path / "run")],
              cwd=SCRIPTS, timeout=240)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("scaleloop: error: --mesh dp=2: the ranks parted in step 1; add --find-unused-parameters "
                           "(the whole model is then one unit, which every rank runs). One was at the forward of unit "), last
    assert "fsdp:" not in last and "ddp --find-unused-parameters" not in last


def test_a_mesh_with_the_flag_trains_a_rarely_used_expert_as_one_process_in_verify() -> None:
    res = run([sys.executable, "-m", "scaleloop.verify", "--model", "usermodels:RareExpertTop", "--data", "digits",
               "--mesh", "dp=2", "--find-unused-parameters", "--batch-size", "32", "--steps", "3", "--device", "cpu"],
              cwd=SCRIPTS, timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "verdict: PASS - 2 processes (mesh) train the same model as 1 process over 3 step(s)" in res.stdout, \
        res.stdout
