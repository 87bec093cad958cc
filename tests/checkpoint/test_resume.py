"""Resuming training from checkpoints, library level, in one process.

The central promise: a run interrupted anywhere and resumed trains on exactly the same samples,
in the same order, to bitwise the same weights as a run that was never interrupted.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from scaleloop.checkpoint.manager import Progress
from scaleloop.checkpoint.resume import FIXED_ON_RESUME, check_compatible
from scaleloop.config import TrainConfig, config_for_resume, to_toml
from scaleloop.checkpoint.store import (MANIFEST_FILE, STATE_FILE, CheckpointError, list_checkpoints,
                                        verify_checkpoint)
from scaleloop.data.loader import Batch
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.loop.training import train

CPU = DistEnv()


class Interrupted(Exception):
    """Stands in for a crash, a kill or Ctrl-C in the middle of an epoch."""


def quiet(_msg: str) -> None:
    pass


def small(tmp_path: Path, name: str = "run", **changes) -> TrainConfig:
    """A fast MLP run: 256 random samples, 4 steps per epoch."""
    base = dict(data="random", n_samples=256, epochs=2, batch_size=64, out=str(tmp_path / name),
                progress=False, tensorboard=False, device="cpu", log_every=1)
    base.update(changes)
    return TrainConfig(**base).validate()


def bn_run(tmp_path: Path, name: str, **changes) -> TrainConfig:
    """A BatchNorm model with accumulation, warm-up and a cosine schedule: 6 steps (12 micro-batches)
    per epoch, the last step short (60 of 100 samples); checkpoints at steps 4, 6 (epoch end), 8, 12.
    (4x4 images: fp16 convolutions on CPU are slow at 8x8.)"""
    base = dict(model="convnet", data="images", image_size=4, n_samples=560, epochs=2, batch_size=100,
                accumulate=2, lr=0.01, lr_schedule="cosine", warmup_steps=3, checkpoint_every=4,
                out=str(tmp_path / name), progress=False, tensorboard=False, device="cpu", log_every=1)
    base.update(changes)
    return TrainConfig(**base).validate()


def recorder(seen: list[torch.Tensor], stop_at: Optional[int] = None) -> Callable[[Batch], None]:
    """An on_batch hook recording each micro-batch's indices; raises before micro-batch ``stop_at``."""
    def on_batch(batch: Batch) -> None:
        if stop_at is not None and len(seen) == stop_at:
            raise Interrupted
        seen.append(batch.indices.clone())
    return on_batch


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def checkpoint_state(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / STATE_FILE, weights_only=True)


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


# --- bitwise resume equivalence --------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_interrupted_and_resumed_run_is_bitwise_identical(tmp_path: Path, precision: str) -> None:
    reference_seen: list[torch.Tensor] = []
    reference = train(bn_run(tmp_path, "reference", precision=precision), CPU, log=quiet,
                      on_batch=recorder(reference_seen))
    assert reference.steps == 12 and len(reference_seen) == 24

    cfg = bn_run(tmp_path, "run", precision=precision)
    run_dir = Path(cfg.checkpointing.out)
    first: list[torch.Tensor] = []
    # 21 micro-batches trained (10 steps and half of step 11), then a crash before the 22nd.
    with pytest.raises(Interrupted):
        train(cfg, CPU, log=quiet, on_batch=recorder(first, stop_at=21))
    assert len(first) == 21
    # The newest checkpoint is mid-epoch: after global step 8 = step 2 of epoch 2 (16 micro-batches).
    assert step_dirs(run_dir) == ["step-00000004", "step-00000006", "step-00000008"]
    manifest = json.loads((run_dir / "checkpoints" / "step-00000008" / MANIFEST_FILE).read_text())
    assert (manifest["epoch"], manifest["step_in_epoch"], manifest["samples"]) == (1, 2, 560 + 200)

    lines: list[str] = []
    second: list[torch.Tensor] = []
    resumed = train(cfg, CPU, log=lines.append, on_batch=recorder(second))
    assert resumed.resumed_from == run_dir / "checkpoints" / "step-00000008"
    assert any(line.startswith("resuming from") and "global step 8" in line for line in lines), lines
    assert resumed.steps == reference.steps and resumed.samples == reference.samples == 2 * 560
    assert resumed.epochs == 2

    # The same samples in the same order: the first run's batches up to its checkpoint, then the resumed run's.
    combined = first[:16] + second
    assert len(combined) == len(reference_seen)
    for i, (got, want) in enumerate(zip(combined, reference_seen)):
        assert torch.equal(got, want), f"micro-batch {i} differs"

    # The same weights, bit for bit (BatchNorm running statistics included).
    assert_bitwise_equal(weights(run_dir), weights(Path(reference.run_dir)))
    assert resumed.train_loss == reference.train_loss
    assert resumed.test is not None and reference.test is not None
    assert resumed.test.loss == reference.test.loss and resumed.test.accuracy == reference.test.accuracy

    # metrics.csv: every step logged once, and the same numbers as the uninterrupted run.
    rows, ref_rows = metric_rows(run_dir), metric_rows(Path(reference.run_dir))
    for kind in ("step", "epoch"):
        steps = [int(r["step"]) for r in rows if r["kind"] == kind]
        assert steps == sorted(set(steps)), (kind, steps)
        assert steps == [int(r["step"]) for r in ref_rows if r["kind"] == kind]
    epochs = [{k: r[k] for k in ("epoch", "step", "samples", "train_loss", "test_loss", "test_acc", "lr")}
              for r in rows if r["kind"] == "epoch"]
    ref_epochs = [{k: r[k] for k in ("epoch", "step", "samples", "train_loss", "test_loss", "test_acc", "lr")}
                  for r in ref_rows if r["kind"] == "epoch"]
    assert epochs == ref_epochs and len(epochs) == 2
    step_values = [(r["step"], r["train_loss"], r["lr"]) for r in rows if r["kind"] == "step"]
    assert step_values == [(r["step"], r["train_loss"], r["lr"]) for r in ref_rows if r["kind"] == "step"]

    # The final checkpoints agree too: schedule, loss scaler (fp16: its growth tracker counts all 12
    # steps only if the resumed run continued the saved scaler), position and running sums.
    final = checkpoint_state(run_dir, 12)
    ref_final = checkpoint_state(Path(reference.run_dir), 12)
    assert final["scheduler"] == ref_final["scheduler"] and final["scheduler"]["last_epoch"] == 12
    assert final["scaler"] == ref_final["scaler"]
    if precision == "fp16":
        assert final["scaler"]["_growth_tracker"] == ref_final["scaler"]["_growth_tracker"] > 4
    else:
        assert final["scaler"] == {}
    assert torch.equal(final["sums"], ref_final["sums"])
    progress = {k: v for k, v in final["progress"].items() if k != "train_s"}
    assert progress == {k: v for k, v in ref_final["progress"].items() if k != "train_s"}
    assert progress == {"epoch": 2, "step_in_epoch": 0, "global_step": 12, "samples": 2 * 560, "skipped_steps": 0,
                        "window_from": 12}   # the log row of step 12 came before its checkpoint


def test_resume_continues_the_random_number_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Dropout draws from torch's RNG at every step: the resumed run must continue the saved stream.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    settings = dict(model="dropout_models:dropout_net", checkpoint_every=3, epochs=2)
    reference = train(small(tmp_path, "reference", **settings), CPU, log=quiet)
    cfg = small(tmp_path, **settings)
    first: list[torch.Tensor] = []
    with pytest.raises(Interrupted):
        train(cfg, CPU, log=quiet, on_batch=recorder(first, stop_at=7))  # 7 steps; last checkpoint: step 6
    result = train(cfg, CPU, log=quiet)
    assert result.resumed_from == Path(cfg.checkpointing.out) / "checkpoints" / "step-00000006"
    assert_bitwise_equal(weights(Path(cfg.checkpointing.out)), weights(Path(reference.run_dir)))
    # Its training time counts the first run's too, as its steps do: said, so that it may exceed the wall time.
    from scaleloop.loop.text import format_result
    assert " over every run since the first)" in format_result(result)
    assert " over every run" not in format_result(reference)


def test_resume_after_an_epoch_end_checkpoint_with_extended_epochs_matches_a_longer_run(tmp_path: Path) -> None:
    reference = train(small(tmp_path, "reference", epochs=3), CPU, log=quiet)
    cfg = small(tmp_path, epochs=2)
    train(cfg, CPU, log=quiet)
    lines: list[str] = []
    # Extending --epochs is allowed: the run continues from its last checkpoint.
    result = train(cfg.replace(epochs=3), CPU, log=lines.append)
    assert result.resumed_from == Path(cfg.checkpointing.out) / "checkpoints" / "step-00000008"
    assert result.epochs == 3 and result.steps == 12 == reference.steps
    assert_bitwise_equal(weights(Path(cfg.checkpointing.out)), weights(Path(reference.run_dir)))
    assert [r["epoch"] for r in metric_rows(Path(cfg.checkpointing.out)) if r["kind"] == "epoch"] == ["1", "2", "3"]


# --- which checkpoint: auto, never, PATH --------------------------------------------------

def test_resume_never_refuses_a_directory_holding_a_run(tmp_path: Path) -> None:
    cfg = small(tmp_path, epochs=1)
    train(cfg, CPU, log=quiet)
    before = (Path(cfg.checkpointing.out) / "metrics.csv").read_bytes()
    with pytest.raises(UsageError) as exc:
        train(cfg.replace(resume="never"), CPU, log=quiet)
    assert "already holds a run" in str(exc.value)
    assert (Path(cfg.checkpointing.out) / "metrics.csv").read_bytes() == before


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out"])
def test_resume_auto_without_checkpoints_starts_fresh(tmp_path: Path, existing: bool) -> None:
    cfg = small(tmp_path, epochs=1)
    if existing:
        Path(cfg.checkpointing.out).mkdir()
    lines: list[str] = []
    result = train(cfg, CPU, log=lines.append)
    assert cfg.checkpointing.resume == "auto"
    assert result.resumed_from is None and result.steps == 4
    assert not any("resuming" in line for line in lines)
    assert result.checkpoints_written == 1 and step_dirs(Path(cfg.checkpointing.out)) == ["step-00000004"]


def test_resume_path_to_a_corrupted_checkpoint_is_an_error(tmp_path: Path) -> None:
    cfg = small(tmp_path)
    train(cfg, CPU, log=quiet)
    state = Path(cfg.checkpointing.out) / "checkpoints" / "step-00000004" / STATE_FILE
    truncate(state)
    with pytest.raises(CheckpointError) as exc:
        train(small(tmp_path, "other", resume=str(state.parent)), CPU, log=quiet)
    assert str(state) in str(exc.value) and "truncated" in str(exc.value)
    assert not (tmp_path / "other").exists()


def test_resume_path_without_out_continues_in_the_checkpoints_run_dir(tmp_path: Path) -> None:
    cfg = small(tmp_path)
    train(cfg, CPU, log=quiet)
    ckpt = Path(cfg.checkpointing.out) / "checkpoints" / "step-00000004"
    result = train(cfg.replace(out=None, resume=str(ckpt / STATE_FILE)), CPU, log=quiet)
    assert result.resumed_from == ckpt
    assert result.run_dir == Path(cfg.checkpointing.out) and result.steps == 8


def test_resume_auto_falls_back_past_a_corrupted_newest_checkpoint(tmp_path: Path) -> None:
    cfg = small(tmp_path, epochs=3)
    train(cfg, CPU, log=quiet)
    run_dir = Path(cfg.checkpointing.out)
    finished = weights(run_dir)
    assert step_dirs(run_dir) == ["step-00000004", "step-00000008", "step-00000012"]
    bad = run_dir / "checkpoints" / "step-00000012" / STATE_FILE
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0xFF
    bad.write_bytes(bytes(data))

    lines: list[str] = []
    result = train(cfg, CPU, log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "corrupt" in warnings[0]
    assert result.resumed_from == run_dir / "checkpoints" / "step-00000008"
    assert result.epochs == 3 and result.steps == 12
    # epoch 3 trained again from the step-8 checkpoint gives the same weights
    assert_bitwise_equal(weights(run_dir), finished)
    # and a good checkpoint at step 12 replaced the damaged one
    assert step_dirs(run_dir)[-1] == "step-00000012"
    verify_checkpoint(run_dir / "checkpoints" / "step-00000012")


def test_resume_auto_with_every_checkpoint_corrupted_is_an_error(tmp_path: Path) -> None:
    cfg = small(tmp_path)
    train(cfg, CPU, log=quiet)
    run_dir = Path(cfg.checkpointing.out)
    for path in list_checkpoints(run_dir / "checkpoints"):
        truncate(path / STATE_FILE)
    lines: list[str] = []
    with pytest.raises(CheckpointError) as exc:
        train(cfg, CPU, log=lines.append)
    assert "every checkpoint" in str(exc.value) and "failed verification" in str(exc.value)
    assert len([line for line in lines if line.startswith("warning:")]) == 2
    assert step_dirs(run_dir) == ["step-00000004", "step-00000008"]  # nothing deleted


# --- which settings may change --------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    ({"batch_size": 32}, "--batch-size 64"),
    ({"seed": 1}, "--seed 0"),
    ({"hidden_dim": 64}, "--hidden-dim 128"),
    ({"lr_schedule": "cosine"}, "--lr-schedule constant"),
    ({"betas": "0.9,0.95"}, "--betas (not set)"),
    ({"weight_decay": 0.1}, "--weight-decay 0.0"),
])
def test_changing_a_fixed_setting_is_refused(tmp_path: Path, change: dict, needle: str) -> None:
    cfg = small(tmp_path)
    train(cfg, CPU, log=quiet)
    with pytest.raises(CheckpointError) as exc:
        train(cfg.replace(epochs=3, **change), CPU, log=quiet)
    msg = str(exc.value)
    assert "\n" not in msg and "cannot resume" in msg and needle in msg
    name, value = next(iter(change.items()))
    assert f"--{name.replace('_', '-')} {value}" in msg
    assert set(change) <= set(FIXED_ON_RESUME)


def test_a_finished_run_resumed_again_has_nothing_left_to_train(tmp_path: Path) -> None:
    cfg = small(tmp_path)
    first = train(cfg, CPU, log=quiet)
    before = weights(Path(cfg.checkpointing.out))
    rows_before = metric_rows(Path(cfg.checkpointing.out))
    lines: list[str] = []
    again = train(cfg, CPU, log=lines.append)
    assert any("nothing left to train" in line for line in lines), lines
    assert again.steps == first.steps == 8 and again.samples == first.samples
    assert again.checkpoints_written == 0
    assert again.test is not None and again.test.accuracy == first.test.accuracy
    assert_bitwise_equal(weights(Path(cfg.checkpointing.out)), before)
    assert metric_rows(Path(cfg.checkpointing.out)) == rows_before


def test_max_steps_reached_has_nothing_left_to_train(tmp_path: Path) -> None:
    cfg = small(tmp_path, max_steps=3, epochs=5)
    first = train(cfg, CPU, log=quiet)
    assert first.steps == 3 and not first.nothing_left
    lines: list[str] = []
    again = train(cfg, CPU, log=lines.append)
    assert ("nothing left to train: the run already reached step 3 (--max-steps 3); pass a larger --max-steps "
            "to train further") in lines, lines
    assert again.steps == 3 and again.nothing_left


def test_a_resumed_run_s_last_log_window_is_labelled_with_the_steps_its_loss_is_over(tmp_path: Path) -> None:
    from scaleloop.loop.text import format_result

    # Never interrupted, a log row every 2 steps: the last window is steps 3-4.
    whole = train(small(tmp_path, "whole", max_steps=4, log_every=2), CPU, log=quiet)
    assert whole.window_steps == (3, 4)
    # Stopped at step 3 (its checkpoint's window holds step 3's loss), then continued with a log row
    # every 4 steps: the row at step 4 is the mean over steps 3-4, the whole run's, bit for bit.
    cfg = small(tmp_path, "resumed", max_steps=3, log_every=2)
    train(cfg, CPU, log=quiet)
    resumed = train(cfg.replace(max_steps=4, log_every=4), CPU, log=quiet)
    assert resumed.window_loss == whole.window_loss
    assert resumed.window_steps == (3, 4)
    assert f"last log window (steps 3-4) {whole.window_loss:.4f}" in format_result(resumed)
    # A checkpoint from before the window's start was saved: the last multiple of --log-every.
    assert Progress(global_step=7).log_window_from(5) == 5
    assert Progress(global_step=7, window_from=3).log_window_from(5) == 3


# --- how many checkpoints ------------------------------------------------------------------

def test_keep_checkpoints_leaves_exactly_k(tmp_path: Path) -> None:
    result = train(small(tmp_path, epochs=3, checkpoint_every=1, keep_checkpoints=2), CPU, log=quiet)
    assert step_dirs(result.run_dir) == ["step-00000011", "step-00000012"]
    # checkpoint_every=1: steps 1-3, 5-7, 9-11 mid-epoch, and 4, 8, 12 at the epoch ends
    assert result.checkpoints_written == 12
    assert result.last_checkpoint == result.run_dir / "checkpoints" / "step-00000012"


def test_no_checkpoints_writes_none(tmp_path: Path) -> None:
    result = train(small(tmp_path, checkpoints=False, checkpoint_every=1), CPU, log=quiet)
    assert result.checkpoints_written == 0 and result.last_checkpoint is None
    assert list_checkpoints(result.run_dir / "checkpoints") == []


# --- settings of a resumed run ------------------------------------------------------------

def fake_run(run_dir: Path, **settings) -> TrainConfig:
    """A run directory with a saved config and one (unverified) checkpoint directory."""
    saved = TrainConfig(out=str(run_dir), **settings)
    (run_dir / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(saved))
    return saved


def test_config_for_resume_starts_from_the_saved_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fake_run(run, epochs=5, batch_size=32, lr=0.5, hidden_dim=16, resume="never", log_every=3)
    cfg = config_for_resume({"log_every": 7}, {"out": str(run), "epochs": 9})
    assert cfg.optim.batch_size == 32 and cfg.optim.lr == 0.5 and cfg.model_data.hidden_dim == 16   # saved
    assert cfg.optim.epochs == 9                                                  # the flag overrides
    assert cfg.output.log_every == 7                                               # --config overrides
    assert cfg.checkpointing.resume == "auto"                                             # saved 'never' ignored
    assert cfg.checkpointing.out == str(run)


def test_config_for_resume_with_a_path_and_no_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fake_run(run, batch_size=32, resume=str(tmp_path / "elsewhere"))
    cfg = config_for_resume({}, {"resume": str(run / "checkpoints" / "step-00000004")})
    assert cfg.optim.batch_size == 32 and cfg.checkpointing.out == str(run)
    assert cfg.checkpointing.resume == str(run / "checkpoints" / "step-00000004")


def test_config_for_resume_keeps_the_settings_of_a_dir_without_checkpoints_and_ignores_never(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(TrainConfig(batch_size=32, out=str(run))))
    # No checkpoint (killed before its first was written): the run starting over there keeps its
    # settings, never the defaults (issue 41).
    assert config_for_resume({}, {"out": str(run)}).batch_size == 32
    fake_run(tmp_path / "run2", batch_size=32)
    assert config_for_resume({}, {"out": str(tmp_path / "run2"), "resume": "never"}).batch_size == 64


# --- resuming into other directories, and rewinding ------------------------------------------

def test_resuming_another_runs_checkpoint_into_an_out_holding_a_run_is_refused(tmp_path: Path) -> None:
    train(small(tmp_path, "a"), CPU, log=quiet)
    b = small(tmp_path, "b", seed=1)
    train(b, CPU, log=quiet)
    before = {name: (Path(b.out) / name).read_bytes() for name in ("metrics.csv", "model.pt", "config.toml")}
    with pytest.raises(UsageError, match="already holds a run"):
        train(small(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoints" / "step-00000004")), CPU, log=quiet)
    assert {name: (Path(b.out) / name).read_bytes() for name in before} == before


def test_resuming_another_runs_checkpoint_into_a_new_out_is_a_fork(tmp_path: Path) -> None:
    train(small(tmp_path, "a"), CPU, log=quiet)
    result = train(small(tmp_path, "fork", resume=str(tmp_path / "a" / "checkpoints" / "step-00000004")),
                   CPU, log=quiet)
    assert result.run_dir == tmp_path / "fork" and result.steps == 8
    assert_bitwise_equal(weights(tmp_path / "fork"), weights(tmp_path / "a"))
    assert step_dirs(tmp_path / "a") == ["step-00000004", "step-00000008"]  # the source run is left alone


def test_a_restart_after_rewinding_continues_where_the_failed_attempt_left_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small(tmp_path, epochs=3)
    train(cfg, CPU, log=quiet)  # checkpoints at steps 4, 8, 12
    rewound = cfg.replace(resume=str(Path(cfg.checkpointing.out) / "checkpoints" / "step-00000004"), checkpoint_every=1)
    seen: list[torch.Tensor] = []
    with pytest.raises(Interrupted):  # the rewound run checkpoints steps 5 and 6, then fails
        train(rewound, CPU, log=quiet, on_batch=recorder(seen, stop_at=2))
    assert (Path(cfg.checkpointing.out) / "checkpoints" / "step-00000006").is_dir()
    # torchrun restarts the worker group with the same settings
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = train(rewound, CPU, log=quiet)
    assert result.resumed_from == Path(cfg.checkpointing.out) / "checkpoints" / "step-00000006"


# --- runs saved before --betas, --eps, --min-lr and --decay-params existed ------------------------

def old_saved(cfg: TrainConfig) -> dict:
    """``cfg``'s fields as a run saved before these settings existed (its checkpoint's config)."""
    return {k: v for k, v in cfg.flat().items() if k not in ("betas", "eps", "min_lr", "decay_params")}


def test_an_old_runs_config_resumes_with_weight_decay_on_every_tensor(tmp_path: Path) -> None:
    # It trained with weight decay on all tensors in one parameter group: the default (ndim2)
    # would make two groups, which its optimizer state cannot be loaded into.
    run = tmp_path / "run"
    fake_run(run, optimizer="adamw", weight_decay=0.1, lr_schedule="cosine")
    text = (run / "config.toml").read_text()
    old = "\n".join(line for line in text.splitlines()
                    if not line.lstrip("# ").startswith(("betas", "eps", "min_lr", "decay_params")))
    (run / "config.toml").write_text(old)
    cfg = config_for_resume({}, {"out": str(run), "epochs": 30})
    assert (cfg.optim.decay_params, cfg.optim.betas, cfg.optim.eps, cfg.optim.min_lr) == ("all", None, None, 0.0)
    assert cfg.optim.weight_decay == 0.1 and cfg.optim.epochs == 30
    check_compatible(old_saved(cfg), cfg.flat(), "old")   # not refused for the settings it lacks


@pytest.mark.parametrize("change,needle", [
    ({"decay_params": "ndim2"}, "--decay-params all"),
    ({"betas": "0.9,0.95"}, "--betas (not set)"),
    ({"min_lr": 1e-4, "lr_schedule": "cosine"}, "--min-lr 0.0"),
])
def test_an_old_checkpoint_refuses_a_setting_it_did_not_train_with(change: dict, needle: str) -> None:
    saved = old_saved(TrainConfig(optimizer="adamw", weight_decay=0.1, lr_schedule="cosine", decay_params="all"))
    current = {**saved, "betas": None, "eps": None, "min_lr": 0.0, "decay_params": "all", **change}
    with pytest.raises(CheckpointError) as exc:
        check_compatible(saved, current, "old")
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_without_weight_decay_an_old_checkpoint_resumes_under_any_decay_params() -> None:
    saved = old_saved(TrainConfig())
    for rule in ("ndim2", "ndim2-no-embeddings", "all"):
        check_compatible(saved, TrainConfig(decay_params=rule).flat(), "old")
