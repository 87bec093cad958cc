"""Re-launch ``scaleloop train`` under PyTorch's own launcher (``torch.distributed.run``).

``scaleloop train --nproc 4`` is exactly ``torchrun --nproc-per-node 4 -m scaleloop train ...``:
torchrun starts the workers, sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, runs the
rendezvous, and (with ``--max-restarts``) restarts the whole group when a worker dies.
scaleloop adds no launcher of its own; it only writes the torchrun command for you and prints it.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Sequence

from scaleloop.config import TrainConfig


def torchrun_command(cfg: TrainConfig, argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """The torchrun command line that runs ``scaleloop <argv>`` in ``cfg.nproc`` workers per node."""
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}",
           f"--nnodes={cfg.nnodes}", f"--max-restarts={cfg.max_restarts}"]
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={cfg.rdzv_id}"]
    elif cfg.master_addr:
        cmd += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                f"--master-port={cfg.master_port}"]
    else:
        # One machine: torchrun picks a free port on localhost itself.
        cmd += ["--standalone"]
    return cmd + ["-m", "scaleloop", *argv]


def run_under_torchrun(cfg: TrainConfig, argv: Sequence[str]) -> int:
    """Run the workers and wait; returns torchrun's exit code (0 when every worker succeeded)."""
    cmd = torchrun_command(cfg, argv)
    print(f"scaleloop: launching {cfg.nproc} process(es) x {cfg.nnodes} node(s) with torchrun:\n  "
          + " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The terminal sent SIGINT to torchrun too; let it stop its workers, then report the
        # interruption (not a worker failure).
        proc.wait()
        raise
