"""``scaleloop train --replica-groups N --nproc P`` on one machine: the lighthouse and N group launchers.

Each replica group is launched as it would be on a machine of its own
(``scaleloop train --replica-group I --replica-groups N --lighthouse HOST:PORT --nproc P/N``): its own
launcher, its own torchrun with its own ``--max-restarts``, its own run directory
(``<out>/group-<I>``, with its logs, metrics, checkpoints and ``recovery.json``). So a group that is
lost is restarted by its own torchrun while the others train on, and rejoins from them
(``strategies.fault_tolerant``). This launcher starts the lighthouse (``launching.lighthouse``),
then the groups, prints their output prefixed with ``[group I]``, and waits for them.

When nothing can go on it says so in one line: the lighthouse ended (the groups cannot meet), or
every group failed. Resuming is as for one group: the same command with ``--out <out>``, each group
from its own newest checkpoint (a group without one takes a live group's state); the job's settings
are kept in ``<out>/job.toml`` for it (``config.saved_settings.JOB_CONFIG``), and a group's own
failure report names the job's command (:data:`CONTINUE_VAR`), not one that would start it alone.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional, Sequence

from scaleloop.config import TrainConfig, to_toml
from scaleloop.config.saved_settings import JOB_CONFIG
from scaleloop.errors import UsageError
from scaleloop.launching import lifeline, lighthouse as lighthouses
from scaleloop.launching.failures import Failure

LIGHTHOUSE_LOG = "lighthouse.log"
#: Group I's run directory under the job's: ``<out>/group-I`` (``scaleloop doctor <out>`` reads them all).
GROUP_PREFIX = "group-"
_POLL_S = 0.2
#: How long a group launcher has to end after SIGTERM before it is killed (:func:`_stop`).
STOP_GRACE_S = 10.0
#: Set for each group's launcher: the command that continues the whole job, which the group's own
#: failure report names (``launching.launcher``): its lighthouse is this launcher's, gone with it.
CONTINUE_VAR = "SCALELOOP_REPLICA_JOB_CONTINUE"


def group_dir(out: Path, index: int) -> Path:
    """Replica group ``index``'s run directory under the job's ``out``."""
    return out / f"{GROUP_PREFIX}{index}"


def launch_groups(cfg: TrainConfig) -> Optional[Failure]:
    """Start the lighthouse and ``cfg.launch.replica_groups`` group launchers of ``cfg.launch.nproc / N`` processes each
    on this machine, and wait for them; what went wrong when a group failed (None: all finished)."""
    from scaleloop.checkpoint.resume import run_dir_for
    from scaleloop.launching.preflight import preflight
    from scaleloop.output.rundir import default_run_dir, is_run_dir, write_atomic

    preflight(cfg)
    out = run_dir_for(cfg) or default_run_dir(cfg.model_data.model, cfg.model_data.data)
    if is_run_dir(out):
        raise UsageError(f"--out {out} holds a run of one group of processes; replica groups keep theirs in "
                         f"{group_dir(out, 0)}, ...: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    groups, per_group = cfg.launch.replica_groups, cfg.launch.nproc // cfg.launch.replica_groups
    # What `--out <out>` continues from (config.saved_settings); each group's own settings follow from it.
    write_atomic(out / JOB_CONFIG, to_toml(cfg.replace(out=str(out))).encode())
    continue_job = f"scaleloop train --replica-groups {groups} --nproc {cfg.launch.nproc} --out {shlex.quote(str(out))}"
    light = lighthouses.start(groups, out / LIGHTHOUSE_LOG)
    print(f"scaleloop: {groups} replica groups of {per_group} process(es) meeting at the torchft lighthouse "
          f"{light.endpoint} (its messages: {out / LIGHTHOUSE_LOG}); group I's run is in {group_dir(out, 0).parent}/"
          "group-I", flush=True)
    launchers: list[subprocess.Popen[str]] = []
    try:
        for index in range(groups):
            config = out / f"group-{index}.toml"
            group_cfg = cfg.replace(nproc=per_group, replica_group=index, lighthouse=light.endpoint,
                                    out=str(group_dir(out, index)))
            write_atomic(config, to_toml(group_cfg).encode())
            argv = ["train", "--config", str(config)]
            print(f"scaleloop: [group {index}] scaleloop {shlex.join(argv)}", flush=True)
            launchers.append(_start_group(index, argv, continue_job))
        codes = _wait(launchers, light)
    finally:
        _stop(launchers)
        light.stop()
    failed = {i: code for i, code in enumerate(codes) if code != 0}
    if not failed:
        return None
    if None in codes:
        line = "the torchft lighthouse ended: the replica groups cannot meet"
    elif len(failed) == groups:
        line = f"every replica group failed (exit codes {', '.join(map(str, failed.values()))}): nothing can go on"
    else:
        line = f"replica group(s) {', '.join(map(str, failed))} failed; the others finished"
    line += f"; continue from the last checkpoints with: {continue_job}"
    return Failure("failed", message=line, report=[f"scaleloop: {line}"])


def _start_group(index: int, argv: Sequence[str], continue_job: str) -> "subprocess.Popen[str]":
    """One group's launcher, its output printed here line by line with ``[group I]`` in front."""
    env = {**lifeline.child_env(os.environ), CONTINUE_VAR: continue_job}
    process = subprocess.Popen([sys.executable, "-m", __name__, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    threading.Thread(target=_relay, args=(process.stdout, f"[group {index}] "), daemon=True).start()
    return process


def _relay(stream: IO[str], prefix: str) -> None:
    for line in stream:
        print(prefix + line, end="", flush=True)


def _wait(launchers: list["subprocess.Popen[str]"], light: lighthouses.Lighthouse) -> list[Optional[int]]:
    """Each group launcher's exit code once all have ended; None for those stopped here because the
    lighthouse ended first (nothing can go on without it)."""
    while any(p.poll() is None for p in launchers):
        if not light.alive():
            print("scaleloop: the torchft lighthouse ended while the groups trained: they cannot meet; stopping them",
                  flush=True)
            running = _stop(launchers)
            return [None if p in running else p.returncode for p in launchers]
        time.sleep(_POLL_S)
    return [p.returncode for p in launchers]


def _stop(launchers: list["subprocess.Popen[str]"]) -> list["subprocess.Popen[str]"]:
    """End the group launchers still running (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`: a
    worker waiting in torchft's quorum for a lighthouse that is gone does not come back to hear the
    SIGTERM; its agent and workers end with the launcher, their lifeline). Returns those it ended."""
    running = [p for p in launchers if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return running


def main(argv: Optional[Sequence[str]] = None) -> None:
    """A group's launcher: ``scaleloop <argv>``, ended with the launcher that started it (its lifeline).
    The command line is found by name, as a worker's entry is (``launching.worker``): it sits above."""
    import importlib

    from scaleloop.runtime.exiting import exit_process

    lifeline.hold()
    exit_process(importlib.import_module("scaleloop.cli").main(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
