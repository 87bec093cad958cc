"""Tests for scaleloop.loop.schedule: learning-rate scaling, warm-up and schedules."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.loop.schedule import LearningRate, build_scheduler, describe_schedule, lr_factor, scaled_lr


def factor(step: int, schedule: str, total: int = 10, warmup: int = 0) -> float:
    return lr_factor(step, schedule=schedule, total_steps=total, warmup_steps=warmup)


# --- lr_factor -----------------------------------------------------------------------------

def test_constant_is_one_throughout() -> None:
    assert [factor(s, "constant") for s in (0, 5, 9)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
def test_warmup_rises_linearly_to_the_peak(schedule: str) -> None:
    # from lr/N at the first step to lr at step N-1, whatever follows
    assert [factor(s, schedule, total=20, warmup=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4, schedule, total=20, warmup=4) == 1.0  # the schedule starts at its peak


def test_constant_after_warmup() -> None:
    assert [factor(s, "constant", total=10, warmup=2) for s in (2, 6, 9)] == [1.0, 1.0, 1.0]


def test_cosine_without_warmup() -> None:
    assert factor(0, "cosine") == 1.0
    assert factor(5, "cosine") == pytest.approx(0.5)
    assert factor(9, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert factor(10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert factor(50, "cosine") == pytest.approx(0.0, abs=1e-12)  # stays at the bottom past the end
    values = [factor(s, "cosine") for s in range(11)]
    assert values == sorted(values, reverse=True)


def test_cosine_with_warmup_spans_the_remaining_steps() -> None:
    # total 12, warm-up 2: the cosine runs over steps 2..12 (span 10)
    assert factor(2, "cosine", total=12, warmup=2) == 1.0
    assert factor(7, "cosine", total=12, warmup=2) == pytest.approx(0.5)
    assert factor(12, "cosine", total=12, warmup=2) == pytest.approx(0.0, abs=1e-12)


def test_step_schedule_drops_at_half_and_three_quarters() -> None:
    # total 10, warm-up 2: span 8, so x0.1 from 4 steps after the warm-up, x0.01 from 6 after
    got = [factor(s, "step", total=10, warmup=2) for s in range(10)]
    assert got[:2] == [0.5, 1.0]
    assert got[2:6] == [1.0, 1.0, 1.0, 1.0]
    assert got[6:8] == [pytest.approx(0.1)] * 2
    assert got[8:] == [pytest.approx(0.01)] * 2


def test_warmup_longer_than_the_run() -> None:
    assert factor(3, "cosine", total=4, warmup=10) == pytest.approx(0.4)
    assert factor(10, "cosine", total=4, warmup=10) == 1.0  # span clamps to 1: no division by zero


# --- --min-lr: the floor of the decaying schedules --------------------------------------------

def test_cosine_without_a_floor_is_the_plain_cosine_bit_for_bit() -> None:
    # floor 0 (the default) must give exactly the rates runs had before --min-lr existed
    for total, warmup in ((10, 0), (46, 5), (7, 10)):
        for s in range(total + 2):
            after, span = s - warmup, max(1, total - warmup)
            old = (s + 1) / warmup if warmup and s < warmup else \
                0.5 * (1.0 + math.cos(math.pi * min(1.0, after / span)))
            assert lr_factor(s, schedule="cosine", total_steps=total, warmup_steps=warmup, floor=0.0) == old


def test_cosine_decays_to_the_floor() -> None:
    got = [lr_factor(s, schedule="cosine", total_steps=10, warmup_steps=2, floor=0.1) for s in range(14)]
    assert got[:3] == [0.5, 1.0, 1.0]                                   # warm-up untouched
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5)                    # halfway: midway to the floor
    assert got[10:] == [pytest.approx(0.1)] * 4                         # at the end and past it: the floor
    assert got[2:] == sorted(got[2:], reverse=True) and min(got) == pytest.approx(0.1)


def test_step_drops_stop_at_the_floor() -> None:
    got = [lr_factor(s, schedule="step", total_steps=8, warmup_steps=0, floor=0.05) for s in range(8)]
    assert got == [1.0] * 4 + [pytest.approx(0.1)] * 2 + [0.05] * 2   # x0.01 would be below the floor


def test_scheduler_ends_at_min_lr() -> None:
    cfg = TrainConfig(lr=0.4, lr_schedule="cosine", min_lr=0.04, warmup_steps=2).validate()
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, cfg, 12)
    used = []
    for _ in range(13):   # one past the schedule's end: it stays at the floor
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert used[:3] == [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.4)]
    assert used[11] > 0.04 and used[12] == pytest.approx(0.04)


def test_describe_schedule_names_where_it_ends() -> None:
    lr = LearningRate(0.1, "--lr as given")
    floor = TrainConfig(lr=0.1, lr_schedule="cosine", min_lr=1e-3).validate()
    assert describe_schedule(floor, lr, 50).endswith("cosine schedule over 50 steps, down to --min-lr 0.001")
    step = TrainConfig(lr=0.1, lr_schedule="step").validate()
    assert describe_schedule(step, lr, 50).endswith("step schedule over 50 steps")


# --- scaled_lr ---------------------------------------------------------------------------------

def test_no_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256))
    assert lr.peak == 0.1 and lr.why == "--lr as given"


def test_linear_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256, lr_scaling="linear", base_batch_size=64).validate())
    assert lr.peak == pytest.approx(0.4)
    assert lr.why == "0.1 x 256/64: linear scaling from --base-batch-size 64 to the global batch 256"


def test_sqrt_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256, lr_scaling="sqrt", base_batch_size=64).validate())
    assert lr.peak == pytest.approx(0.2)
    assert lr.why == "0.1 x sqrt(256/64): sqrt scaling from --base-batch-size 64 to the global batch 256"


def test_scaling_down() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=32, lr_scaling="linear", base_batch_size=128).validate())
    assert lr.peak == pytest.approx(0.025)


def test_scaling_needs_a_base_batch_size() -> None:
    with pytest.raises(UsageError, match="--base-batch-size"):
        TrainConfig(lr_scaling="linear").validate()


def test_describe_schedule() -> None:
    cfg = TrainConfig(lr=0.1, batch_size=256, lr_scaling="linear", base_batch_size=64,
                      lr_schedule="cosine", warmup_steps=5).validate()
    text = describe_schedule(cfg, scaled_lr(cfg), 100)
    assert text == ("0.4 (0.1 x 256/64: linear scaling from --base-batch-size 64 to the global batch 256), "
                    "5 warm-up steps, cosine schedule over 100 steps, down to 0")
    assert describe_schedule(TrainConfig(lr=0.1), scaled_lr(TrainConfig(lr=0.1)), 10) == "0.1 (--lr as given)"


# --- build_scheduler ---------------------------------------------------------------------------

def lrs_used(cfg: TrainConfig, total: int, peak: float = 0.4) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    scheduler = build_scheduler(optimizer, cfg, total)
    used = []
    for _ in range(total):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
def test_scheduler_gives_each_step_its_factor(schedule: str) -> None:
    cfg = TrainConfig(lr_schedule=schedule, warmup_steps=3)
    used = lrs_used(cfg, 12)
    want = [0.4 * lr_factor(s, schedule=schedule, total_steps=12, warmup_steps=3) for s in range(12)]
    assert used == pytest.approx(want)
    assert used[0] == pytest.approx(0.4 / 3)


def test_scheduler_state_round_trip_continues_the_schedule() -> None:
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=2)
    whole = lrs_used(cfg, 10)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, cfg, 10)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    state, opt_state = scheduler.state_dict(), optimizer.state_dict()
    optimizer2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduler2 = build_scheduler(optimizer2, cfg, 10)
    optimizer2.load_state_dict(opt_state)
    scheduler2.load_state_dict(state)
    rest = []
    for _ in range(4):
        rest.append(optimizer2.param_groups[0]["lr"])
        optimizer2.step()
        scheduler2.step()
    assert rest == pytest.approx(whole[6:])


# --- in a run ----------------------------------------------------------------------------------

def run_lrs(tmp_path: Path, **changes) -> tuple[list[str], list[dict[str, str]]]:
    cfg = TrainConfig(**{**dict(data="random", n_samples=256, epochs=1, batch_size=64, lr=1.0, optimizer="sgd",
                                out=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu",
                                log_every=1), **changes}).validate()
    lines: list[str] = []
    train(cfg, DistEnv(), log=lines.append)
    with open(tmp_path / "run" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return lines, rows


def test_a_run_announces_its_learning_rate(tmp_path: Path) -> None:
    lines, _ = run_lrs(tmp_path, lr_scaling="linear", base_batch_size=32, warmup_steps=2)
    assert "learning rate 2 (1 x 64/32: linear scaling from --base-batch-size 32 to the global batch 64), " \
           "2 warm-up steps" in lines


def test_metrics_lr_column_is_the_rate_each_step_used(tmp_path: Path) -> None:
    _, rows = run_lrs(tmp_path, warmup_steps=4)
    assert [(r["step"], float(r["lr"])) for r in rows if r["kind"] == "step"] == [
        ("1", 0.25), ("2", 0.5), ("3", 0.75), ("4", 1.0)]


def test_epoch_row_lr_agrees_with_the_step_row_of_the_same_step(tmp_path: Path) -> None:
    _, rows = run_lrs(tmp_path, warmup_steps=8)  # one epoch of 4 steps, all in the warm-up
    by_kind = {(r["kind"], r["step"]): float(r["lr"]) for r in rows}
    assert by_kind[("step", "4")] == 0.5
    assert by_kind[("epoch", "4")] == by_kind[("step", "4")]


def test_constant_schedule_steps_like_lambdalr() -> None:
    """The constant schedule's cheap step leaves the same state and rate as LambdaLR's."""
    import torch

    from scaleloop.config import TrainConfig
    from scaleloop.loop.schedule import build_scheduler

    def pair():
        p = torch.nn.Parameter(torch.zeros(2))
        return torch.optim.SGD([p], lr=0.1)

    ref_opt, opt = pair(), pair()
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0)
    sched = build_scheduler(opt, TrainConfig(lr=0.1), total_steps=50)
    for _ in range(7):
        ref_opt.step(), opt.step()
        ref.step(), sched.step()
    assert sched.state_dict() == ref.state_dict()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1
    # A checkpoint of a constant run loaded into a warm-up run keeps the warm-up's schedule.
    warm = build_scheduler(pair(), TrainConfig(lr=0.1, warmup_steps=10), total_steps=50)
    warm.load_state_dict(sched.state_dict())
    assert warm.constant is False and warm.last_epoch == 7
