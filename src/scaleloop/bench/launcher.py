"""Start benchmark workers: one plain process, or N under PyTorch's launcher (torchrun).

Every measurement runs in fresh processes, so that no run inherits another's thread pool,
allocator state or warm caches, and the 1-worker baseline starts exactly as the N-worker
runs do. The workers' progress lines are passed on as they arrive.

Workers start as ``scaleloop train --nproc N`` starts its own (``scaleloop.launching.worker``
under ``scaleloop.launching.agent``): each rank's output in ``logs/rank-<R>.log``, an exception
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
from scaleloop.config import TrainConfig
from scaleloop.launching.failures import ELASTIC_DIR, LOGS_DIR, analyse
from scaleloop.launching.torchrun import supervised_command

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


def supervised_worker_command(nproc: int, spec: Path, out: Path, logs: Path,
                              python: str = sys.executable) -> list[str]:
    """What runs: the worker through ``scaleloop.launching.worker`` (logs and error files in ``logs``);
    under torchrun (its messages in ``logs/torchrun.log``) when ``nproc`` > 1."""
    worker = [WORKER_MODULE, "--spec", str(spec), "--out", str(out)]
    if nproc == 1:
        return [python, "-m", "scaleloop.launching.worker", str(logs), *worker]
    return supervised_command(TrainConfig(nproc=nproc, max_restarts=0), worker, logs, LAUNCH_ID, python)


def single_error_file(logs: Path) -> Path:
    """Where a 1-process worker records its exception: where torchrun would put rank 0's."""
    return logs / ELASTIC_DIR / LAUNCH_ID / "single" / "attempt_0" / "0" / "error.json"


def worker_command(nproc: int, spec: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The command that runs the worker in ``nproc`` processes (torchrun only when N > 1): what
    :func:`supervised_worker_command` amounts to, shown when the workers fail."""
    worker = ["-m", "scaleloop.bench.worker", "--spec", str(spec), "--out", str(out)]
    if nproc == 1:
        return [python, *worker]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--nnodes=1", "--max-restarts=0", *worker]


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
        env = worker_env(threads)
        logs.mkdir()
        if nproc == 1:
            single_error_file(logs).parent.mkdir(parents=True)
            env["TORCHELASTIC_ERROR_FILE"] = str(single_error_file(logs))   # read by torchrun's record()
        code, lines = _run(supervised_worker_command(nproc, spec, out, logs), env, say, timeout_s)
        if code != 0:
            keep = True
            failure = analyse(tmp, logs / ELASTIC_DIR / LAUNCH_ID, list(range(nproc)), None, code, None, doctor=False)
            report = [failure.report[0].removeprefix("scaleloop: error: "), *failure.report[1:]]
            raise BenchFailure("\n".join(report))
        if not out.exists():
            keep = True
            tail = "\n".join(lines[-60:])
            raise BenchFailure(f"the {nproc}-process benchmark wrote no result; command: "
                               f"{' '.join(shlex.quote(c) for c in worker_command(nproc, spec, out))}\n{tail}"
                               f"\nlogs: {logs}/rank-<N>.log")
        return json.loads(out.read_text(encoding="utf-8"))["runs"]
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], env: dict[str, str], say: Say, timeout_s: float) -> tuple[int, list[str]]:
    """Run ``cmd``, echo its progress lines; its exit code and all its output lines (BenchFailure
    when it runs over ``timeout_s``)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith(PROGRESS_PREFIX):
                say("  " + line[len(PROGRESS_PREFIX):].strip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except BaseException as exc:  # timeout or Ctrl-C: no worker may outlive the benchmark
        _stop(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise BenchFailure(f"the benchmark workers did not finish in {timeout_s:.0f} s and were "
                               "stopped\n" + "\n".join(lines[-60:])) from None
        raise
    reader.join(timeout=10)
    return code, lines


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM lets torchrun stop its workers; SIGKILL whatever is left after a grace period."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
