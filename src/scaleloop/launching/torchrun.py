"""The torchrun command, built once from structured settings (:class:`WorkerLaunch`).

``scaleloop train --nproc 4`` is exactly ``torchrun --nproc-per-node 4 -m scaleloop train ...``:
torchrun starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, runs the
rendezvous, and (with ``--max-restarts``) restarts the whole group when a worker dies.
scaleloop adds no launcher of its own; it writes the torchrun command for you and prints it
(:meth:`WorkerLaunch.plain_command`), and runs the same settings supervised
(:meth:`WorkerLaunch.supervised_command`, started by ``scaleloop.launching.supervisor``) so that
a failure is reported in a few lines. Train, verify and bench all describe their workers here.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from scaleloop.config import TrainConfig
from scaleloop.launching.failures import AGENT_LOG, ELASTIC_DIR
from scaleloop.runtime.preempt import signal_number
from scaleloop.launching.rendezvous import rdzv_conf, route_address, split_endpoint

# How long torchrun waits, after passing a stop signal on, for its workers to end before SIGKILL:
# a step and a checkpoint. A scheduler's own SIGKILL at the end of its grace period comes first.
SHUTDOWN_TIMEOUT_S = 600

AGENT_MODULE = "scaleloop.launching.agent"
# The NVIDIA driver's control device: present on a machine with an NVIDIA GPU and its driver.
NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"
WORKER_MODULE = "scaleloop.launching.worker"


@dataclass(frozen=True)
class Standalone:
    """One machine: torchrun picks a free port on localhost itself (``--standalone``)."""


@dataclass(frozen=True)
class StaticMaster:
    """A fixed set of machines meeting at node 0's address (``--master-addr/--master-port``)."""

    addr: str
    port: int
    node_rank: int


@dataclass(frozen=True)
class C10dRendezvous:
    """An elastic job's c10d rendezvous, its settings resolved for this machine."""

    endpoint: str
    run_id: str
    conf: str = ""                      # --rdzv-conf, with is_host already decided
    local_addr: Optional[str] = None    # the address the other machines reach this one at


Meeting = Union[Standalone, StaticMaster, C10dRendezvous]


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything that says how a group of workers starts: the one source of its commands.

    ``module`` is what ``python -m`` runs in the plain torchrun command shown to the user;
    ``entry`` (default: ``module``) is the module whose ``main(argv)`` the supervised worker
    (``scaleloop.launching.worker``) calls. ``direct``: one worker, started without torchrun
    (a benchmark's baseline). ``env``: the workers' environment (None: this process's).
    """

    nproc: int
    module: str
    argv: tuple[str, ...] = ()
    logs: Path = Path("logs")
    launch_id: str = "launch"
    nnodes: int = 1
    min_nnodes: Optional[int] = None    # set: an elastic job of min_nnodes..nnodes machines
    max_restarts: int = 0
    meeting: Meeting = field(default_factory=Standalone)
    entry: Optional[str] = None
    direct: bool = False
    env: Optional[Mapping[str, str]] = None
    python: str = sys.executable

    @property
    def error_dir(self) -> Path:
        """torchrun's ``--log-dir`` for this launch, where the workers' error files are."""
        return self.logs / ELASTIC_DIR / self.launch_id

    @property
    def agent_log(self) -> Path:
        """Where torchrun's own messages go."""
        return self.logs / AGENT_LOG

    def torchrun_flags(self) -> list[str]:
        """torchrun's own flags: the processes, the machines, the restarts, where they meet."""
        nnodes = f"{self.min_nnodes}:{self.nnodes}" if self.min_nnodes is not None else str(self.nnodes)
        flags = [f"--nproc-per-node={self.nproc}", f"--nnodes={nnodes}", f"--max-restarts={self.max_restarts}"]
        meeting = self.meeting
        if isinstance(meeting, C10dRendezvous):
            flags += ["--rdzv-backend=c10d", f"--rdzv-endpoint={meeting.endpoint}", f"--rdzv-id={meeting.run_id}"]
            if meeting.conf:
                flags.append(f"--rdzv-conf={meeting.conf}")
            if meeting.local_addr:
                flags.append(f"--local-addr={meeting.local_addr}")
        elif isinstance(meeting, StaticMaster):
            flags += [f"--node-rank={meeting.node_rank}", f"--master-addr={meeting.addr}",
                      f"--master-port={meeting.port}"]
        else:
            flags.append("--standalone")
        return flags

    def plain_command(self) -> list[str]:
        """The command this launch amounts to, as a user would type it (what is printed)."""
        if self.direct:
            return [self.python, "-m", self.module, *self.argv]
        return [self.python, "-m", "torch.distributed.run", *self.torchrun_flags(), "-m", self.module, *self.argv]

    def supervised_command(self) -> list[str]:
        """What runs: the same torchrun, quiet, with error files and per-rank logs in ``logs``.

        torchrun's own messages go to ``logs/torchrun.log`` (``scaleloop.launching.agent``), its
        error files under ``logs/torchrun/<launch_id>/`` (``--log-dir``), and each worker, started
        through ``scaleloop.launching.worker``, runs ``<entry>.main(argv)`` with its output in
        ``logs/rank-<R>.log``. ``scaleloop.launching.failures`` reads them when a worker fails.
        """
        if self.direct:
            return [self.python, *self._worker()]
        return [self.python, "-m", AGENT_MODULE, *self.agent_args()]

    def agent_args(self) -> list[str]:
        """The arguments of ``scaleloop.launching.agent`` (its ``main(argv)``) for this launch."""
        return [str(self.agent_log), *self.torchrun_flags(), f"--log-dir={self.error_dir}", *self._worker()]

    def _worker(self) -> list[str]:
        return ["-m", WORKER_MODULE, str(self.logs), self.entry or self.module, *self.argv]


def meeting_of(cfg: TrainConfig) -> Meeting:
    """Where ``cfg``'s machines meet: its rendezvous, its master address, or this machine alone."""
    if cfg.launch.rdzv_endpoint:
        host, port = split_endpoint(cfg.launch.rdzv_endpoint)
        return C10dRendezvous(cfg.launch.rdzv_endpoint, cfg.launch.rdzv_id, rdzv_conf(cfg.launch.rdzv_conf, host),
                              cfg.launch.local_addr or route_address(host, port))
    if cfg.launch.master_addr:
        return StaticMaster(cfg.launch.master_addr, cfg.launch.master_port, cfg.launch.node_rank)
    return Standalone()


def launch_for(cfg: TrainConfig, module: str, argv: Sequence[str] = (), *, logs: Path = Path("logs"),
               launch_id: str = "launch", entry: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
               python: str = sys.executable) -> WorkerLaunch:
    """The launch of ``cfg``'s workers per node, each running ``module`` with ``argv``."""
    return WorkerLaunch(nproc=cfg.launch.nproc, module=module, argv=tuple(argv), logs=logs, launch_id=launch_id,
                        nnodes=cfg.launch.nnodes, min_nnodes=cfg.launch.min_nnodes if cfg.elastic else None,
                        max_restarts=cfg.launch.max_restarts, meeting=meeting_of(cfg), entry=entry, env=env,
                        python=python)


def torchrun_command(cfg: TrainConfig, argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The torchrun command line that runs ``scaleloop <argv>`` in ``cfg.launch.nproc`` workers per node."""
    return launch_for(cfg, "scaleloop", argv, python=python).plain_command()


# NCCL's flight recorder: on a collective's timeout each rank dumps its last collectives (which
# op, which ranks joined, their Python stacks) to <prefix><rank>, to be read with torch's
# fr_trace tool. These names hold from torch 2.9 on (TORCH_NCCL_TRACE_BUFFER_SIZE and
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE before; still read, with a deprecation warning).
FLIGHT_RECORDER_PREFIX = "nccl-trace-rank-"


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether the workers may run on CUDA (and so talk over NCCL): asked for, or ``--device auto``
    on a machine with an NVIDIA driver. Decided without torch: the launcher does not import it."""
    if cfg.launch.backend == "nccl" or cfg.launch.device.startswith("cuda"):
        return True
    if cfg.launch.device != "auto" or cfg.launch.backend == "gloo":
        return False
    return os.path.exists(NVIDIA_CONTROL_DEVICE)


def flight_recorder_env(logs: Path) -> dict[str, str]:
    """The variables that turn NCCL's flight recorder on, dumping into ``logs`` on a timeout."""
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(logs / FLIGHT_RECORDER_PREFIX)}


def workers_env(cfg: TrainConfig, logs: Path, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment torchrun and its workers get: this one, plus (on CUDA) the flight recorder's
    variables where the user has not set them."""
    env = dict(os.environ if environ is None else environ)
    # torchrun forwards these to its workers (SIGUSR1: the launcher's stop request, see
    # scaleloop.launching.supervisor), and waits this long for them to write their checkpoint and
    # end before SIGKILL. Set as torchrun's own variables: the flags are not in every torch >= 2.11.
    # Not SIGHUP: a closing terminal's SIGHUP reaches the launcher, which passes it on as SIGUSR1
    # (scaleloop.runtime.preempt); torchrun's agent ignores it (scaleloop.launching.agent).
    signals = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGQUIT", "SIGUSR1", signal_number(cfg.launch.signal).name]))
    for key in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        env.setdefault(key, signals)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    if cfg.launch.rdzv_endpoint:
        # With the store shared between the agents and the workers (torch's default), a machine
        # that is not the new rank 0 after rank 0's machine is lost keeps the dead machine's store
        # address, and the restarted group cannot form. Unshared, each round's rank 0 hosts a fresh one.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if cfg.launch.replica_groups > 1 and cfg.launch.replica_group is not None and cfg.launch.lighthouse:
        # torchft's own names for the group's place (torchtitan's workers read them too).
        env.update(REPLICA_GROUP_ID=str(cfg.launch.replica_group), NUM_REPLICA_GROUPS=str(cfg.launch.replica_groups),
                   TORCHFT_LIGHTHOUSE=f"http://{cfg.launch.lighthouse}")
        env.setdefault("RUST_LOG", "warn")   # torchft's manager logs every quorum and commit at info
    if uses_cuda(cfg):
        for key, value in flight_recorder_env(logs).items():
            env.setdefault(key, value)
    return env
