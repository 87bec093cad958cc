"""Two nodes, each its own network namespace, joined with --nnodes/--node-rank/--master-addr."""
from __future__ import annotations

import re

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from netns import can_make_namespaces, two_hosts
from procs import child_env, kill_group, scaleloop

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

reason = can_make_namespaces()


@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_two_nodes_over_veth_match_one_process(tmp_path: Path) -> None:
    common = ["train", "--data", "random", "--n-samples", "512", "--epochs", "1", "--max-steps", "5",
              "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.1", "--no-progress", "--no-tensorboard"]
    scaleloop([*common, "--out", str(tmp_path / "single")], cwd=tmp_path)

    with two_hosts(f"sl{os.getpid() % 100000}") as (a, b):
        procs = []
        try:
            for rank, host in enumerate((a, b)):
                env = child_env({"GLOO_SOCKET_IFNAME": host.interface})
                cmd = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "scaleloop", *common,
                       "--nnodes", "2", "--node-rank", str(rank), "--nproc", "1", "--strategy", "ddp",
                       "--master-addr", a.address, "--master-port", "29531",
                       "--out", str(tmp_path / f"node{rank}")]
                procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, start_new_session=True))
            outputs = [p.communicate(timeout=180) for p in procs]
        finally:
            for p in procs:
                kill_group(p)
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, f"node failed:\n{out}\n{err}"

    assert re.search(r"^  world size +2$", outputs[0][0], re.M), outputs[0][0]
    single = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    multi = torch.load(tmp_path / "node0" / "model.pt", weights_only=True)
    assert not (tmp_path / "node1" / "model.pt").exists()  # only global rank 0 writes
    assert max((single[k] - multi[k]).abs().max().item() for k in single) <= 1e-5
