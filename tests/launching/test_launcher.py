"""The launcher starts torchrun without importing torch: torchrun and its workers are fresh
interpreters that import it themselves (scaleloop.launching.launcher)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# `scaleloop train ARGV` up to the start of torchrun, which is replaced by a report of what the
# launcher had imported by then.
PROBE = """
import sys
import scaleloop.launching.launcher as launcher

def supervise(launch, forward=()):
    print("torch imported" if "torch" in sys.modules else "no torch")
    print(" ".join(launch.supervised_command()))
    sys.exit(0)

launcher.supervise = supervise
from scaleloop.cli import main
sys.exit(main(sys.argv[1:]))
"""


def launcher_until_torchrun(tmp_path: Path, *argv: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID"):
        env.pop(var, None)
    res = subprocess.run([sys.executable, "-c", PROBE, "train", *argv, "--out", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()


@pytest.mark.parametrize("argv", [("--nproc", "2", "--data", "random"),
                                  ("--nproc", "2", "--device", "auto", "--strategy", "fsdp"),
                                  ("--nproc", "2", "--device", "cpu", "--model", "tinygpt", "--data", "tokens")])
def test_the_launcher_never_imports_torch_before_torchrun_starts(tmp_path: Path, argv: tuple[str, ...]) -> None:
    said = launcher_until_torchrun(tmp_path, *argv)
    assert "no torch" in said, said
    started = said[said.index("no torch") + 1]
    assert "-m scaleloop.launching.agent " in started and "-m scaleloop.launching.worker " in started
    assert (tmp_path / "run" / "config.toml").is_file()   # checked, claimed and written before torchrun starts


def test_the_workers_usage_error_is_recorded_for_doctor_unless_their_loop_did(tmp_path: Path) -> None:
    import os

    from scaleloop.commands.doctor import diagnose
    from scaleloop.launching import launcher
    from scaleloop.output.endings import Failure

    # Found while the workers built the model, before any loop could record it; an earlier
    # launch's record (written before this launch started) is replaced.
    Failure("diverged", rank=1, epoch=1, step=2, message="an earlier run's").write(tmp_path)
    os.utime(tmp_path / "failure.json", (1000.0, 1000.0))
    launcher._record_usage_error(tmp_path, "--model m:f has no parameters to train", since=2000.0)
    assert diagnose(tmp_path).what == "stopped on bad input: --model m:f has no parameters to train"
    # Found by a rank's loop during this launch, which recorded where and what (a divergence
    # is one, in words of its own): kept as it is.
    Failure("diverged", rank=1, epoch=1, step=3, message="the run diverged: ...").write(tmp_path)
    launcher._record_usage_error(tmp_path, "the run diverged: ... on rank 1", since=2000.0)
    assert diagnose(tmp_path).state == "diverged"


def test_a_sigterm_while_rank_0_says_its_usage_error_waits_until_it_is_said_and_left() -> None:
    # torchrun ends the other ranks once one has exited; a rank ended between printing its message and
    # leaving its file made the launcher print the message a second time.
    import signal

    from scaleloop.launching.launcher import _termination_held

    order: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda *_: order.append("SIGTERM"))
    try:
        with _termination_held():
            os.kill(os.getpid(), signal.SIGTERM)
            order.append("said")
            order.append("left")
        order.append("after")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert order == ["said", "left", "SIGTERM", "after"]
