"""Tests for scaleloop.loop.training.train and scaleloop.loop.evaluation on small CPU runs."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaleloop.config import TrainConfig
from scaleloop.data.datasets import build_datasets
from scaleloop.runtime.dist import DistEnv
from scaleloop.loop.evaluation import EvalResult, evaluate
from scaleloop.loop.training import RunResult, train
from scaleloop.models import SimpleNet, build_model
from scaleloop.strategies.base import Strategy

from runs import CPU, quiet, small  # tests/loop/runs.py


def weights(result: RunResult) -> dict[str, torch.Tensor]:
    assert result.run_dir is not None
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_small_run_returns_sensible_result(tmp_path: Path) -> None:
    cfg = small(tmp_path)
    result = train(cfg, CPU, log=quiet)
    assert isinstance(result, RunResult)
    assert result.run_dir == Path(cfg.checkpointing.out)
    assert result.device.startswith("cpu")
    assert result.strategy == "single" and result.world_size == 1 and result.precision == "fp32"
    assert result.epochs == 2 and result.steps == 8 and result.samples == 512
    assert math.isfinite(result.train_loss) and 0 < result.train_loss < 1.0
    assert isinstance(result.test, EvalResult)
    assert result.test.samples == int(256 * 0.2) and 0.5 < result.test.accuracy <= 1.0
    assert result.samples_per_s > 0 and 0 < result.train_s <= result.wall_s
    assert result.parameters == sum(p.numel() for p in SimpleNet(20, 128, 1).parameters())
    assert result.dropped_per_epoch == 0 and result.in_memory_data is True
    for name in ("config.toml", "metrics.csv", "model.pt", "curves.png"):
        assert (result.run_dir / name).is_file(), name
    with open(result.run_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    epochs = [r for r in rows if r["kind"] == "epoch"]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [int(r["step"]) for r in epochs] == [4, 8]
    assert [int(r["step"]) for r in steps] == [2, 4, 6, 8]  # log_every=2
    assert float(epochs[-1]["train_loss"]) == pytest.approx(result.train_loss)
    assert float(epochs[-1]["test_acc"]) == pytest.approx(result.test.accuracy)


def test_log_messages_go_to_the_log_function(tmp_path: Path) -> None:
    lines: list[str] = []
    train(small(tmp_path, epochs=1), CPU, log=lines.append)
    assert lines[0].startswith("scaleloop: simplenet")
    assert any(line.startswith("epoch 1: train loss") for line in lines)


def test_same_seed_gives_bitwise_identical_weights(tmp_path: Path) -> None:
    a = train(small(tmp_path, "a"), CPU, log=quiet)
    b = train(small(tmp_path, "b"), CPU, log=quiet)
    assert (a.run_dir / "model.pt").read_bytes() == (b.run_dir / "model.pt").read_bytes()
    assert a.train_loss == b.train_loss
    c = train(small(tmp_path, "c", seed=1), CPU, log=quiet)
    assert max_diff(weights(a), weights(c)) > 1e-3


@pytest.mark.parametrize("n_samples,batch,layouts", [
    (256, 64, (1, 2)),         # every step full
    (100, 32, (1, 2, 4)),      # 100 = 3 * 32 + 4: the last step has 4 samples
    (103, 32, (1, 2, 4)),      # last step of 7: micro-batches of 4+3 and 2+2+2+1, weighted by size
])
def test_accumulation_gives_the_same_weights(tmp_path: Path, n_samples: int, batch: int,
                                             layouts: tuple[int, ...]) -> None:
    results = {acc: train(small(tmp_path, f"acc{acc}", n_samples=n_samples, batch_size=batch,
                                accumulate=acc, optimizer="sgd", lr=0.1, epochs=2), CPU, log=quiet)
               for acc in layouts}
    reference = weights(results[1])
    for acc in layouts[1:]:
        r = results[acc]
        assert r.steps == results[1].steps and r.samples == results[1].samples == 2 * n_samples
        assert r.dropped_per_epoch == 0
        assert max_diff(weights(r), reference) < 1e-6, acc
        assert r.train_loss == pytest.approx(results[1].train_loss, abs=1e-6)


def test_unweighted_accumulation_would_differ(tmp_path: Path) -> None:
    """The check above is sharp: training on only the first micro-batch gives other weights."""
    full = weights(train(small(tmp_path, "full", n_samples=100, batch_size=32, optimizer="sgd",
                               lr=0.1), CPU, log=quiet))
    half = weights(train(small(tmp_path, "half", n_samples=100, batch_size=16, optimizer="sgd",
                               lr=0.1), CPU, log=quiet))
    assert max_diff(full, half) > 1e-4


def test_max_steps_stops_early(tmp_path: Path) -> None:
    result = train(small(tmp_path, epochs=5, max_steps=3), CPU, log=quiet)
    assert result.steps == 3 and result.epochs == 1 and result.samples == 3 * 64
    with open(result.run_dir / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["kind"] != "step"]
    # A stop inside the epoch is a "stop" row: the run that resumes it writes the epoch's row.
    assert [(r["kind"], r["step"]) for r in rows] == [("stop", "3")]
    assert result.test is not None


def test_small_tail_is_dropped_and_reported(tmp_path: Path) -> None:
    lines: list[str] = []
    # 66 = 64 + 2; two micro-steps need one sample each, so the 2-sample tail is kept ...
    kept = train(small(tmp_path, "kept", n_samples=66, accumulate=2, epochs=1), CPU, log=quiet)
    assert kept.dropped_per_epoch == 0 and kept.samples == 66 and kept.steps == 2
    # ... while --drop-last drops it and says so
    dropped = train(small(tmp_path, "dropped", n_samples=66, drop_last=True, epochs=1), CPU, log=lines.append)
    assert dropped.dropped_per_epoch == 2 and dropped.samples == 64 and dropped.steps == 1
    assert any("dropped" in line for line in lines)


def test_no_test_set(tmp_path: Path) -> None:
    result = train(small(tmp_path, test_fraction=0.0, epochs=1), CPU, log=quiet)
    assert result.test is None


def test_run_dir_of_an_earlier_run_is_refused_without_resume(tmp_path: Path) -> None:
    from scaleloop.errors import UsageError

    cfg = small(tmp_path, epochs=1)
    train(cfg, CPU, log=quiet)
    before = (Path(cfg.checkpointing.out) / "metrics.csv").read_bytes()
    with pytest.raises(UsageError, match="already holds a run"):
        train(cfg.replace(resume="never"), CPU, log=quiet)
    # Without checkpoints there is nothing to resume either: refused, not overwritten.
    bare = small(tmp_path / "bare", epochs=1).replace(checkpoints=False)
    train(bare, CPU, log=quiet)
    with pytest.raises(UsageError, match="already holds a run"):
        train(bare, CPU, log=quiet)
    assert (Path(cfg.checkpointing.out) / "metrics.csv").read_bytes() == before


@pytest.mark.slow
def test_default_config_learns_digits(tmp_path: Path) -> None:
    cfg = TrainConfig(out=str(tmp_path / "digits"), progress=False, device="cpu")
    result = train(cfg, CPU, log=quiet)
    assert result.test is not None and result.test.accuracy >= 0.95
    assert result.epochs == 20


# --- evaluate ---------------------------------------------------------------------------

def recording(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """What ``evaluate`` would all-reduce, call by call (the pretend ranks below have no process group)."""
    reduced: list[torch.Tensor] = []

    def record(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
        reduced.append(values.clone())
        return values

    monkeypatch.setattr("scaleloop.loop.evaluation.sum_over_ranks", record)
    return reduced


def _classifier():
    data = build_datasets("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("simplenet", data.info)
    return data, model


@pytest.mark.parametrize("batch_size", [512, 50, 7])
def test_evaluate_counts_every_test_sample_once(batch_size: int) -> None:
    data, model = _classifier()
    x, y = data.test.tensors
    model.train()
    result = evaluate(model, data.test, data.info, Strategy(CPU), batch_size=batch_size)
    assert model.training  # the mode is restored
    with torch.no_grad():
        model.eval()
        out = model(x)
    assert result.samples == len(data.test) == len(y)
    assert result.accuracy == pytest.approx(float((out.argmax(1) == y).double().mean()), abs=1e-12)
    assert result.loss == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-5)


def test_evaluate_binary_task() -> None:
    data = build_datasets("random", n_samples=100, test_fraction=0.37, seed=3)
    torch.manual_seed(0)
    model = build_model("simplenet", data.info)
    x, y = data.test.tensors
    result = evaluate(model, data.test, data.info, Strategy(CPU), batch_size=8)
    with torch.no_grad():
        out = model(x)
    assert result.samples == len(y) == 37
    assert result.accuracy == pytest.approx(float(((out > 0).float() == y).double().mean()))
    assert result.loss == pytest.approx(float(F.binary_cross_entropy_with_logits(out, y)), rel=1e-5)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_evaluate_splits_the_test_set_over_ranks_without_overlap(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data, model = _classifier()
    x, y = data.test.tensors
    with torch.no_grad():
        model.eval()
        out = model(x)
    totals = torch.zeros(5, dtype=torch.float64)  # loss, predictions, correct, judged, samples
    reduced = recording(monkeypatch)
    for rank in range(world):
        strategy = Strategy(DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world))
        evaluate(model, data.test, data.info, strategy, batch_size=16)
        (sums,) = reduced
        reduced.clear()
        totals += sums
    # what the all-reduce would give: every sample counted exactly once over the ranks
    assert int(totals[1]) == int(totals[3]) == int(totals[4]) == len(y)
    assert int(totals[2]) == int((out.argmax(1) == y).sum())
    assert float(totals[0]) / len(y) == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-5)


def test_evaluate_with_fewer_test_samples_than_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks with no test sample still take part (and a DataLoader-backed set does not crash)."""
    from torch.utils.data import Dataset

    from scaleloop.data.info import DataInfo

    class Plain(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(2, 3, generator=g), torch.tensor([0, 1])

        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            return self.x[i], self.y[i]

    ds, info = Plain(), DataInfo("plain", "classification", (3,), 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    totals = torch.zeros(5, dtype=torch.float64)  # loss, predictions, correct, judged, samples
    reduced = recording(monkeypatch)
    for rank in range(3):
        strategy = Strategy(DistEnv(rank=rank, world_size=3, local_rank=rank, local_world_size=3))
        result = evaluate(model, ds, info, strategy)
        assert result.samples == 2
        totals += reduced.pop()
    with torch.no_grad():
        out = model(ds.x)
    assert int(totals[1]) == int(totals[4]) == 2
    assert int(totals[2]) == int((out.argmax(1) == ds.y).sum())
    assert float(totals[0]) / 2 == pytest.approx(float(F.cross_entropy(out, ds.y)), rel=1e-6)


# --- a model with nothing to train ----------------------------------------------------------
NO_PARAMETERS = """
from torch import nn

def build(info=None):
    return nn.Sequential(nn.Flatten(), nn.ReLU())
"""


@pytest.mark.parametrize("strategy", [["--strategy", "single"], ["--strategy", "fsdp"],
                                      ["--strategy", "pipeline", "--nproc", "2"]])
def test_a_model_without_parameters_is_one_line_at_every_strategy(
        strategy: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: single raised "optimizer got an empty parameter list" at loop/build.py, pipeline
    # said it could not cut 0 layers "use ... --strategy ddp/fsdp", fsdp "use --strategy ddp or single".
    # (ddp builds through the same build_run as single and fsdp; --nproc 2 pipeline is refused before
    # any worker starts.)
    from scaleloop.cli import main

    (tmp_path / "noparams.py").write_text(NO_PARAMETERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--model", "noparams:build", "--data", "random", "--n-samples", "64", "--max-steps", "1",
                 "--no-progress", "--no-tensorboard", "--device", "cpu", *strategy, "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == ("scaleloop: error: --model noparams:build has no parameters to train "
                                       "(Sequential holds none): an optimizer would have nothing to update; "
                                       "give the model at least one trainable parameter\n")
    assert not (tmp_path / "run").exists()   # refused before the run directory is made


def test_a_model_whose_parameters_are_all_frozen_is_refused_too() -> None:
    from scaleloop.errors import UsageError
    from scaleloop.loop.build import check_trainable

    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(UsageError, match=r"^--model m:f has no parameters to train \(its 2 parameter tensor\(s\) "
                                         r"all have requires_grad=False\)"):
        check_trainable("m:f", frozen)
    check_trainable("m:f", torch.nn.Sequential(frozen, torch.nn.Linear(2, 1)))   # one trains: fine
