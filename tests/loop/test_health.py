"""A run's health on one process (scaleloop.loop.health and the loop around it): straggler
detection, a diverging run, data that is not finite, fp16 skipped steps, and the stop row of
--max-steps."""
from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scaleloop.cli import main
from scaleloop.commands.doctor import diagnose
from scaleloop.config import TrainConfig
from scaleloop.data.sampler import StepSampler
from scaleloop.loop.health import Diverged, Stragglers, blocks, first_bad, nonfinite_sample, per_rank_vector
from scaleloop.loop.running_loss import RunningLoss
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies import precision

CPU = DistEnv()


def quiet(_msg: str) -> None:
    pass


def small(tmp_path: Path, name: str = "run", **changes) -> TrainConfig:
    base = dict(data="random", n_samples=256, epochs=2, batch_size=64, out=str(tmp_path / name),
                progress=False, tensorboard=False, device="cpu", log_every=1)
    base.update(changes)
    return TrainConfig(**base).validate()


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_per_rank_vector_summed_over_ranks_is_a_gather() -> None:
    world = 3
    parts = [per_rank_vector([1.0, 2.0], [10.0 + r, 20.0 + r], DistEnv(rank=r, world_size=world))
             for r in range(world)]
    total = torch.stack(parts).sum(0).tolist()
    assert total[:2] == [3.0, 6.0]
    assert blocks(total, 2, world) == [[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]]
    assert first_bad([0.0, 7.0, 5.0]) == 5 and first_bad([0.0, 0.0]) is None


def test_a_consistently_slow_rank_is_reported_once_and_jitter_never() -> None:
    watch = Stragglers()
    # 4 steps per window of 40 ms each; rank 2 spends 30 ms of its own per step, the others 2 ms.
    slow = [0.008, 0.008, 0.120, 0.008]
    assert watch.window(slow, 4, 0.040, 4) is None                 # once could be a hiccup
    found = watch.window(slow, 4, 0.040, 8)
    assert found is not None and found.rank == 2 and found.first_step == 5 and found.last_step == 8
    assert found.slowest_s == pytest.approx(0.030) and found.others_s == pytest.approx(0.002)
    assert found.describe().startswith("straggler: rank 2 takes 30.0 ms per step for its own work")
    assert all(watch.window(slow, 4, 0.040, s) is None for s in (12, 16, 20))   # said once
    worse = [0.008, 0.008, 0.260, 0.008]
    assert watch.window(worse, 4, 0.070, 24).rank == 2                            # its lead doubled
    assert watch.worst is not None and watch.worst.slowest_s == pytest.approx(0.065)
    # A healthy run: ranks differ by a millisecond or two, or by much less than a step.
    calm = Stragglers()
    for s in range(10):
        assert calm.window([0.004, 0.010, 0.005], 4, 0.003, 4 * s) is None
        assert calm.window([0.40, 0.46, 0.41], 4, 0.120, 4 * s) is None        # 15 ms of 120 ms steps
    assert calm.window([0.1], 4, 0.1, 4) is None                               # one rank: nothing to compare


def test_running_loss_notes_the_first_nonfinite_step() -> None:
    running = RunningLoss()
    for step, value in [(1, 1.0), (2, 2.0), (3, float("nan")), (4, float("inf"))]:
        running.add(torch.tensor(value), 8, step)
    assert running.first_nonfinite_step() == 3
    clean = RunningLoss()
    clean.add(torch.tensor(1.0), 8, 1)
    assert clean.first_nonfinite_step() is None


def test_a_diverging_run_stops_without_a_nonfinite_checkpoint(tmp_path: Path) -> None:
    cfg = small(tmp_path, model="simplenet", optimizer="sgd", lr=1e10, checkpoint_every=2, keep_checkpoints=1,
                log_every=5)
    with pytest.raises(Diverged) as caught:
        train(cfg, CPU, log=quiet)
    text = str(caught.value)
    root = Path(cfg.out) / "checkpoints"
    kept = sorted(p.name for p in root.glob("step-*"))
    assert len(kept) == 1, kept
    good = int(kept[0].split("-")[1])
    assert f"the newest valid checkpoint is '{root / kept[0]}' (step {good})" in text, text
    assert text.startswith("the run diverged: the training loss became non-finite at step ") or \
        text.startswith("the run diverged: the training loss became nan at step "), text
    assert int(text.split(" at step ")[1].split()[0]) > good
    assert (root / "latest").read_text().strip() == kept[0]
    state = torch.load(root / kept[0] / "state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert "\n" not in text


# A user's dataset read from a file, one feature of one sample of which is NaN.
NAN_DATA = """
from pathlib import Path
import numpy as np, torch
from torch.utils.data import TensorDataset

def build():
    rows = np.loadtxt(Path(__file__).with_name("samples.csv"), delimiter=",", dtype=np.float32)
    return TensorDataset(torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, -1]).long()), None
"""


def test_nan_in_the_data_is_named_as_the_datas_fault_not_the_learning_rates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "the run diverged ... start over with a lower --lr or with --clip-grad 1.0".
    samples = torch.randn(256, 9, generator=torch.Generator().manual_seed(0))
    samples[:, -1] = (samples[:, 0] > 0).float()
    samples[37, 3] = float("nan")
    (tmp_path / "samples.csv").write_text("\n".join(",".join(map(str, row.tolist())) for row in samples) + "\n")
    (tmp_path / "nandata.py").write_text(NAN_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    code = main(["train", "--data", "nandata:build", "--epochs", "2", "--batch-size", "32", "--log-every", "1",
                 "--no-progress", "--no-tensorboard", "--device", "cpu", "--out", str(run)])
    out, err = capsys.readouterr()
    assert code == 2, err
    # Shuffled: step 1-8 of epoch 1, whichever holds sample 37, is the first with a NaN loss.
    step = next(s for s in range(8) if 37 in StepSampler(256, 32, seed=0).step_indices(0, s).tolist()) + 1
    assert err == (f"scaleloop: error: the training data is not finite: sample 37 has nan in its inputs (step {step}, "
                   "epoch 1, where the training loss became nan); stopped there and wrote no checkpoint of it; "
                   "no checkpoint was written before it; repair or leave out that sample (a lower --lr or "
                   "--clip-grad does not help)\n")
    assert json.loads((run / "failure.json").read_text())["kind"] == "usage"
    assert "the training data is not finite: sample 37 has nan" in diagnose(run).what


def test_a_nonfinite_sample_is_found_in_the_step_where_the_loss_began_only() -> None:
    def loader(dataset, sampler=None):
        return SimpleNamespace(dataset=dataset, sampler=sampler or StepSampler(len(dataset), 2, shuffle=False))

    targets = torch.zeros(6)
    targets[3] = float("-inf")
    pairs = torch.utils.data.TensorDataset(torch.ones(6, 2), targets)
    assert nonfinite_sample(loader(pairs), 1) is None          # samples 0 and 1
    assert nonfinite_sample(loader(pairs), 2) == "sample 3 has -inf in its target"
    mapping = [{"input_ids": torch.arange(3), "labels": torch.tensor([1.0, math.nan])}] * 2
    assert nonfinite_sample(loader(mapping), 1) == "sample 0 has nan in its target"
    stream = SimpleNamespace(steps_per_epoch=None)            # a stream's step cannot be read again
    assert nonfinite_sample(loader(pairs, stream), 2) is None


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_fp16_skipped_steps_are_counted_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A loss scale far too high for fp16: every step overflows and the scaler skips it.
    monkeypatch.setattr(precision.torch.amp, "GradScaler",
                        functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 100))
    cfg = small(tmp_path, precision="fp16", max_steps=5, epochs=2, log_every=2)   # 4 steps per epoch
    result = train(cfg, CPU, log=quiet)
    assert result.steps == 5 and result.skipped_steps == 5
    logged = [(r["kind"], r["step"], r["skipped_steps"]) for r in rows(Path(cfg.out))]
    assert logged == [("step", "2", "2"), ("step", "4", "4"), ("epoch", "4", "4"), ("stop", "5", "5")]
    from scaleloop.loop.summary import format_result
    assert "fp16 skipped steps  5 of 5" in format_result(result)


def test_a_resumed_max_steps_stop_leaves_one_epoch_row(tmp_path: Path) -> None:
    first = train(small(tmp_path, max_steps=3, epochs=2, log_every=2), CPU, log=quiet)
    assert first.steps == 3
    out = Path(first.run_dir)
    assert [(r["kind"], r["epoch"], r["step"]) for r in rows(out) if r["kind"] != "step"] == [("stop", "1", "3")]
    train(small(tmp_path, max_steps=None, epochs=2, log_every=2, resume="auto"), CPU, log=quiet)
    assert [(r["kind"], r["epoch"], r["step"]) for r in rows(out) if r["kind"] != "step"] == [
        ("stop", "1", "3"), ("epoch", "1", "4"), ("epoch", "2", "8")]
    steps = [r["step"] for r in rows(out) if r["kind"] == "step"]
    assert steps == sorted(set(steps), key=int)                     # no step twice either
    assert math.isfinite(float(rows(out)[-1]["train_loss"]))
