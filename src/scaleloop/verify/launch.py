"""Start the N verify workers under torchrun and wait for them; what to say when they fail.

The launch is the one ``scaleloop train --nproc N`` makes (``scaleloop.launching.torchrun``), with
the hidden worker program in place of the CLI, started and watched the same way
(``scaleloop.launching.supervisor``): torchrun's own messages go to
``logs/torchrun.log`` in the report directory, each rank's output to ``logs/rank-<R>.log``,
and a worker that raises leaves torchrun's error file (``scaleloop.launching.worker``). When the
workers fail, :func:`failure_report` reads those files (``scaleloop.launching.failures``): the
same few lines as ``train`` prints, naming the rank that failed first or stalled and the user's
line. Rank 0's console output goes to ``torchrun.log``: the parent prints a table, not N
interleaved logs.
"""
from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Optional

from scaleloop.config import TrainConfig
from scaleloop.launching.failures import FAILURE_FILE, LOGS_DIR, Failure
from scaleloop.launching.supervisor import LaunchOutcome, Workers, start
from scaleloop.launching.torchrun import WorkerLaunch, launch_for, workers_env
from scaleloop.verify.dirs import LOG_FILE

WORKER_MODULE = "scaleloop.verify.worker"
# One launch per report directory (its logs are cleared first): a fixed name for torchrun's --log-dir.
LAUNCH_ID = "verify"


def verify_launch(cfg: TrainConfig, root: Path) -> WorkerLaunch:
    """The verify workers' launch: ``cfg``'s processes, never restarted (a restarted worker would
    record the steps twice), each running the verify worker on ``root``."""
    cfg = cfg.replace(max_restarts=0)
    logs = root / LOGS_DIR
    return launch_for(cfg, WORKER_MODULE, [str(root)], logs=logs, launch_id=LAUNCH_ID, env=workers_env(cfg, logs))


@contextlib.contextmanager
def start_workers(cfg: TrainConfig, root: Path, say: Callable[[str], None]) -> Iterator[Workers]:
    """Start torchrun and its workers in the background; stopped on leaving early (an exception).

    ``workers.wait()`` gives how they ended: code 0 when every worker succeeded.
    """
    launch = verify_launch(cfg, root)
    say(f"launching {cfg.launch.nproc} processes with torchrun: " + " ".join(shlex.quote(c) for c in launch.plain_command()))
    shutil.rmtree(launch.logs, ignore_errors=True)  # a previous report's logs and error files
    (root / FAILURE_FILE).unlink(missing_ok=True)
    launch.logs.mkdir(parents=True)
    with open(root / LOG_FILE, "wb") as log:
        with start(launch, stdout=log, stderr=subprocess.STDOUT) as workers:
            yield workers
            workers.wait()   # the caller has waited already, unless it returned early


def failure_report(root: Path, cfg: TrainConfig, code: int) -> Optional[Failure]:
    """Which rank failed first (or stalled) and where, from the workers' error files and logs.

    None when the workers left nothing to read (they did not start under the supervised
    launcher). The report's lines are ``Failure.report``; it is also written to
    ``ROOT/failure.json``.
    """
    if not (root / LOGS_DIR).is_dir():
        return None
    ended = LaunchOutcome(verify_launch(cfg, root), code, started=0.0)
    failure = ended.failure(root, continue_line="once fixed, run the same scaleloop verify command again",
                            timeout_s=cfg.launch.timeout, ranks=range(cfg.world_size), doctor=False)
    failure.write(root)
    return failure


def worker_errors(root: Path, lines: int = 25) -> list[str]:
    """What the workers' log says went wrong: their exception lines, else the log's last lines."""
    path = root / LOG_FILE
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    # "RuntimeError: ..." as Python prints an uncaught exception; torchrun's own summary
    # (ChildFailedError) only repeats that a worker failed.
    errors = [line for line in text if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line)
              and "ChildFailedError" not in line]
    return list(dict.fromkeys(errors)) or text[-lines:]
