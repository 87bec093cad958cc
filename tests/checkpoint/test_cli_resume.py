"""The ``scaleloop train`` flags for checkpoints and resuming, run in-process like tests/test_cli.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.cli import main

SMALL = ["--data", "random", "--n-samples", "128", "--batch-size", "64", "--no-progress",
         "--no-tensorboard", "--device", "cpu"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scaleloop: error: ")
    assert "Traceback" not in err and "Traceback" not in out
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def summary_line(out: str, key: str) -> str:
    summary = out[out.index("summary"):]
    return next(line for line in summary.splitlines() if line.strip().startswith(key))


@pytest.mark.parametrize("argv,needles", [
    (["--checkpoint-every", "-1"], ["--checkpoint-every must be"]),
    (["--keep-checkpoints", "0"], ["--keep-checkpoints must be a positive integer", "--no-checkpoints"]),
    (["--lr-scaling", "linear"], ["--lr-scaling linear", "--base-batch-size"]),
    (["--lr-scaling", "sqrt", "--base-batch-size", "0"], ["--base-batch-size must be a positive integer"]),
    (["--warmup-steps", "-2"], ["--warmup-steps must be zero or positive"]),
    (["--lr-schedule", "linear"], ["--lr-schedule", "invalid choice: 'linear'"]),
    (["--resume", " "], ["--resume must be auto, never, or a checkpoint path"]),
    (["--checkpoint-every", "two"], ["--checkpoint-every must be a whole number, got 'two'"]),
])
def test_bad_checkpoint_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      argv: list[str], needles: list[str]) -> None:
    out_dir = tmp_path / "never"
    code, out, err = run_cli(capsys, "train", *SMALL, *argv, "--out", str(out_dir))
    assert_usage_error(code, out, err, *needles)
    assert not out_dir.exists()


def test_resume_from_a_nonexistent_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    code, out, err = run_cli(capsys, "train", *SMALL, "--resume", str(missing))
    assert_usage_error(code, out, err, str(missing), "does not exist")


def test_resume_from_a_directory_without_checkpoints(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "train", *SMALL, "--resume", str(tmp_path), "--out", str(tmp_path / "r"))
    assert_usage_error(code, out, err, "holds no checkpoint")


def test_resume_through_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", *SMALL, "--epochs", "1", "--log-every", "1", "--out", str(run))
    assert code == 0, err
    assert "resuming from" not in out
    first = summary_line(out, "checkpoints")
    assert "1 written" in first and "step-00000002" in first and "resumed from" not in first

    # Only --out and the new --epochs: everything else comes from the run's saved config.toml.
    code, out, err = run_cli(capsys, "train", "--out", str(run), "--epochs", "2")
    assert code == 0, err
    assert f"resuming from {run / 'checkpoints' / 'step-00000002'}" in out
    line = summary_line(out, "checkpoints")
    assert "1 written" in line and "step-00000004" in line
    assert f"resumed from {run / 'checkpoints' / 'step-00000002'}" in line
    assert "(4 steps, 256 samples)" in summary_line(out, "epochs")  # n_samples 128 was kept

    # A flag that would change the data order is refused, in one line.
    code, out, err = run_cli(capsys, "train", "--out", str(run), "--epochs", "3", "--batch-size", "32")
    assert_usage_error(code, out, err, "cannot resume", "--batch-size 64", "--batch-size 32")

    # --resume never into a directory holding the run is refused and changes nothing.
    before = (run / "metrics.csv").read_bytes()
    code, out, err = run_cli(capsys, "train", *SMALL, "--out", str(run), "--resume", "never")
    assert_usage_error(code, out, err, "already holds a run")
    assert (run / "metrics.csv").read_bytes() == before


def test_resume_a_step_directory_without_out(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *SMALL, "--epochs", "2", "--out", str(run))
    assert code == 0, err
    step = run / "checkpoints" / "step-00000002"
    code, out, err = run_cli(capsys, "train", "--resume", str(step / "state.pt"))
    assert code == 0, err
    assert f"resuming from {step}" in out
    assert summary_line(out, "run directory").split()[-1] == str(run)  # went on where it came from


def test_no_checkpoints_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", *SMALL, "--epochs", "1", "--no-checkpoints", "--out", str(run))
    assert code == 0, err
    assert "none written" in summary_line(out, "checkpoints")
    assert list((run / "checkpoints").glob("step-*")) == []


def test_a_continue_with_nothing_left_says_so_in_one_line_and_prints_no_summary(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"   # 2 steps an epoch
    code, _, err = run_cli(capsys, "train", *SMALL, "--max-steps", "3", "--out", str(run))
    assert code == 0, err
    for argv, line in [
        (["--max-steps", "3"], "the run already reached step 3 (--max-steps 3); pass a larger --max-steps"),
        (["--max-steps", "2", "--profile"],
         "the run already reached step 3 (--max-steps 2); pass a larger --max-steps"),
        (["--epochs", "1", "--max-steps", "9"],
         "the run already reached step 3, past the end of epoch 1 (--epochs 1); pass a larger --epochs"),
    ]:
        code, out, err = run_cli(capsys, "train", "--out", str(run), *argv)
        assert (code, err) == (0, "")   # not an error
        assert out.splitlines()[-1] == f"nothing left to train: {line} to train further", out
        assert "summary" not in out and "nan" not in out and "wall time" not in out, out
        assert "profile" not in out, out   # no "no step recorded" of a profile never begun
