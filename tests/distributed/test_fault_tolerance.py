"""Replica groups under torchft (``--replica-groups 2 --nproc 2``): a lost group, and the others go on.

Without a fault, two groups of one process train what ``--nproc 2 --strategy ddp`` trains: each
group's samples are that DDP rank's, and the weights agree to within 1e-6 of the largest weight.
SIGKILL of group 1's worker after step 3: group 0 trains on alone (one process, never restarted),
group 1 is restarted by its own torchrun, takes group 0's state and rejoins at a step boundary;
both end with the same weights, and every step's samples are trained once by a group present or
recorded as not trained (``replica-steps.jsonl``). docs/fault-tolerance.md.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from procs import SRC, child_env, kill_group, run
from scaleloop.data.sampler import StepSampler

import torchft  # noqa: F401,E402  (the dev extras install it: missing, this file fails)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BATCH, N, STEPS = 64, 1000, 16
ARGS = ["train", "--data", "replica_data:build", "--model", "simplenet", "--epochs", "1", "--batch-size", str(BATCH),
        "--optimizer", "sgd", "--lr", "0.05", "--nproc", "2", "--strategy", "ddp", "--no-progress",
        "--no-tensorboard", "--log-every", "1"]


# The lighthouse's line for each quorum request of group 1 (torchft 0.2.0's lighthouse log).
ASKED = "Received quorum request for replica group1:"


def env_for(records: Path, **extra: str) -> dict[str, str]:
    records.mkdir()
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "RECORD_DIR": str(records), **extra})


def recorded(records: Path, tag: str) -> list[int]:
    path = records / f"{tag}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def shares(rank: int, steps: range) -> list[int]:
    """The samples data rank ``rank`` of 2 trains in ``steps`` (1-based), by the sampler."""
    sampler = StepSampler(N, BATCH, world_size=2, rank=rank, seed=0)
    return [i for mb in sampler.micro_batches(0, 0) if mb.step + 1 in steps for i in mb.indices.tolist()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--nproc 2 --strategy ddp``, the same run without replica groups."""
    base = tmp_path_factory.mktemp("ft-ddp")
    res = run([sys.executable, "-m", "scaleloop", *ARGS, "--out", str(base / "run")], cwd=base,
              env=env_for(base / "records"))
    assert res.returncode == 0, res.stdout + res.stderr
    return base / "run"


def test_without_a_fault_two_groups_train_what_ddp_trains(tmp_path: Path, ddp: Path) -> None:
    records = tmp_path / "records"
    res = run([sys.executable, "-m", "scaleloop", *ARGS, "--replica-groups", "2", "--out", str(tmp_path / "run")],
              cwd=tmp_path, env=env_for(records))
    assert res.returncode == 0, res.stdout + res.stderr
    reference, largest = weights(ddp), max(w.abs().max().item() for w in weights(ddp).values())
    for group in (0, 1):
        final = weights(tmp_path / "run" / f"group-{group}")
        for key, w in reference.items():
            assert (final[key] - w).abs().max().item() <= 1e-6 * largest, f"group {group}: {key} differs from ddp"
        # The data rule, all groups present: group g trains DDP rank g's share of every step.
        assert recorded(records, f"group{group}-rank0-restart0") == shares(group, range(1, STEPS + 1))
    assert not (tmp_path / "run" / "group-0" / "replica-steps.jsonl").exists()


def test_a_killed_group_rejoins_from_a_live_one_while_the_other_trains_on(tmp_path: Path) -> None:
    records = tmp_path / "records"
    # Group 0 waits after step 8 until group 1 is back: the rejoin is inside the run on any machine's speed.
    env = env_for(records, RECORD_DELAY="0.005", REPLICA_HOLD=f"0:{8 * BATCH // 2}")
    proc = subprocess.Popen([sys.executable, "-m", "scaleloop", *ARGS, "--replica-groups", "2", "--max-restarts", "2",
                             "--out", str(tmp_path / "run")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = records / "group1-rank0-restart0.txt"
        deadline = time.monotonic() + 180
        while len(recorded(records, "group1-rank0-restart0")) < 3 * BATCH // 2:
            assert proc.poll() is None and time.monotonic() < deadline, f"group 1 did not reach step 3 ({first})"
            time.sleep(0.02)
        lighthouse = tmp_path / "run" / "lighthouse.log"
        asked = lighthouse.read_text().count(ASKED)
        os.kill(int((records / "pid-group1-rank0-restart0").read_text()), signal.SIGKILL)
        # Released once the restarted group asks the lighthouse for a quorum (group 0 then joins it).
        while lighthouse.read_text().count(ASKED) <= asked:
            assert proc.poll() is None and time.monotonic() < deadline, "group 1 did not come back"
            time.sleep(0.05)
        (records / "release").touch()
        output, _ = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output
    run_dir = tmp_path / "run"
    # Group 0 went on in its one process: never restarted.
    assert not (records / "pid-group0-rank0-restart1").exists(), output
    # Both groups end with the same weights.
    a, b = weights(run_dir / "group-0"), weights(run_dir / "group-1")
    assert all(torch.equal(a[k], b[k]) for k in a), "the groups' final weights differ"
    # recovery.json, and the console, name the group, the steps it left after and rejoined at.
    [recovery] = json.loads((run_dir / "group-1" / "recovery.json").read_text())
    left, back = recovery["left_after_step"], recovery["rejoined_step"]
    assert recovery["replica_group"] == 1 and 2 <= left < back <= STEPS, recovery
    assert f"replica group 1 left after step {left} and rejoined at step {back}" in output
    # The data rule with a group missing: group 0 trained its share of every step; group 1 its share
    # of the steps before the fault and from its return; the steps between are recorded.
    assert recorded(records, "group0-rank0-restart0") == shares(0, range(1, STEPS + 1))
    before = recorded(records, "group1-rank0-restart0")
    assert before == shares(1, range(1, STEPS + 1))[:len(before)]   # (killed inside a step, perhaps)
    assert recorded(records, "group1-rank0-restart1") == shares(1, range(back, STEPS + 1))
    # (None when group 1 came back before group 0's next quorum gave up on it: then it left after the
    # step before the one it rejoined at, and no step was short.)
    steps_file = run_dir / "group-0" / "replica-steps.jsonl"
    short = [json.loads(line) for line in steps_file.read_text().splitlines()] if steps_file.exists() else []
    assert [e["step"] for e in short] == list(range(left + 1, back)), short
    for entry in short:
        assert entry["global_batch"] == (BATCH // 2 if entry["committed"] else 0), entry
