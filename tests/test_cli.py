"""Tests for the ``scaleloop`` command: bad input gives one line and exit 2; a run writes its directory."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleloop.cli import main
from scaleloop.config import SETTINGS, TrainConfig, flag, load_toml, resolve
from scaleloop.models import SimpleNet

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run([sys.executable, "-m", "scaleloop", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_usage_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scaleloop: error: ")
    assert "Traceback" not in err and "Traceback" not in out
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real, small run through the CLI, shared by the tests that inspect its output."""
    out_dir = tmp_path_factory.mktemp("cli") / "run"
    import io
    from contextlib import redirect_stderr, redirect_stdout

    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = main(["train", "--data", "random", "--n-samples", "512", "--epochs", "2",
                     "--batch-size", "64", "--out", str(out_dir), "--no-progress", "--device", "cpu"])
    assert code == 0, stderr.getvalue()
    return out_dir, stdout.getvalue()


# --- bad input: exit 2 with one line --------------------------------------------------------

@pytest.mark.parametrize("argv,needles", [
    (["--model", "nosuchmodel"], ["unknown model 'nosuchmodel'", "simplenet"]),
    (["--data", "nosuchdata"], ["unknown dataset 'nosuchdata'", "digits"]),
    (["--model", "nosuchmod:make"], ["cannot import module 'nosuchmod'"]),
    (["--data", "nosuchmod:make"], ["cannot import module 'nosuchmod'"]),
    (["--batch-size", "0"], ["--batch-size must be a positive integer"]),
    (["--epochs", "-1"], ["--epochs must be a positive integer"]),
    (["--lr", "0"], ["--lr must be a positive number"]),
    (["--epoch", "3"], ["unrecognized arguments: --epoch 3"]),
    (["--batch-size", "abc"], ["--batch-size must be a whole number, got 'abc'"]),
    (["--nproc", "banana"], ["--nproc must be a whole number of processes or auto, got 'banana'"]),
    (["--optimizer", "rmsprop"], ["invalid choice: 'rmsprop'"]),
    (["--batch-size", "10", "--accumulate", "4"], ["--batch-size 10", "8 or 12"]),
    (["--data", "mnist"], ["--data-dir"]),
    (["--model", "convnet", "--data", "random"], ["convnet", "image"]),
    (["--betas", "0.9"], ["--betas '0.9'", "e.g. --betas 0.9,0.95"]),
    (["--betas", "a,b"], ["--betas 'a,b'"]),
    (["--optimizer", "sgd", "--betas", "0.9,0.95"], ["--betas is for --optimizer adam and adamw"]),
    (["--eps", "x"], ["--eps must be a number, got 'x'"]),
    (["--min-lr", "-1", "--lr-schedule", "cosine"], ["--min-lr must be zero or positive"]),
    (["--min-lr", "0.001"], ["--lr-schedule constant does not decay"]),
    (["--decay-params", "weights"], ["invalid choice: 'weights'"]),
    (["--profile", "-1"], ["--profile must be a number of steps: 0 (off) or more"]),
    (["--profile", "banana"], ["--profile must be a whole number, got 'banana'"]),
    (["--strategy", "pipeline", "--nproc", "2", "--weight-decay", "0.1"], ["add --decay-params all"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          argv: list[str], needles: list[str]) -> None:
    out_dir = tmp_path / "never"
    code, out, err = run_cli(capsys, "train", *argv, "--out", str(out_dir), "--no-progress",
                             "--device", "cpu", "--n-samples", "64")
    assert_usage_error(code, out, err, *needles)
    assert not out_dir.exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here, so --device cuda works")
def test_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "train", "--device", "cuda", "--out", str(tmp_path / "r"))
    assert_usage_error(code, out, err, "CUDA is not available")


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "train", "--config", str(tmp_path / "missing.toml"))
    assert_usage_error(code, out, err, "missing.toml", "does not exist")


def test_invalid_toml_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("epochs = [1,\n")
    code, out, err = run_cli(capsys, "train", "--config", str(path))
    assert_usage_error(code, out, err, "is not valid TOML")


def test_config_with_unknown_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[train]\nbatchsize = 32\n")
    code, out, err = run_cli(capsys, "train", "--config", str(path))
    assert_usage_error(code, out, err, "unknown setting 'batchsize'", "did you mean 'batch_size'")


def test_out_holding_a_run_is_refused_and_left_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "old"
    out_dir.mkdir()
    metrics = out_dir / "metrics.csv"
    metrics.write_text("kind,epoch\nepoch,1\n")
    stat = metrics.stat()
    code, out, err = run_cli(capsys, "train", "--data", "random", "--n-samples", "64", "--epochs", "1",
                             "--out", str(out_dir), "--no-progress", "--device", "cpu")
    assert_usage_error(code, out, err, "already holds a run")
    assert metrics.read_text() == "kind,epoch\nepoch,1\n"
    assert metrics.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in out_dir.iterdir()) == ["metrics.csv"]


def test_subprocess_bad_input_has_real_exit_code_and_no_traceback(tmp_path: Path) -> None:
    proc = run_subprocess("train", "--model", "nosuchmod:make", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("scaleloop: error: ") and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_subprocess_unknown_flag(tmp_path: Path) -> None:
    proc = run_subprocess("train", "--epoch", "3", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "--epoch" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_reader_that_went_away_is_not_an_error(tmp_path: Path) -> None:
    """`scaleloop doctor RUN | head -1`: once the reader closed the pipe, no BrokenPipeError traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('model = "simplenet"\n')
    read, write = os.pipe()
    os.close(read)   # closed before the command writes: its first write fails, every time
    try:
        proc = subprocess.run([sys.executable, "-m", "scaleloop", "doctor", str(run)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# --- help, no command, env ----------------------------------------------------------------

def test_train_help_all_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help-all"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in SETTINGS:
        assert flag(name) in text, name
    assert "--no-progress" in text and "--config" in text
    assert text.count("default") >= len(SETTINGS)


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "env" in out


def test_the_readme_names_every_command_and_strategy() -> None:
    from scaleloop.cli import COMMANDS
    from scaleloop.strategies.registry import REGISTRY

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## The CLI"):readme.index("\nModels:")]
    for command in COMMANDS:
        assert f"| `scaleloop {command}" in table, f"the README's CLI table has no row for {command}"
    strategies = readme[readme.index("\nStrategies:"):]
    strategies = strategies[:strategies.index("\n\n")]
    for name in REGISTRY:
        assert f"`{name}`" in strategies, f"the README's Strategies line leaves out {name}"


def test_no_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code == 2
    assert "train" in out + err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from scaleloop import __version__

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"scaleloop {__version__}"


def test_env(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "env")
    assert code == 0 and err == ""
    assert torch.__version__ in out
    assert "gloo" in out.lower()


# --- a real run ---------------------------------------------------------------------------

def test_run_prints_a_summary(finished_run: tuple[Path, str]) -> None:
    out_dir, stdout = finished_run
    summary = stdout[stdout.index("summary"):]
    for key in ("device", "strategy", "world size", "epochs", "train loss", "test accuracy",
                "throughput", "wall time", "run directory"):
        assert key in summary, key
    assert "samples/s" in summary
    assert str(out_dir) in summary
    assert "cpu" in summary and "single" in summary


def test_run_directory_contents(finished_run: tuple[Path, str]) -> None:
    out_dir, _ = finished_run
    with open(out_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    kinds = {r["kind"] for r in rows}
    assert kinds == {"step", "epoch"}
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == ["1", "2"]
    assert (out_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC
    state = torch.load(out_dir / "model.pt", weights_only=True)
    model = SimpleNet(20, 128, 1)
    model.load_state_dict(state)  # strict: same keys and shapes
    assert torch.equal(model.net[0].weight, state["net.0.weight"])
    events = list((out_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_saved_config_loads_back_to_the_same_settings(capsys: pytest.CaptureFixture[str],
                                                      finished_run: tuple[Path, str]) -> None:
    out_dir, _ = finished_run
    saved = resolve(load_toml(out_dir / "config.toml"), {})
    assert saved == TrainConfig(data="random", n_samples=512, epochs=2, batch_size=64,
                                out=str(out_dir), progress=False, device="cpu")
    # ... and the CLI accepts it: it continues that run, which has nothing left to train ...
    code, out, err = run_cli(capsys, "train", "--config", str(out_dir / "config.toml"))
    assert code == 0, err
    assert "nothing left to train" in out
    # ... or, told not to resume, refuses to overwrite it.
    code, out, err = run_cli(capsys, "train", "--config", str(out_dir / "config.toml"), "--resume", "never")
    assert_usage_error(code, out, err, "already holds a run")


def test_flags_override_the_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg_file = tmp_path / "settings.toml"
    cfg_file.write_text('[train]\ndata = "random"\nn-samples = 128\nepochs = 3\nbatch_size = 64\n'
                        "progress = false\ntensorboard = false\n")
    out_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--config", str(cfg_file), "--epochs", "1",
                             "--out", str(out_dir), "--device", "cpu")
    assert code == 0, err
    saved = load_toml(out_dir / "config.toml")
    assert saved["epochs"] == 1           # the flag won
    assert saved["n_samples"] == 128      # the file's value was kept
    assert saved["log_every"] == 10       # default where neither said anything
    assert "epoch 1: train loss" in out and "epoch 2:" not in out
    assert "epochs = 1\n" in (out_dir / "config.toml").read_text()


# --- the run directory: the lock is said first, and a failed start can be retried --------

BAD_MODEL = '''
import torch

class Stringly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(20, 1)

    def forward(self, x):
        return "not a tensor"

def build():
    return Stringly()
'''


def test_a_retry_after_a_failed_start_is_not_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "badmodel.py").write_text(BAD_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    out_dir = tmp_path / "run"
    common = ["--data", "random", "--n-samples", "64", "--epochs", "1", "--batch-size", "32", "--out", str(out_dir),
              "--no-progress", "--device", "cpu"]
    code, out, err = run_cli(capsys, "train", "--model", "badmodel:build", *common)
    assert code != 0 and (out_dir / "metrics.csv").exists(), err     # stopped at its first step
    code, out, err = run_cli(capsys, "train", "--model", "simplenet", *common)   # the corrected command
    assert code == 0, err
    assert f"note: --out {str(out_dir)!r} held a run that stopped before its first step; this run starts over" in err
    assert "model = \"simplenet\"" in (out_dir / "config.toml").read_text()
    assert len((out_dir / "metrics.csv").read_text().splitlines()) > 1


def test_a_directory_in_use_is_refused_as_in_use_before_its_checkpoints_are_read(
        capsys: pytest.CaptureFixture[str], finished_run: tuple[Path, str]) -> None:
    out_dir, _ = finished_run
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from scaleloop.output.rundir import lock_run_dir\n"
         f"lock = lock_run_dir(Path({str(out_dir)!r})); print('held', flush=True); sys.stdin.read(); lock.release()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # Other settings than its checkpoints': the reason to give is still that the run is in use.
        code, out, err = run_cli(capsys, "train", "--data", "random", "--n-samples", "512", "--epochs", "3",
                                 "--batch-size", "32", "--out", str(out_dir), "--no-progress", "--device", "cpu")
        assert_usage_error(code, out, err, f"--out {str(out_dir)!r} is in use by another scaleloop run (pid {holder.pid}")
    finally:
        holder.communicate("", timeout=30)


def test_a_batch_larger_than_the_dataset_is_said_or_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    common = ["train", "--data", "random", "--n-samples", "80", "--epochs", "1", "--batch-size", "1000",
              "--no-progress", "--device", "cpu"]
    code, out, err = run_cli(capsys, *common, "--out", str(tmp_path / "a"))
    assert code == 0, err
    assert ("note: --batch-size 1,000 is larger than the 80 training samples: each epoch is one step of all 80"
            in out), out
    assert "1 steps, 80 samples" in out
    code, out, err = run_cli(capsys, *common, "--drop-last", "--out", str(tmp_path / "b"))
    assert_usage_error(code, out, err, "--batch-size 1,000 with --drop-last leaves no step",
                       "use --batch-size 80 or less")


@pytest.mark.parametrize("argv, hint", [
    (["train", "--stratgy", "ddp"], "; did you mean --strategy? (see: scaleloop --help)"),
    (["train", "--stratgy", "ddp", "--epoch", "3"], "; did you mean --strategy (for --stratgy), --epochs (for --epoch)?"),
    (["bench", "scaling", "--nprocs", "2"], "; did you mean --nproc?"),
    (["train", "--strategy", "dpp"], "; did you mean 'dp' or 'ddp'? (see: scaleloop train --help)"),
    (["trian"], "; did you mean 'train'?"),
])
def test_a_typo_gets_the_nearest_flag_or_choice(capsys: pytest.CaptureFixture[str], argv: list[str], hint: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scaleloop: error: ") and hint in err, err


def test_nothing_close_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--xyz", "3"]) == 2
    assert "did you mean" not in capsys.readouterr().err
