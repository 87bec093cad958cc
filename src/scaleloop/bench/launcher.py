"""Start benchmark workers: one plain process, or N under PyTorch's launcher (torchrun).

Every measurement runs in fresh processes, so that no run inherits another's thread pool,
allocator state or warm caches, and the 1-worker baseline starts exactly as the N-worker
runs do. The workers' progress lines are passed on as they arrive.

Workers start as ``scaleloop train --nproc N`` starts its own (``scaleloop.launching.supervisor``:
``scaleloop.launching.worker`` under ``scaleloop.launching.agent``): each rank's output in ``logs/rank-<R>.log``, an exception
in torchrun's error file. When a worker fails, :class:`BenchFailure` carries the short report
of ``scaleloop.launching.failures`` (the rank that failed first, its exception, the user's
line, where the logs are), and the logs are kept.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from scaleloop.bench.worker import PROGRESS_PREFIX
from scaleloop.bench.workload import RunSpec, Workload
from scaleloop.launching.failures import LOGS_DIR
from scaleloop.launching.supervisor import LaunchOutcome, Workers, start
from scaleloop.launching.torchrun import WorkerLaunch

Say = Callable[[str], None]

# A launch that takes longer than this has hung (a collective waiting for a dead peer).
DEFAULT_TIMEOUT_S = 1800.0


# torchrun's --log-dir under logs/: one launch per (fresh) temporary directory.
LAUNCH_ID = "bench"
WORKER_MODULE = "scaleloop.bench.worker"


class BenchFailure(Exception):
    """Workers failed or hung; the message is the short report (which rank, what, where; the logs).

    The CLI prints it after ``scaleloop: error:``.
    """


def bench_launch(nproc: int, spec: Path, out: Path, logs: Path, env: Optional[dict[str, str]] = None,
                 python: str = sys.executable) -> WorkerLaunch:
    """The benchmark worker in ``nproc`` processes on this machine, never restarted; one process
    runs without torchrun (``direct``), recorded all the same."""
    return WorkerLaunch(nproc=nproc, module=WORKER_MODULE, argv=("--spec", str(spec), "--out", str(out)),
                        logs=logs, launch_id=LAUNCH_ID, direct=nproc == 1, env=env, python=python)


def worker_env(threads: Optional[int]) -> dict[str, str]:
    """The workers' environment: this one, minus a launcher's rank variables, plus thread counts.

    Setting OMP_NUM_THREADS also keeps torchrun from printing its warning about it.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK")}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_workers(workload: Workload, runs: Sequence[RunSpec], nproc: int, say: Say, *,
                allreduce_reps: int = 10, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Measure ``runs`` (in order) in ``nproc`` fresh worker processes; one result per run."""
    threads = runs[0].threads if runs else None
    tmp = Path(tempfile.mkdtemp(prefix="scaleloop-bench-"))
    keep = False   # the logs of failed workers stay, for the report names them
    try:
        spec, out, logs = tmp / "spec.json", tmp / "result.json", tmp / LOGS_DIR
        spec.write_text(json.dumps({"workload": workload.to_dict(), "runs": [r.to_dict() for r in runs],
                                    "allreduce_reps": allreduce_reps}), encoding="utf-8")
        launch = bench_launch(nproc, spec, out, logs, worker_env(threads))
        code, lines = _run(launch, say, timeout_s)
        if code != 0 and LaunchOutcome(launch, code, 0.0).interrupted():
            # SIGINT reached the workers, not this process: an interrupt, not a failure to report
            # (the temporary directory goes, as after a Ctrl-C heard here).
            raise KeyboardInterrupt
        if code != 0:
            keep = True
            failure = LaunchOutcome(launch, code, 0.0).failure(tmp, continue_line=None, ranks=range(nproc), doctor=False)
            report = [failure.report[0].removeprefix("scaleloop: error: "), *failure.report[1:]]
            raise BenchFailure("\n".join(report))
        if not out.exists():
            keep = True
            tail = "\n".join(lines[-60:])
            raise BenchFailure(f"the {nproc}-process benchmark wrote no result; command: "
                               f"{' '.join(shlex.quote(c) for c in launch.plain_command())}\n{tail}"
                               f"\nlogs: {logs}/rank-<N>.log")
        return json.loads(out.read_text(encoding="utf-8"))["runs"]
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(launch: WorkerLaunch, say: Say, timeout_s: float) -> tuple[int, list[str]]:
    """Run ``launch``, echo its progress lines; its exit code and all its output lines (BenchFailure
    when it runs over ``timeout_s``)."""
    lines: list[str] = []
    with start(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as workers:
        reader = threading.Thread(target=_pump, args=(workers, lines, say), daemon=True)
        reader.start()
        try:
            code = workers.wait(timeout=timeout_s).code
        except subprocess.TimeoutExpired:  # no worker may outlive the benchmark
            workers.stop()
            raise BenchFailure(f"the benchmark workers did not finish in {timeout_s:.0f} s and were "
                               "stopped\n" + "\n".join(lines[-60:])) from None
        reader.join(timeout=10)
    return code, lines


def _pump(workers: Workers, lines: list[str], say: Say) -> None:
    """Keep the workers' output lines, and pass their progress lines on as they arrive."""
    assert workers.proc.stdout is not None
    for line in workers.proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if line.startswith(PROGRESS_PREFIX):
            say("  " + line[len(PROGRESS_PREFIX):].strip())
