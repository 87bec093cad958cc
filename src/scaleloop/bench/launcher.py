"""Start benchmark workers: one plain process, or N under PyTorch's launcher (torchrun).

Every measurement runs in fresh processes, so that no run inherits another's thread pool,
allocator state or warm caches, and the 1-worker baseline starts exactly as the N-worker
runs do. The workers' progress lines are passed on as they arrive.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from scaleloop.bench.worker import PROGRESS_PREFIX
from scaleloop.bench.workload import RunSpec, Workload

Say = Callable[[str], None]

# A launch that takes longer than this has hung (a collective waiting for a dead peer).
DEFAULT_TIMEOUT_S = 1800.0


class BenchFailure(Exception):
    """Workers failed or hung; the message carries the end of their output."""


def worker_command(nproc: int, spec: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The command that runs the worker in ``nproc`` processes (torchrun only when N > 1)."""
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
    with tempfile.TemporaryDirectory(prefix="scaleloop-bench-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"workload": workload.to_dict(), "runs": [r.to_dict() for r in runs],
                                    "allreduce_reps": allreduce_reps}), encoding="utf-8")
        cmd = worker_command(nproc, spec, out)
        lines = _run(cmd, worker_env(threads), say, timeout_s)
        if not out.exists():
            tail = "\n".join(lines[-60:])
            raise BenchFailure(f"the {nproc}-process benchmark wrote no result; command: "
                               f"{' '.join(shlex.quote(c) for c in cmd)}\n{tail}")
        return json.loads(out.read_text(encoding="utf-8"))["runs"]


def _run(cmd: list[str], env: dict[str, str], say: Say, timeout_s: float) -> list[str]:
    """Run ``cmd``, echo its progress lines, return all its output lines; raise on failure."""
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
    if code != 0:
        raise BenchFailure(f"the benchmark workers failed (exit code {code}):\n" + "\n".join(lines[-60:]))
    return lines


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM lets torchrun stop its workers; SIGKILL whatever is left after a grace period."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
