"""Start the N verify workers under torchrun and wait for them; what to say when they fail.

The command is the one ``scaleloop train --nproc N`` runs (``scaleloop.launching.torchrun``), with
the hidden worker program in place of the CLI: torchrun's own messages go to
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
from scaleloop.launching.failures import ELASTIC_DIR, FAILURE_FILE, LOGS_DIR, Failure, analyse
from scaleloop.launching.torchrun import supervised_command, torchrun_command, workers_env
from scaleloop.verify.layout import LOG_FILE

WORKER_MODULE = "scaleloop.verify.worker"
# One launch per report directory (its logs are cleared first): a fixed name for torchrun's --log-dir.
LAUNCH_ID = "verify"


def worker_command(cfg: TrainConfig, root: Path) -> list[str]:
    """``python -m torch.distributed.run ... -m scaleloop.verify.worker ROOT``."""
    cmd = torchrun_command(cfg.replace(max_restarts=0), [])
    if cmd[-2:] != ["-m", "scaleloop"]:
        raise RuntimeError(f"unexpected torchrun command shape: {cmd}")
    return cmd[:-1] + [WORKER_MODULE, str(root)]


@contextlib.contextmanager
def start_workers(cfg: TrainConfig, root: Path, say: Callable[[str], None]) -> Iterator[subprocess.Popen]:
    """Start torchrun and its workers in the background; stopped on leaving early (an exception).

    ``proc.wait()`` gives torchrun's exit code: 0 when every worker succeeded.
    """
    cfg = cfg.replace(max_restarts=0)   # a restarted worker would record the steps twice
    say(f"launching {cfg.nproc} processes with torchrun: "
        + " ".join(shlex.quote(c) for c in worker_command(cfg, root)))
    logs = root / LOGS_DIR
    shutil.rmtree(logs, ignore_errors=True)  # a previous report's logs and error files
    (root / FAILURE_FILE).unlink(missing_ok=True)
    logs.mkdir(parents=True)
    cmd = supervised_command(cfg, [WORKER_MODULE, str(root)], logs, LAUNCH_ID)
    with open(root / LOG_FILE, "wb") as log:
        # Same process group as this one: Ctrl-C reaches torchrun, which stops its workers.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=workers_env(cfg, logs))
        try:
            yield proc
        except BaseException:
            proc.terminate()  # torchrun passes it on to its workers
            proc.wait()
            raise
        proc.wait()


def failure_report(root: Path, cfg: TrainConfig, code: int) -> Optional[Failure]:
    """Which rank failed first (or stalled) and where, from the workers' error files and logs.

    None when the workers left nothing to read (they did not start under the supervised
    launcher). The report's lines are ``Failure.report``; it is also written to
    ``ROOT/failure.json``.
    """
    logs = root / LOGS_DIR
    if not logs.is_dir():
        return None
    failure = analyse(root, logs / ELASTIC_DIR / LAUNCH_ID, list(range(cfg.world_size)), cfg.timeout, code,
                      "once fixed, run the same scaleloop verify command again", doctor=False)
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
