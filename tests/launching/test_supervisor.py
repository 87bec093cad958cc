"""The one launch path: the torchrun commands come from one structure; the lifeline ends a worker
whose launcher has died (scaleloop.launching.torchrun/supervisor/lifeline)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scaleloop.config import TrainConfig
from scaleloop.launching import lifeline
from scaleloop.launching.torchrun import (C10dRendezvous, StaticMaster, WorkerLaunch, launch_for,
                                          torchrun_command)

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_printed_command_is_the_same_text_as_before() -> None:
    # The exact text `scaleloop train --nproc 4` has always printed (a user may copy it).
    assert torchrun_command(TrainConfig(nproc=4), ["train", "--config", "c.toml"], python="py") == [
        "py", "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--max-restarts=0",
        "--standalone", "-m", "scaleloop", "train", "--config", "c.toml"]
    static = TrainConfig(nproc=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400, max_restarts=2)
    assert torchrun_command(static, ["train"], python="py")[3:9] == [
        "--nproc-per-node=2", "--nnodes=2", "--max-restarts=2", "--node-rank=1", "--master-addr=10.0.0.1",
        "--master-port=29400"]


def test_every_meeting_renders_its_own_flags() -> None:
    c10d = WorkerLaunch(2, "m", meeting=C10dRendezvous("h:1", "job", "a=1", "10.1.1.1"), nnodes=3, min_nnodes=1)
    assert c10d.torchrun_flags() == ["--nproc-per-node=2", "--nnodes=1:3", "--max-restarts=0", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=h:1", "--rdzv-id=job", "--rdzv-conf=a=1",
                                     "--local-addr=10.1.1.1"]
    assert "--standalone" not in WorkerLaunch(2, "m", meeting=StaticMaster("a", 1, 0)).torchrun_flags()
    assert launch_for(TrainConfig(nproc=2, nnodes=2, rdzv_endpoint="127.0.0.1:29400", strategy="ddp"),
                      "m").meeting.endpoint == "127.0.0.1:29400"


def test_a_direct_launch_runs_the_worker_without_torchrun(tmp_path: Path) -> None:
    launch = WorkerLaunch(1, "pkg.worker", ("--x", "1"), logs=tmp_path, launch_id="b", direct=True, python="py")
    assert launch.plain_command() == ["py", "-m", "pkg.worker", "--x", "1"]
    assert launch.supervised_command() == ["py", "-m", "scaleloop.launching.worker", str(tmp_path), "pkg.worker",
                                           "--x", "1"]


@pytest.mark.skipif(not lifeline.supported(), reason="Linux only (prctl)")
def test_a_child_whose_parent_is_gone_ends_at_once() -> None:
    # The parent named in the environment is not this child's parent and no longer exists:
    # as for a launcher that died before its child asked for the signal.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    code = ("from scaleloop.launching import lifeline; lifeline.hold(); print('alive')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(SRC), lifeline.PARENT_VAR: str(gone.pid)})
    assert res.returncode == -signal.SIGKILL and "alive" not in res.stdout


@pytest.mark.skipif(not lifeline.supported(), reason="Linux only (prctl)")
def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    # A middle process starts a grandchild holding its lifeline, prints the grandchild's pid, then
    # waits to be killed; once it is, the grandchild must end without anyone signalling it.
    grandchild = ("import sys; from scaleloop.launching import lifeline; lifeline.hold(); "
                  "print('held', flush=True); sys.stdin.read()")
    middle = ("import subprocess, sys; from scaleloop.launching import lifeline\n"
              f"c = subprocess.Popen([sys.executable, '-c', {grandchild!r}], env=lifeline.child_env(dict(__import__('os').environ)), "
              "stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
              "assert c.stdout.readline().strip() == 'held'\nprint(c.pid, flush=True)\nsys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", middle], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    pid = None
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(timeout=30)
        # The grandchild is not ours to wait for: it is re-parented; watch it disappear.
        import time

        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"
    finally:
        proc.kill()
        if pid is not None and Path(f"/proc/{pid}").exists():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def test_a_signal_another_thread_receives_still_interrupts_the_wait() -> None:
    """`kill -INT <launcher>` may be delivered to any thread of the launcher (torch starts some);
    the main thread, waiting for torchrun, must still see KeyboardInterrupt while torchrun runs."""
    import threading
    import time

    from scaleloop.launching.supervisor import Workers

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    workers = Workers(WorkerLaunch(1, "m"), child, time.time())  # type: ignore[arg-type]
    main = threading.main_thread().ident
    bystander_may_end = threading.Event()
    bystander = threading.Thread(target=bystander_may_end.wait, daemon=True)
    bystander.start()
    interrupted_while_running: list[bool] = []

    def interrupt_the_bystander() -> None:
        # Once the main thread is inside the wait, the signal goes to the other thread.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            codes = []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            if Workers.wait.__code__ in codes:
                break
            time.sleep(0.01)
        signal.pthread_kill(bystander.ident, signal.SIGINT)  # type: ignore[arg-type]
        # A wait that never sees it would block until the child ends: end it after a while,
        # so that the test fails instead of hanging.
        if not stopped.wait(timeout=30):
            child.stdin.close()  # type: ignore[union-attr]

    stopped = threading.Event()
    sender = threading.Thread(target=interrupt_the_bystander, daemon=True)
    sender.start()
    try:
        try:
            workers.wait()
        except KeyboardInterrupt:
            interrupted_while_running.append(child.poll() is None)
        else:
            # What the kernel says of SIGINT here (ignored or blocked, e.g. by an earlier test).
            status = Path(f"/proc/{os.getpid()}/status").read_text().splitlines()
            pytest.fail("the wait ended without KeyboardInterrupt; Python's handler "
                        f"{signal.getsignal(signal.SIGINT)!r}; "
                        + ", ".join(line for line in status if line.startswith(("SigIgn", "SigBlk", "SigCgt"))))
    finally:
        stopped.set()
        bystander_may_end.set()
        child.kill()
        child.wait(timeout=30)
        sender.join(timeout=60)
    assert interrupted_while_running == [True]
