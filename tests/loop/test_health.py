"""A run's health on one process (scaleloop.loop.health and the loop around it): straggler
detection, a diverging run, fp16 skipped steps, and the stop row of --max-steps."""
from __future__ import annotations

import csv
import functools
import math
from pathlib import Path

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.loop.health import Diverged, Stragglers, blocks, first_bad, per_rank_vector
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
