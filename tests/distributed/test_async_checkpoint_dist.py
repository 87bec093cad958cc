"""``--async-checkpoint`` on real multi-process runs, started as users start them (issues 43.2, 53.7).

- ddp, fsdp, pipeline (SimpleNet in 2 stages) and ``--mesh dp=2``: every process SIGKILLed while
  the checkpoint of step 8 is being written in the background (its ``.tmp-step-00000008-*``
  directory is there) leaves step 4 the newest valid checkpoint; ``scaleloop train --out DIR``
  continues from it to the weights, and the last checkpoint's state, of the same run written
  synchronously and never interrupted, bit for bit;
- the ddp one also continues on 1 process (another world size), to those weights within rounding;
- two machines (one process each, on loopback) with ``--shared-fs no``, each with its own run
  directory: killed the same way, both continue from their step-4 checkpoints, and both
  directories end with the uninterrupted ddp run's state bit for bit (machine 0's weights and
  checkpoint, machine 1's verified copy of it);
- SIGTERM to the launcher while a checkpoint is written in the background: the workers wait for
  that write, write the stop checkpoint, and end in the one line that says how to continue; every
  checkpoint left verifies.

The checkpoints are of about 26 MB (SimpleNet, 100,000 hidden units), so that a write lasts long
enough to be caught by its temporary directory, without sleeps or hooks (as
``tests/checkpoint/test_killed_resume.py`` does).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from procs import child_env, kill_group, kill_owned, owned_pids, run
from scaleloop.checkpoint.store import list_checkpoints, newest_valid, verify_checkpoint

pytestmark = pytest.mark.distributed

# 10 steps: checkpoints at steps 4, 8 and 10 (the epoch's end); each run is killed in the second.
RUN = ["--data", "random", "--n-samples", "640", "--batch-size", "64", "--epochs", "1", "--hidden-dim", "100000",
       "--checkpoint-every", "4", "--no-progress", "--no-tensorboard", "--device", "cpu"]
SETTINGS = [*RUN, "--nproc", "2"]
STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    # SimpleNet cut into [Flatten, Linear, ReLU] and [Linear]; rank 0 gathers and writes the whole model.
    "pipeline": ["--strategy", "pipeline"],
    # The cheapest mesh of 2 processes (SimpleNet has no tp_plan): replicated over dp; DCP writes it, as fsdp's.
    "mesh": ["--mesh", "dp=2"],
}
SHARDED = {"fsdp", "mesh"}   # their model and optimizer are in DCP's files, not in state.pt
# Two machines of one process each on loopback, each with its own run directory (no shared disk).
MACHINES = ["--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--shared-fs", "no", "--strategy", "ddp"]
RUN_S = 240
ENV = {"OMP_NUM_THREADS": "1"}


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    res = run([sys.executable, "-m", "scaleloop", "train", *args], cwd=cwd, timeout=RUN_S, env=child_env(ENV))
    return res


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaleloop", "train", *args], cwd=cwd, env=child_env(ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, what: str) -> None:
    """Poll the run directory (another process writes it) until ``ready``."""
    deadline = time.monotonic() + RUN_S
    while not ready():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {RUN_S} s"
        time.sleep(0.005)


def writing(out: Path, step: int) -> Callable[[], bool]:
    """Whether the checkpoint of ``step`` is being written (its temporary directory is there)."""
    return lambda: bool(list((out / "checkpoints").glob(f".tmp-step-{step:08d}-*")))


def kill_mid_write(out: Path, proc: subprocess.Popen, what: str) -> None:
    """SIGKILL every process of the run(s) this test started once ``out``'s checkpoint of step 8 is
    being written: they are listed when step 4's is done (all have started by then), so that the
    kill is one system call each as soon as the write is seen, not a scan of /proc first."""
    wait_until(lambda: (out / "checkpoints" / "step-00000004").is_dir(), proc, f"{what}: the checkpoint of step 4")
    listed = owned_pids()
    wait_until(writing(out, 8), proc, f"{what}: the background write of step 8")
    for pid in listed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:   # one that ended on its own meanwhile (a data loader's worker)
            pass
    kill_owned(also=listed)   # any started since, and wait until each has ended


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def last_state(run_dir: Path) -> dict:
    """The newest checkpoint's state.pt, less what differs between equal runs (times, the flag itself)."""
    state = torch.load(list_checkpoints(run_dir / "checkpoints")[0] / "state.pt", weights_only=True)
    state["progress"].pop("train_s")
    del state["config"]
    return state


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The run of a strategy written synchronously and never interrupted, made once per strategy
    (the two machines' test compares with the ddp one: the same sums of the same 2 ranks)."""
    made: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in made:
            whole = tmp_path_factory.mktemp(f"whole-{strategy}") / "whole"
            res = train(*SETTINGS, *STRATEGIES[strategy], "--out", str(whole), cwd=whole.parent)
            assert res.returncode == 0, res.stdout + res.stderr
            made[strategy] = whole
        return made[strategy]

    return get


@pytest.fixture(scope="module", params=list(STRATEGIES))
def killed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           uninterrupted: Callable[[str], Path]) -> tuple[str, Path, Path]:
    """(strategy, the run written synchronously and never interrupted, an async run SIGKILLed
    mid-write of its step-8 checkpoint)."""
    strategy = request.param
    whole = uninterrupted(strategy)
    base = tmp_path_factory.mktemp(f"async-{strategy}")
    out = base / "killed"
    proc = start([*SETTINGS, *STRATEGIES[strategy], "--async-checkpoint", "--out", str(out)], base)
    try:
        kill_mid_write(out, proc, "the run")   # every process: launcher, torchrun and both workers
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    return strategy, whole, out


def test_a_run_killed_mid_background_write_keeps_the_previous_checkpoint_and_resumes_bitwise(
        killed: tuple[str, Path, Path]) -> None:
    strategy, whole, out = killed
    root = out / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]
    assert list(root.glob(".tmp-step-00000008-*"))   # the write it was killed in
    found = newest_valid(root, warn=lambda _msg: None)
    assert found is not None and found.step == 4
    copy = out.parent / "other-world"
    if strategy == "ddp":   # for the 1-process resume below, from the same checkpoint
        shutil.copytree(out, copy)

    res = train("--out", str(out), cwd=out.parent)   # with the saved settings: --async-checkpoint, 2 processes
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resuming from {root}/step-00000004" in res.stdout, res.stdout
    assert "written in the background" in res.stdout
    assert not list(root.glob(".tmp-*")), "the dead write's temporary directory was not cleaned up"
    assert equal(weights(out), weights(whole)), "the continued async run's weights differ from the sync run's"
    if strategy not in SHARDED:   # state.pt holds the whole state
        assert equal(last_state(out), last_state(whole)), "the last async checkpoint differs from the sync one"
    for path in list_checkpoints(root):
        verify_checkpoint(path)

    if strategy == "ddp":
        res = train("--out", str(copy), "--nproc", "1", cwd=out.parent)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "the checkpoint was written by 2 process(es), this run has 1" in res.stdout, res.stdout
        got, want = weights(copy), weights(whole)
        scale = max(float(t.abs().max()) for t in want.values())
        assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-5 * scale) for k in want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machines(args_of: Callable[[int], list[str]], cwd: Path) -> list[subprocess.Popen]:
    """Both machines' launchers at once, machine ``i`` with ``args_of(i)``, on a master port free now."""
    port = str(free_port())
    return [start([*args_of(i), "--master-port", port], cwd) for i in (0, 1)]


def continue_together(dirs: list[Path], cwd: Path) -> list[tuple[int, str, str]]:
    """Each machine's ``scaleloop train --out DIR`` (its saved settings) at once, on a master port free
    now (the old one may linger): forks of one request of the tests' fork server (forkgroup.py, as
    test_kubernetes.py's pods), whose agents and workers fork too (forked_launch.py); the killed
    runs above started as users start them. Each machine's (exit code, output, error)."""
    port = str(free_port())
    runs = [{"argv": [sys.executable, "-m", "scaleloop", "train", "--out", str(d), "--master-port", port],
             "env": child_env(ENV), "cwd": str(cwd), "stdout": str(cwd / f"continued{i}.out"),
             "stderr": str(cwd / f"continued{i}.err")} for i, d in enumerate(dirs)]
    spec, codes = cwd / "continued.json", cwd / "continued-codes.json"
    spec.write_text(json.dumps({"runs": runs, "codes": str(codes)}), encoding="utf-8")
    group = run([sys.executable, str(Path(__file__).resolve().parent / "forkgroup.py"), str(spec)], cwd=cwd,
                timeout=RUN_S, merge=True)
    assert group.returncode == 0 and codes.exists(), f"the machines did not run ({group.returncode}):\n{group.stdout}"
    return [(code, Path(r["stdout"]).read_text(), Path(r["stderr"]).read_text())
            for code, r in zip(json.loads(codes.read_text()), runs)]


def test_two_machines_without_a_shared_disk_killed_mid_background_write_both_resume_bitwise(
        tmp_path: Path, uninterrupted: Callable[[str], Path]) -> None:
    whole = uninterrupted("ddp")
    dirs = [tmp_path / f"machine{i}" for i in (0, 1)]
    procs = machines(lambda i: [*RUN, *MACHINES, "--node-rank", str(i), "--async-checkpoint", "--out", str(dirs[i])],
                     tmp_path)
    try:
        kill_mid_write(dirs[0], procs[0], "machine 0")   # both machines' launchers, torchruns and workers
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            kill_group(proc)
    roots = [d / "checkpoints" for d in dirs]
    assert list(roots[0].glob(".tmp-step-00000008-*"))   # the write it was killed in
    for root in roots:   # machine 1's copy of step 4 was made at the save of step 8, before its write
        assert [p.name for p in list_checkpoints(root)] == ["step-00000004"], root
        assert verify_checkpoint(root / "step-00000004").step == 4

    # Each machine continues with its run directory's saved settings (a new port: the old one may linger).
    continued = continue_together(dirs, tmp_path)
    for i, (code, out, err) in enumerate(continued):
        assert code == 0, f"machine {i}:\n{out}\n{err}"
    said = [(out, err) for _, out, err in continued]
    assert f"resuming from {roots[0]}/step-00000004" in said[0][0], said[0][0]
    assert "written in the background" in said[0][0]
    assert equal(weights(dirs[0]), weights(whole)), "machine 0's weights differ from the uninterrupted run's"
    if (dirs[1] / "model.pt").exists():   # a machine's copy of the final weights, where it keeps one
        assert equal(weights(dirs[1]), weights(whole)), "machine 1's copy of the weights differs from the sync run's"
    for i, root in enumerate(roots):
        assert not list(root.glob(".tmp-*")), f"machine {i} kept a temporary directory"
        for path in list_checkpoints(root):
            verify_checkpoint(path)
        assert equal(last_state(dirs[i]), last_state(whole)), f"machine {i}'s last checkpoint differs from the sync run's"
    assert [p.name for p in list_checkpoints(roots[1])] == [p.name for p in list_checkpoints(roots[0])]


def test_sigterm_during_a_background_write_waits_for_it_then_stops_with_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Three epochs: the stop vote (about every half second) comes well before the run's end.
    proc = start([*SETTINGS, "--epochs", "3", "--keep-checkpoints", "20", "--strategy", "ddp", "--async-checkpoint", "--out", str(out)], tmp_path)
    try:
        wait_until(writing(out, 4), proc, "the background write of step 4")
        os.kill(proc.pid, signal.SIGTERM)   # the launcher, as a scheduler stops a job
        _, err = proc.communicate(timeout=RUN_S)
    finally:
        kill_group(proc)
    said = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 143 and len(said) == 1, err
    stop = re.fullmatch(rf"scaleloop: stopped by SIGTERM after step (\d+); checkpoint {out}/checkpoints/step-0*(\d+) "
                        rf"written; continue with: scaleloop train --out {out}", said[0])
    assert stop is not None and stop.group(1) == stop.group(2) and int(stop.group(1)) > 4, err
    root = out / "checkpoints"
    steps = [verify_checkpoint(path).step for path in list_checkpoints(root)]   # every one whole
    assert 4 in steps and steps[0] == int(stop.group(1)), steps
    assert (root / "latest").read_text().strip() == f"step-{int(stop.group(1)):08d}"
    assert not list(root.glob(".tmp-*"))
