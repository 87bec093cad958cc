"""Start the N verify workers under torchrun and wait for them.

The command is the one ``scaleloop train --nproc N`` uses (``scaleloop.runtime.torchrun``), with the
hidden worker program in place of the CLI. Its output goes to ``torchrun.log`` in the report
directory: the parent prints a table, not N interleaved logs, and shows the log's end when
the workers fail for a reason it cannot name.
"""
from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
from pathlib import Path
from typing import Callable, Iterator

from scaleloop.config import TrainConfig
from scaleloop.runtime.torchrun import torchrun_command
from scaleloop.verify.layout import LOG_FILE

WORKER_MODULE = "scaleloop.verify.worker"


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
    cmd = worker_command(cfg, root)
    say(f"launching {cfg.nproc} processes with torchrun: " + " ".join(shlex.quote(c) for c in cmd))
    with open(root / LOG_FILE, "wb") as log:
        # Same process group as this one: Ctrl-C reaches torchrun, which stops its workers.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        except BaseException:
            proc.terminate()  # torchrun passes it on to its workers
            proc.wait()
            raise
        proc.wait()


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
