"""Two nodes, each its own network namespace, joined with --nnodes/--node-rank/--master-addr; and
two nodes on loopback, each its own run directory (``--shared-fs no``), read by ``scaleloop doctor``
on each machine after a failure and the continue that finishes it."""
from __future__ import annotations

import re

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from netns import can_make_namespaces, two_hosts
from procs import SRC, child_env, kill_group, run, scaleloop

from scaleloop.commands.doctor import diagnose, format_diagnosis

SCRIPTS = Path(__file__).resolve().parent / "scripts"

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
    # Global rank 0 writes the final weights; the other machine, which does not see its run directory,
    # keeps a copy, and its own directory reads as the finished run it is.
    assert (tmp_path / "node1" / "model.pt").read_bytes() == (tmp_path / "node0" / "model.pt").read_bytes()
    assert diagnose(tmp_path / "node1").what == "finished after 5 step(s)"
    assert max((single[k] - multi[k]).abs().max().item() for k in single) <= 1e-5


def two_machines(tmp_path: Path, *argv: str) -> list[subprocess.CompletedProcess]:
    """``scaleloop train ARGV`` on two "machines" of this host at once (loopback), each with its own
    run directory ``machine<I>`` (``{out}`` in ``argv``) and node rank (``{rank}``); each one's outcome
    (its output and standard error together). Both are forks of one request of the tests' fork server
    (forkgroup.py, as the pods of test_kubernetes.py), not of a second server (a fresh interpreter of
    its own): the request ends once both machines have ended."""
    env = child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "OMP_NUM_THREADS": "1"})
    commands = [[sys.executable, "-m", "scaleloop",
                 *(a.replace("{out}", str(tmp_path / f"machine{i}")).replace("{rank}", str(i)) for a in argv)]
                for i in (0, 1)]
    tag = len(list(tmp_path.glob("group-*.json")))
    outputs = [tmp_path / f"group-{tag}-machine{i}.out" for i in (0, 1)]
    spec, codes = tmp_path / f"group-{tag}.json", tmp_path / f"group-{tag}-codes.json"
    spec.write_text(json.dumps({"runs": [{"argv": cmd, "env": env, "cwd": str(tmp_path), "stdout": str(out),
                                          "stderr": str(out)} for cmd, out in zip(commands, outputs)],
                                "codes": str(codes)}), encoding="utf-8")
    group = run([sys.executable, str(Path(__file__).resolve().parent / "forkgroup.py"), str(spec)], cwd=tmp_path,
                timeout=180, merge=True)
    assert group.returncode == 0 and codes.exists(), f"the machines did not run ({group.returncode}):\n{group.stdout}"
    return [subprocess.CompletedProcess(cmd, code, out.read_text(encoding="utf-8", errors="replace"))
            for cmd, code, out in zip(commands, json.loads(codes.read_text()), outputs)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_doctor_reads_each_machines_directory_right_after_a_failure_and_its_continue(tmp_path: Path) -> None:
    # Rank 1 (machine 1's worker) raises at step 3, after the checkpoint of step 2 (copied to machine 1).
    failed = two_machines(tmp_path, "train", "--model", "failing_models:raises", "--epochs", "1",
                          "--batch-size", "64", "--checkpoint-every", "2", "--strategy", "ddp", "--no-progress",
                          "--no-tensorboard", "--nproc", "1", "--nnodes", "2", "--node-rank", "{rank}",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--shared-fs", "no",
                          "--out", "{out}")
    assert all(r.returncode == 1 for r in failed), "\n".join(r.stdout for r in failed)
    assert diagnose(tmp_path / "machine1").state == "failed"
    # The continue stops at step 4, before rank 1's model raises again (its third forward in this process).
    done = two_machines(tmp_path, "train", "--out", "{out}", "--max-steps", "4")
    assert all(r.returncode == 0 for r in done), "\n".join(r.stdout for r in done)

    machine0, machine1 = diagnose(tmp_path / "machine0"), diagnose(tmp_path / "machine1")
    assert machine0.state == machine1.state == "finished", format_diagnosis(machine1)
    assert (tmp_path / "machine1" / "failure.json").exists()   # the failed attempt's, older than the weights
    lines = format_diagnosis(machine1).splitlines()
    assert lines[1:3] == ["what happened: finished after 4 step(s)",
                          "  this is one machine's copy of the run (its machines do not share the run directory): "
                          "its metrics and summary are in rank 0's run directory, on that machine"], lines
    assert lines[-1] == (f"to continue: nothing left to train; to train further: scaleloop train --out "
                         f"{tmp_path / 'machine1'} --max-steps 8   (on each of the 2 nodes, with its --node-rank)")
    assert machine0.what.startswith("finished: 1 epoch(s), 4 step(s), train loss ")
    assert (tmp_path / "machine1" / "model.pt").read_bytes() == (tmp_path / "machine0" / "model.pt").read_bytes()
