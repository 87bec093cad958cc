"""Fault tolerance: SIGKILL one worker mid-run; torchrun restarts the group, which resumes.

``scaleloop train --nproc 2 --max-restarts 3`` runs under torchrun's elastic agent. The test
waits for the checkpoint of step 8, kills rank 1 with SIGKILL, and lets the agent restart both
workers; they resume from the newest valid checkpoint and finish. The final weights must equal
an uninterrupted run's, and the recorded sample indices show exactly what was trained when:
the first attempt's steps up to the checkpoint, then the restarted attempt's from it to the end
(the steps between the checkpoint and the kill are trained twice, and only the second time counts).

Preemption: SIGTERM to ``scaleloop train --nproc 2`` mid-run; the workers finish their step, write
a checkpoint together and the run ends with one line naming the checkpoint and the command that
continues it; that command finishes the run with the uninterrupted weights, and the samples
recorded show that the stopped run loaded nothing after its last step.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from procs import SRC, ForkedRun, child_env, kill_group, run
from scaleloop.commands.doctor import diagnose

from scaleloop.data.sampler import StepSampler

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BATCH, EPOCHS, N = 64, 3, 1000
ARGS = ["train", "--data", "recording_data:build", "--model", "simplenet", "--epochs", str(EPOCHS),
        "--batch-size", str(BATCH), "--optimizer", "sgd", "--lr", "0.05", "--nproc", "2", "--strategy", "ddp",
        "--checkpoint-every", "4", "--no-progress", "--no-tensorboard", "--log-every", "1"]


def env_for(record_dir: Path) -> dict[str, str]:
    record_dir.mkdir()
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "RECORD_DIR": str(record_dir)})


def start(args: list[str], cwd: Path, env: dict[str, str]) -> ForkedRun:
    """``scaleloop ARGS`` to be signalled or watched, its output and standard error together: a fork of
    the tests' fork server, as are torchrun's agent and the workers it starts and restarts
    (forked_launch.py). A killed rank restarted in fresh interpreters, as users' are:
    test_endings_dist.py, and across machines test_elastic_nodes.py."""
    return ForkedRun([sys.executable, "-m", "scaleloop", *args], cwd=cwd, env=env, timeout=300, merge=True)


def recorded(record_dir: Path, rank: int, restart: int) -> list[int]:
    path = record_dir / f"rank{rank}-restart{restart}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def sampled(rank: int, from_step: int = 0) -> list[int]:
    """The indices rank ``rank`` loads from global step ``from_step`` to the end, by the sampler."""
    sampler = StepSampler(N, BATCH, world_size=2, rank=rank, seed=0)
    out: list[int] = []
    for epoch in range(EPOCHS):
        start = max(0, from_step - epoch * sampler.steps_per_epoch)
        for mb in sampler.micro_batches(epoch, start):
            out += mb.indices.tolist()
    return out


def wait_for(path: Path, proc: ForkedRun, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name} appeared:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same run, never interrupted (``whole/`` and ``whole-records/``)."""
    base = tmp_path_factory.mktemp("elastic")
    res = run([sys.executable, "-m", "scaleloop", *ARGS, "--out", str(base / "whole")],
              cwd=base, env=env_for(base / "whole-records"))
    assert res.returncode == 0, res.stdout + res.stderr
    return base


def assert_same_weights(reference: Path, run_dir: Path) -> None:
    whole_weights = torch.load(reference / "model.pt", weights_only=True)
    final = torch.load(run_dir / "model.pt", weights_only=True)
    for key in whole_weights:
        assert torch.equal(whole_weights[key], final[key]), f"{key} differs from the uninterrupted run"


def test_killed_worker_is_restarted_and_resumes_exactly(tmp_path: Path, whole: Path) -> None:
    records = tmp_path / "records"
    proc = start([*ARGS, "--max-restarts", "3", "--out", str(tmp_path / "run")], tmp_path, env_for(records))
    try:
        wait_for(tmp_path / "run" / "checkpoints" / "step-00000008", proc)
        victim = int((records / "pid-rank1-restart0").read_text())
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output
    assert (records / "pid-rank0-restart1").exists(), f"the group was not restarted:\n{output}"

    # The restarted group resumed from a checkpoint at or after step 8 ...
    resumed = re.search(r"resuming from \S*step-(\d+)", output)
    assert resumed, output
    step = int(resumed.group(1))
    assert step >= 8
    # ... and ends with exactly the uninterrupted weights.
    assert_same_weights(whole / "whole", tmp_path / "run")

    for rank in (0, 1):
        first, second = recorded(records, rank, 0), recorded(records, rank, 1)
        # Nothing skipped, nothing extra: attempt 1 up to the checkpoint, then attempt 2 to the end.
        done_before = len(sampled(rank)) - len(sampled(rank, step))
        # (>=: rank 0 renames the checkpoint into place before the save's last collective, so the
        # kill can land before any rank loads the next step's samples.)
        assert len(first) >= done_before, f"rank {rank}: the kill came before the checkpoint's step"
        assert first[:done_before] == sampled(rank)[:done_before], f"rank {rank}: first attempt off the sampler's order"
        assert second == sampled(rank, step), f"rank {rank}: the resumed attempt did not continue exactly"
        assert first[:done_before] + second == recorded(whole / "whole-records", rank, 0)


STOP_LINE = re.compile(r"^scaleloop: stopped by SIGTERM after step (\d+); checkpoint (\S+) written; "
                       r"continue with: (scaleloop train --out \S+)$", re.M)


def test_sigterm_stops_after_a_step_with_a_checkpoint_and_continues_exactly(tmp_path: Path, whole: Path) -> None:
    records = tmp_path / "records"
    env = env_for(records)
    env["RECORD_DELAY"] = "0.005"  # ~0.2 s a step: the run is still early on when the signal lands
    proc = start([*ARGS, "--out", str(tmp_path / "run")], tmp_path, env)
    try:
        wait_for(tmp_path / "run" / "checkpoints" / "step-00000004", proc)
        proc.send_signal(signal.SIGTERM)   # to the launcher only, as `kill PID` or a scheduler does
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 143, output
    stops = STOP_LINE.findall(output)
    assert len(stops) == 1 and "Traceback" not in output, output
    step, checkpoint, command = int(stops[0][0]), Path(stops[0][1]), stops[0][2]
    total = EPOCHS * StepSampler(N, BATCH, world_size=2, rank=0, seed=0).steps_per_epoch
    assert 4 <= step < total, output
    assert checkpoint == tmp_path / "run" / "checkpoints" / f"step-{step:08d}" and checkpoint.is_dir()
    assert not (tmp_path / "run" / "model.pt").exists()
    told = diagnose(tmp_path / "run")   # rank 0's record of the stop, read from the directory alone
    assert (told.state, told.what) == ("stopped", STOP_LINE.search(output).group(0)[len("scaleloop: "):])
    assert told.checkpoint is not None and told.checkpoint.step == step and told.continue_with == command
    # Every rank stopped after the same step, and loaded no sample after it.
    for rank in (0, 1):
        done = len(sampled(rank)) - len(sampled(rank, step))
        assert recorded(records, rank, 0) == sampled(rank)[:done], f"rank {rank} did not stop after step {step}"

    # The printed command continues the run to its end, exactly.
    again = tmp_path / "records-again"
    res = run([sys.executable, "-m", *command.split()[0:1], *command.split()[1:]], cwd=tmp_path, env=env_for(again))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resuming from {checkpoint}" in res.stdout, res.stdout
    assert_same_weights(whole / "whole", tmp_path / "run")
    for rank in (0, 1):
        assert recorded(again, rank, 0) == sampled(rank, step), f"rank {rank}: the continued run is off the sampler's order"


def test_an_elastic_job_splits_a_batch_unevenly_and_says_so(tmp_path: Path) -> None:
    """--nnodes 1:2 on one machine with 3 workers: 64 does not split over 3, so the workers train
    22, 21 and 21 samples a step, each weighted by its share: the same steps as one process."""
    common = ["train", "--data", "random", "--n-samples", "640", "--epochs", "1", "--batch-size", "64",
              "--optimizer", "sgd", "--lr", "0.1", "--no-progress", "--no-tensorboard"]
    one = run([sys.executable, "-m", "scaleloop", *common, "--out", str(tmp_path / "one")], cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    three = run([sys.executable, "-m", "scaleloop", *common, "--nproc", "3", "--strategy", "ddp", "--nnodes", "1:2",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "last_call_timeout=1",
                 "--out", str(tmp_path / "three")], cwd=tmp_path)
    assert three.returncode == 0, three.stdout + three.stderr
    assert ("--batch-size 64 does not split evenly over the 3 worker(s) x 1 accumulation step(s) this elastic job "
            "has now; each micro-batch holds 21 or 22 samples") in three.stdout, three.stdout
    a = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "three" / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
