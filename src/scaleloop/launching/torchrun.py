"""Re-launch ``scaleloop train`` under PyTorch's own launcher (``torch.distributed.run``).

``scaleloop train --nproc 4`` is exactly ``torchrun --nproc-per-node 4 -m scaleloop train ...``:
torchrun starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, runs the
rendezvous, and (with ``--max-restarts``) restarts the whole group when a worker dies.
scaleloop adds no launcher of its own; it writes the torchrun command for you and prints it, and
runs it so that a failure is reported in a few lines (``supervised_command``).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from scaleloop.config import TrainConfig
from scaleloop.runtime import preempt
from scaleloop.launching.failures import AGENT_LOG, ELASTIC_DIR
from scaleloop.runtime.preempt import signal_number
from scaleloop.launching.rendezvous import rdzv_conf, route_address, split_endpoint

# How long torchrun waits, after passing a stop signal on, for its workers to end before SIGKILL:
# a step and a checkpoint. A scheduler's own SIGKILL at the end of its grace period comes first.
SHUTDOWN_TIMEOUT_S = 600


def torchrun_command(cfg: TrainConfig, argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The torchrun command line that runs ``scaleloop <argv>`` in ``cfg.nproc`` workers per node."""
    nnodes = f"{cfg.min_nnodes}:{cfg.nnodes}" if cfg.elastic else str(cfg.nnodes)
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}",
           f"--nnodes={nnodes}", f"--max-restarts={cfg.max_restarts}"]
    if cfg.rdzv_endpoint:
        host, port = split_endpoint(cfg.rdzv_endpoint)
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={cfg.rdzv_id}"]
        conf = rdzv_conf(cfg.rdzv_conf, host)
        if conf:
            cmd.append(f"--rdzv-conf={conf}")
        local = cfg.local_addr or route_address(host, port)
        if local:   # the address the other machines reach this one at (torchrun: its host name)
            cmd.append(f"--local-addr={local}")
    elif cfg.master_addr:
        cmd += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                f"--master-port={cfg.master_port}"]
    else:
        # One machine: torchrun picks a free port on localhost itself.
        cmd += ["--standalone"]
    return cmd + ["-m", "scaleloop", *argv]


def supervised_command(cfg: TrainConfig, worker: Sequence[str], logs: Path, launch_id: str,
                       python: str = sys.executable) -> list[str]:
    """What the launcher runs: the same torchrun, quiet, with error files and per-rank logs in ``logs``.

    torchrun's own messages go to ``logs/torchrun.log`` (``scaleloop.launching.agent``), its error
    files under ``logs/torchrun/<launch_id>/`` (``--log-dir``), and each worker, started through
    ``scaleloop.launching.worker``, runs ``python -m <worker...>`` with its output in
    ``logs/rank-<R>.log``. ``scaleloop.launching.failures`` reads them when a worker fails.
    """
    plain = torchrun_command(cfg, [], python)
    torchrun_args = plain[3:-2]  # between "python -m torch.distributed.run" and "-m scaleloop"
    return [python, "-m", "scaleloop.launching.agent", str(logs / AGENT_LOG), *torchrun_args,
            f"--log-dir={logs / ELASTIC_DIR / launch_id}",
            "-m", "scaleloop.launching.worker", str(logs), *worker]


# NCCL's flight recorder: on a collective's timeout each rank dumps its last collectives (which
# op, which ranks joined, their Python stacks) to <prefix><rank>, to be read with torch's
# fr_trace tool. These names hold from torch 2.9 on (TORCH_NCCL_TRACE_BUFFER_SIZE and
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE before; still read, with a deprecation warning).
FLIGHT_RECORDER_PREFIX = "nccl-trace-rank-"


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether the workers will run on CUDA (and so talk over NCCL)."""
    if cfg.backend == "nccl" or cfg.device.startswith("cuda"):
        return True
    if cfg.device != "auto" or cfg.backend == "gloo":
        return False
    import torch

    return torch.cuda.is_available()


def flight_recorder_env(logs: Path) -> dict[str, str]:
    """The variables that turn NCCL's flight recorder on, dumping into ``logs`` on a timeout."""
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(logs / FLIGHT_RECORDER_PREFIX)}


def workers_env(cfg: TrainConfig, logs: Path, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment torchrun and its workers get: this one, plus (on CUDA) the flight recorder's
    variables where the user has not set them."""
    env = dict(os.environ if environ is None else environ)
    # torchrun forwards these to its workers (SIGUSR1: the launcher's stop request, see
    # run_under_torchrun), and waits this long for them to write their checkpoint and end
    # before SIGKILL. Set as torchrun's own variables: the flags are not in every torch >= 2.11.
    signals = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                      signal_number(cfg.signal).name]))
    for key in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        env.setdefault(key, signals)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    if cfg.rdzv_endpoint:
        # With the store shared between the agents and the workers (torch's default), a machine
        # that is not the new rank 0 after rank 0's machine is lost keeps the dead machine's store
        # address, and the restarted group cannot form. Unshared, each round's rank 0 hosts a fresh one.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if uses_cuda(cfg):
        for key, value in flight_recorder_env(logs).items():
            env.setdefault(key, value)
    return env


def run_under_torchrun(cfg: TrainConfig, argv: Sequence[str], logs: Path, launch_id: str) -> int:
    """Run the workers and wait; returns torchrun's exit code (0 when every worker succeeded).

    Prints the plain torchrun command this amounts to; runs it supervised (:func:`supervised_command`).
    """
    print(f"scaleloop: launching {cfg.nproc} process(es) x {cfg.nnodes} node(s) with torchrun:\n  "
          + " ".join(shlex.quote(c) for c in torchrun_command(cfg, argv)), flush=True)
    logs.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(supervised_command(cfg, ["scaleloop.cli", *argv], logs, launch_id),
                            env=workers_env(cfg, logs))
    # A stop signal (SIGTERM, SIGUSR1, --signal) is not this process's end: torchrun passes it
    # on as SIGUSR1, the workers finish their step and checkpoint, and the run ends in one line.
    preempt.listen(preempt.stop_signals(cfg.signal, torchrun_worker=False, slurm=False),
                   on_signal=lambda _sig: _forward(proc, signal.SIGUSR1))
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The terminal sent SIGINT to torchrun too; let it stop its workers, then report the
        # interruption (not a worker failure).
        proc.wait()
        raise
    if preempt.requested() is not None and code != 0:  # 0: the run ended before the signal
        raise preempt.Preempted(_stopped_line(cfg, logs.parent))
    return code


def _forward(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:  # torchrun has ended already
        pass


def _stopped_line(cfg: TrainConfig, run_dir: Path) -> str:
    """What the launcher says after a stop signal: the newest checkpoint and how to continue."""
    from scaleloop.checkpoint.store import CHECKPOINTS_DIR, newest_valid

    received = preempt.signal_name(preempt.requested() or signal.SIGTERM)
    found = newest_valid(run_dir / CHECKPOINTS_DIR, warn=lambda _msg: None)
    if found is None:
        return f"stopped by {received}; no checkpoint was written: a new run starts over"
    where = " (on every machine, with its own --node-rank)" if cfg.nnodes > 1 else ""
    return (f"stopped by {received} after step {found.step}; checkpoint {found.path} written; "
            f"continue with: {preempt.continue_command(str(run_dir))}{where}")
