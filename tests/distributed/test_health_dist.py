"""A run's health on real 2-process groups (issue 17, points 3 and 5).

- a straggler: rank 1 sleeps 30 ms in every forward (scripts/slow_models.py); rank 0 prints one
  line naming it while the run goes on, metrics.csv holds the per-rank step times, the summary
  names it;
- a diverging run (``--lr 1e10``): every rank stops at the first non-finite loss with one line
  naming the step and the last good checkpoint; no checkpoint holds non-finite weights and
  ``--keep-checkpoints 1`` keeps the good one;
- the run-directory lock: a second run into a running run's ``--out`` is refused with one line
  naming the launcher that holds it (whose rank 0 trains under that same lock); once the first
  run is killed, its stale lock is taken over.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from procs import SRC, child_env, kill_group, run
from scaleloop.commands.doctor import diagnose

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRAIN = [sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--no-progress", "--no-tensorboard"]


def env() -> dict[str, str]:
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)])})


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def straggler(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("health") / "straggler"
    res = run([*TRAIN, "--model", "slow_models:rank1", "--epochs", "1", "--max-steps", "16", "--log-every", "4",
               "--out", str(out)], cwd=SCRIPTS, timeout=240, env=env())
    assert res.returncode == 0, res.stdout + res.stderr
    return res, out


def test_a_straggler_is_named_once_during_the_run_and_in_the_summary(straggler) -> None:
    res, _ = straggler
    lines = [line for line in res.stdout.splitlines() if line.startswith("straggler:")]
    assert len(lines) == 1, res.stdout          # reported, but not at every log row
    assert lines[0].startswith("straggler: rank 1 takes "), lines
    summary = res.stdout[res.stdout.index("summary"):]
    assert re.search(r"^  straggler +rank 1 takes", summary, re.M), summary


def test_per_rank_step_times_are_in_the_metrics(straggler) -> None:
    _, out = straggler
    steps = [r for r in rows(out) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == ["4", "8", "12", "16"]
    for r in steps:
        # Rank 1 sleeps 30 ms per step on top of the same work as rank 0: its step cannot be
        # shorter than that on any machine, and it is the slower one however loaded the machine is.
        assert r["slowest_rank"] == "1"
        assert float(r["rank_step_s_max"]) >= 0.030 and float(r["rank_step_s_max"]) > float(r["rank_step_s_min"])


def test_a_diverging_run_stops_at_the_first_nonfinite_loss(tmp_path: Path) -> None:
    out = tmp_path / "diverged"
    res = run([*TRAIN, "--model", "simplenet", "--epochs", "2", "--optimizer", "sgd", "--lr", "1e10",
               "--checkpoint-every", "2", "--keep-checkpoints", "1", "--log-every", "1", "--out", str(out)],
              cwd=SCRIPTS, timeout=240, env=env())
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    # The same line from every rank that stopped (rank 0's console, then the launcher's report).
    errors = {line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")}
    assert len(errors) == 1, res.stderr
    error = errors.pop()
    # (both ranks' weights blow up alike; which rank's loss overflows first is the data's business)
    m = re.search(r"the run diverged: the training loss became (nan|inf|-inf) at step (\d+) \(epoch 1\) on (every rank|rank [01]); .*"
                  r"the newest valid checkpoint is '(.+)' \(step (\d+)\)", error)
    assert m, error
    bad, good = int(m.group(2)), int(m.group(5))
    assert good < bad and Path(m.group(4)) == out / "checkpoints" / f"step-{good:08d}"
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == [f"step-{good:08d}"]            # never a NaN one, and the good one not pruned
    state = torch.load(out / "checkpoints" / kept[0] / "state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    told = diagnose(out)   # the record rank 0 left, read later from the directory alone
    assert told.state == "diverged"
    assert told.what == f"diverged: the training loss became {m.group(1)} at step {bad} (epoch 1) on {m.group(3)}"
    assert told.continue_with == f"scaleloop train --out {out}"


def test_a_second_run_into_a_running_run_is_refused_and_a_stale_lock_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "locked"
    first = subprocess.Popen([*TRAIN, "--model", "slow_models:everyone", "--epochs", "100", "--log-every", "1",
                              "--out", str(out)], cwd=SCRIPTS, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # Rank 0 has written a step row: it trains under its launcher's lock, not refused by it.
        while not ((out / "metrics.csv").exists() and len(rows(out)) >= 1):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.2)
        holder = (out / "scaleloop.lock").read_text()
        assert f'"pid": {first.pid}' in holder, holder     # the launcher holds it
        assert first.poll() is None, "the first run ended before the second was tried"
        # (run() ends every process this test started once the second run is over, the first
        # among them: the refusal below, naming the first run's pid, says it was alive then.)
        second = run([*TRAIN, "--model", "slow_models:everyone", "--epochs", "1", "--out", str(out)],
                     cwd=SCRIPTS, timeout=120, env=env())
    finally:
        kill_group(first)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"scaleloop: error: --out {str(out)!r} is in use by another scaleloop run (pid {first.pid} on "
        f"{os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(_since(holder)))}); "
        "wait for it to end, or choose another --out"], second.stderr
    # Killed: its lock is stale, and the next run into --out (continuing it) takes it over.
    assert (out / "scaleloop.lock").exists()
    third = run([sys.executable, "-m", "scaleloop", "train", "--out", str(out), "--nproc", "1", "--strategy", "single",
                 "--epochs", "1", "--no-progress"], cwd=SCRIPTS, timeout=120, env=env())
    assert third.returncode == 0, third.stdout + third.stderr
    assert not (out / "scaleloop.lock").exists()


def _since(holder: str) -> float:
    import json

    return float(json.loads(holder)["since"])
