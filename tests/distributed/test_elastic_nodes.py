"""Losing a machine, and getting it back: ``--nnodes 2:3`` over three network namespaces.

Three "machines" (namespaces on one bridge, one worker each, Gloo, each its own run directory:
no shared disk) train with ``--nnodes 2:3 --max-restarts 3``; the c10d rendezvous is on machine
2. A fault comes once the first checkpoint copies exist:

- machine 0 (global rank 0, which writes the checkpoints) dies: all its processes killed;
- machine 1's link goes down (the others wait for ``--timeout``, 15 s there);
- a run on machines 1 and 2 gets machine 0 back: the agents restart the group to admit it.

Each run must finish on the machines that are left. Its final weights must equal, bit for bit,
a reference that changes world size at the same step through the ordinary resume path (an
uninterrupted run on the first world size keeps every checkpoint; the one of that step is
resumed with the new world size), and the samples each worker recorded must be exactly the
sampler's: the first attempt's up to the checkpoint, the next attempt's from it, so that every
sample of every epoch is trained once in the run's result. The recovery is reported (output,
``recovery.json``, ``metrics.csv``, ``scaleloop doctor``). Namespaces and processes are always
removed.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch

from forked_launch import FORK_LAUNCH_VAR
from netns import Host, can_make_namespaces, cut, hosts, kill_inside, reconnect
from procs import SRC, ForkedRun, child_env, kill_group, run

from scaleloop.commands.doctor import diagnose, format_diagnosis
from scaleloop.data.sampler import StepSampler

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

reason = can_make_namespaces()
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FORKGROUP = Path(__file__).resolve().parent / "forkgroup.py"
BATCH, EPOCHS, N = 66, 3, 1000          # 66: splits evenly over 2 and 3 (the references need it)
TRAIN = ["train", "--data", "recording_data:build", "--model", "simplenet", "--epochs", str(EPOCHS),
         "--batch-size", str(BATCH), "--optimizer", "sgd", "--lr", "0.05", "--strategy", "ddp",
         "--checkpoint-every", "4", "--keep-checkpoints", "100", "--no-progress", "--no-tensorboard",
         "--log-every", "1"]
ELASTIC = ["--nproc", "1", "--nnodes", "2:3", "--max-restarts", "3",
           # A lost machine is dropped from the rendezvous after 10 missed heartbeats of 1 s (torch's
           # default: 3 of 5 s), and a round closes at once when all 3 machines have joined, else 10 s
           # after the minimum (2) has: the machines the test starts together must all be in the
           # first round. With heartbeats of 1 x 3 s, on the loaded test machine (in CI, and beside the
           # suite's heaviest files), one agent joined after the round had closed, or was dropped
           # from the round it had just joined (the other agent's worker then had world size 1): its
           # rendezvous was slow, mostly torch naming each event with inspect.stack(), which
           # forked_launch.py now spares the forked agents. The margins stay.
           "--rdzv-conf", "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=10"]
RESUMED = re.compile(r"resuming from \S*step-(\d+)")


def env_for(records: Path, host: Host | None = None, delay: str = "0.003") -> dict[str, str]:
    records.mkdir(parents=True, exist_ok=True)
    # One thread everywhere: torchrun gives each of several workers on a machine one thread, and a
    # machine's only worker all its cores; a different thread count can round a reduction
    # differently, and the runs compared here (2-3 loopback workers, 1 per "machine") must not.
    extra = {"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "RECORD_DIR": str(records),
             "RECORD_DELAY": delay, "OMP_NUM_THREADS": "1"}
    if host is not None:
        extra["GLOO_SOCKET_IFNAME"] = host.interface
    return child_env(extra)


def recorded(records: Path, rank: int, restart: int | None = None) -> list[int]:
    """What a machine's worker loaded as ``rank`` (in attempt ``restart``; None: in every attempt
    it had that rank). The restart count is each agent's own: one that only stopped its worker to
    admit a machine counts none, one whose worker failed first counts one."""
    pattern = f"rank{rank}-restart{'*' if restart is None else restart}.txt"
    paths = sorted(records.glob(pattern), key=lambda p: int(p.stem.rpartition("restart")[2]))
    return [int(line) for path in paths for line in path.read_text().split()]


def sampled(world: int, rank: int, from_step: int = 0, to_step: int | None = None) -> list[int]:
    """The indices ``rank`` of ``world`` loads from global step ``from_step`` up to ``to_step``."""
    sampler = StepSampler(N, BATCH, world_size=world, rank=rank, seed=0)
    out: list[int] = []
    for epoch in range(EPOCHS):
        for mb in sampler.micro_batches(epoch, max(0, from_step - epoch * sampler.steps_per_epoch)):
            if to_step is not None and epoch * sampler.steps_per_epoch + mb.step >= to_step:
                return out
            out += mb.indices.tolist()
    return out


def assert_attempts(records: Path, before: int, after: int, step: int, first: tuple[int, int | None],
                    second: tuple[int, int | None]) -> None:
    """A machine's worker loaded, as ``first`` (rank, restart) of ``before``, the sampler's indices up to ``step``
    (and maybe more, trained again), then as ``second`` of ``after`` exactly the sampler's from it."""
    loaded, resumed = recorded(records, *first), recorded(records, *second)
    done = sampled(before, first[0], 0, step)
    assert loaded[:len(done)] == done, f"{records.name}: the attempt before the fault is off the sampler's order"
    assert resumed == sampled(after, second[0], step), f"{records.name}: the new group did not continue exactly"


def assert_every_sample_once(before: int, after: int, step: int) -> None:
    """World ``before`` up to ``step``, then ``after``: every epoch trains each sample exactly once."""
    per_epoch = StepSampler(N, BATCH, world_size=before, seed=0).steps_per_epoch
    for epoch in range(EPOCHS):
        lo, hi = epoch * per_epoch, (epoch + 1) * per_epoch
        got: list[int] = []
        for world, a, b in ((before, lo, min(hi, step)), (after, max(lo, step), hi)):
            if a < b:
                got += [i for r in range(world) for i in sampled(world, r, a, b)]
        assert sorted(got) == list(range(N)), f"epoch {epoch + 1}: samples skipped or repeated"


class Cluster:
    """Three machines' launchers, each in its namespace with its own run and record directories.

    The machines are forks of one request of the tests' fork server (``forkgroup.py``), each of
    which joins its namespace as ``ip netns exec`` would; their torchrun agents and workers are forks
    too (``forked_launch.py``). Fresh interpreters, as users start them, took this file's runs 95
    CPU-seconds; the launch of several machines that way is tested fresh in
    tests/distributed/test_users_launch.py and by the shared run directory below."""

    def __init__(self, base: Path, machines: list[Host]) -> None:
        self.base, self.machines = base, machines
        self.group: ForkedRun | None = None
        self.endpoint = f"{machines[2].address}:29400"

    def machine(self, i: int, *, delay: str | None = None, hold: str | None = None,
                after: Sequence[Path] = (), timeout: int = 60) -> dict:
        """Machine ``i``'s launcher, as a request of ``forkgroup.py``. ``delay``: RECORD_DELAY (s per
        sample); ``hold``: RECORD_HOLD (``W:K``, see scripts/recording_data.py); ``after``: it starts
        once those paths exist; ``timeout``: ``--timeout``, how long a collective waits for a peer.
        Only the test of a link cut waits for it to pass; elsewhere it is long, so that a worker slowed
        on a loaded machine is not taken for a lost one (a second recovery the reference lacks)."""
        host = self.machines[i]
        extra = {"RECORD_HOLD": hold} if hold else {}
        out = str(self.base / f"out{i}.txt")
        return {"argv": [sys.executable, "-m", "scaleloop", *TRAIN, *ELASTIC, "--timeout", str(timeout),
                         "--rdzv-endpoint", self.endpoint, "--out", str(self.run_dir(i))],
                "env": {**env_for(self.records(i), host, **({"delay": delay} if delay else {})), **extra},
                "cwd": str(self.base), "stdout": out, "stderr": out, "netns": host.namespace,
                "code": str(self.code_file(i)), "after": [str(path) for path in after]}

    def start(self, *machines: dict) -> None:
        """The launchers of ``machines`` (:meth:`machine`), in that order, in the background."""
        spec = self.base / "machines.json"
        spec.write_text(json.dumps({"runs": list(machines), "codes": str(self.base / "codes.json")}), encoding="utf-8")
        self.group = ForkedRun([sys.executable, str(FORKGROUP), str(spec)], cwd=self.base, env=child_env(),
                               timeout=600, merge=True)

    def run_dir(self, i: int) -> Path:
        return self.base / f"machine{i}"

    def records(self, i: int) -> Path:
        return self.base / f"records{i}"

    def code_file(self, i: int) -> Path:
        return self.base / f"code{i}"

    def checkpoint(self, i: int, step: int) -> Path:
        return self.run_dir(i) / "checkpoints" / f"step-{step:08d}"

    def output(self, i: int) -> str:
        path = self.base / f"out{i}.txt"
        return path.read_text() if path.exists() else ""

    def ended(self) -> dict[int, int]:
        """The machines that have ended, with their exit codes."""
        return {i: int(self.code_file(i).read_text()) for i in range(len(self.machines)) if self.code_file(i).exists()}

    def wait_for_checkpoint(self, i: int, step: int, timeout: float = 150) -> None:
        path = self.checkpoint(i, step)
        deadline = time.monotonic() + timeout
        while not path.exists():
            ended = self.ended()
            assert not ended, f"machines ended before {path} appeared: {ended}\n" + self.output(i)
            assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s\n" + self.output(i)
            time.sleep(0.02)

    def wait(self, i: int, timeout: float = 200) -> int:
        """Machine ``i``'s exit code, once it has ended."""
        deadline = time.monotonic() + timeout
        while not self.code_file(i).exists():
            if self.group is not None and self.group.poll() is not None:
                pytest.fail(f"the machines' group ended ({self.group.returncode}) without machine {i}:\n"
                            + self.group.communicate()[0] + self.output(i))
            if time.monotonic() > deadline:
                pytest.fail(f"machine {i} did not end in {timeout} s:\n{self.output(i)}")
            time.sleep(0.02)
        return int(self.code_file(i).read_text())

    def stop_all(self) -> None:
        if self.group is not None:
            kill_group(self.group)
        for host in self.machines:
            kill_inside(host.namespace)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with hosts(f"se{os.getpid() % 10000}", 3) as machines:
        c = Cluster(tmp_path, machines)
        try:
            yield c
        finally:
            c.stop_all()


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Uninterrupted runs on 3 and on 2 processes (loopback), every checkpoint kept."""
    base = tmp_path_factory.mktemp("elastic-nodes")
    found = {}
    for world in (3, 2):
        res = run([sys.executable, "-m", "scaleloop", *TRAIN, "--nproc", str(world), "--out", str(base / f"w{world}")],
                  cwd=base, env=env_for(base / f"records-w{world}", delay="0"), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        found[world] = base / f"w{world}"
    return found


def continued(reference: Path, step: int, world: int) -> dict[str, torch.Tensor]:
    """The reference's weights had it changed to ``world`` processes at ``step`` (a plain resume)."""
    out = reference.parent / f"{reference.name}-step{step}-w{world}"
    if not (out / "model.pt").exists():
        res = run([sys.executable, "-m", "scaleloop", *TRAIN, "--nproc", str(world), "--resume",
                   str(reference / "checkpoints" / f"step-{step:08d}"), "--out", str(out)],
                  cwd=reference.parent, env=env_for(reference.parent / f"records-{out.name}", delay="0"), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    return torch.load(out / "model.pt", weights_only=True)


def resumed_once(output: str) -> int:
    """The step the machine's one recovery resumed from (a second one, say a worker slowed past the
    timeout, is not what the reference did: its output says why)."""
    steps = RESUMED.findall(output)
    assert len(steps) == 1, f"resumed {len(steps)} times, not once:\n{output}"
    return int(steps[0])


def assert_same_weights(expected: dict[str, torch.Tensor], model: Path) -> None:
    final = torch.load(model, weights_only=True)
    for key in expected:
        assert torch.equal(expected[key], final[key]), f"{key} differs from the reference"


def assert_recovery_reported(run_dir: Path, output: str, world_before: int, world_after: int, step: int) -> None:
    assert re.search(rf"scaleloop: recovered \(torchrun's restart 1 of \d+\): "
                     rf".*a new group of {world_after} process\(es\) \(was {world_before}\)"
                     rf".*resumed from step {step}, first step done", output), output
    entries = json.loads((run_dir / "recovery.json").read_text())
    assert len(entries) == 1 and entries[0]["world_after"] == world_after
    phases = [entries[0][phase] for phase in ("noticed_s", "new_group_s", "first_step_s")]
    assert all(t >= 0 for t in phases) and entries[0]["total_s"] >= max(phases), entries[0]
    rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines() if line.startswith("recovery,")]
    assert len(rows) == 1, "one recovery row in metrics.csv"
    doctor = run([sys.executable, "-m", "scaleloop", "doctor", str(run_dir)], cwd=run_dir, timeout=60)
    assert doctor.returncode == 0 and "recovered (torchrun's restart 1 of " in doctor.stdout, doctor.stdout + doctor.stderr


def assert_a_finished_copy(machine: Path, rank0: Path) -> None:
    """A machine that finished the run beside rank 0's keeps the final weights too, and its own run
    directory reads as the finished run (not "stopped without finishing")."""
    assert (machine / "model.pt").read_bytes() == (rank0 / "model.pt").read_bytes()
    told = diagnose(machine)
    assert told.state == "finished" and told.what.startswith("finished after "), format_diagnosis(told)


@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_machine_zero_dies_and_the_others_finish_from_their_copies(cluster: Cluster, references: dict[int, Path]) -> None:
    cluster.start(*(cluster.machine(i) for i in range(3)))
    cluster.wait_for_checkpoint(1, 8)       # machine 1's copy of step 8 (rank 0 wrote its own first)
    killed = kill_inside(cluster.machines[0].namespace)
    assert killed, "machine 0 had no processes to kill"
    assert cluster.wait(1) == 0, cluster.output(1)
    assert cluster.wait(2) == 0, cluster.output(2)

    # Machine 1 is the new rank 0 (the rendezvous orders machines by address): it resumed from
    # its own copy of the newest checkpoint, on 2 processes, and wrote the final weights.
    out = cluster.output(1)
    step = resumed_once(out)
    assert step >= 8 and "checkpoints: the machines do not share the run directory" in out
    assert_same_weights(continued(references[3], step, 2), cluster.run_dir(1) / "model.pt")
    assert_recovery_reported(cluster.run_dir(1), out, 3, 2, step)
    assert "rank 0 of 3 stopped answering" in out
    assert_a_finished_copy(cluster.run_dir(2), cluster.run_dir(1))

    # Samples: machine 1 was rank 1 of 3, then rank 0 of 2; machine 2 rank 2 of 3, then rank 1 of 2.
    assert_attempts(cluster.records(1), 3, 2, step, (1, None), (0, None))
    assert_attempts(cluster.records(2), 3, 2, step, (2, None), (1, None))
    assert_every_sample_once(3, 2, step)


@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_machine_cut_off_and_the_others_finish(cluster: Cluster, references: dict[int, Path]) -> None:
    cluster.start(*(cluster.machine(i, timeout=15) for i in range(3)))
    cluster.wait_for_checkpoint(1, 8)
    cut(cluster.machines[1])
    assert cluster.wait(0) == 0, cluster.output(0)
    # The machine cut off cannot be told; once its link is back, it and the rendezvous host end.
    reconnect(cluster.machines[1])
    cluster.wait(2, timeout=120)
    cluster.wait(1, timeout=120)

    out = cluster.output(0)
    step = resumed_once(out)
    assert step >= 8
    assert_same_weights(continued(references[3], step, 2), cluster.run_dir(0) / "model.pt")
    assert_recovery_reported(cluster.run_dir(0), out, 3, 2, step)
    assert "rank 1 of 3 stopped answering: the others' collective timed out" in out
    assert_a_finished_copy(cluster.run_dir(2), cluster.run_dir(0))
    # Both survivors' workers failed (timed out), so each agent counted one restart.
    assert_attempts(cluster.records(0), 3, 2, step, (0, 0), (0, 1))
    assert_attempts(cluster.records(2), 3, 2, step, (2, 0), (1, 1))
    assert_every_sample_once(3, 2, step)


@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_a_machine_comes_back_and_joins_at_the_next_restart(cluster: Cluster, references: dict[int, Path]) -> None:
    # A run of 2 machines (the minimum) trains 9 steps (33 samples a step each) and waits there,
    # with its step-8 checkpoint written, until machine 0 joins and the group restarts with 3.
    # Machine 0 comes (back) once both wait there (a machine that joined in the middle of a step
    # found one of the two agents 20 s late to restart its group, on a loaded machine).
    cluster.start(*(cluster.machine(i, delay="0", hold=f"2:{9 * BATCH // 2}") for i in (1, 2)),
                  cluster.machine(0, delay="0", after=[cluster.records(1) / "holding", cluster.records(2) / "holding",
                                                       cluster.checkpoint(1, 8)]))
    assert cluster.wait(0) == 0, cluster.output(0)
    assert cluster.wait(1) == 0, cluster.output(1)
    assert cluster.wait(2) == 0, cluster.output(2)

    # Machine 0 (rank 0 of the new group) holds no checkpoint: the newest, on machine 1, was sent.
    out = cluster.output(0)
    step = resumed_once(out)
    assert step >= 8 and re.search(r"^  world size +3$", out, re.M), out
    assert "the copy on rank 1's machine" in out
    assert_same_weights(continued(references[2], step, 3), cluster.run_dir(0) / "model.pt")
    # Machine 1 was rank 0 of 2, then rank 1 of 3; machine 2 rank 1 of 2, then rank 2 of 3; the
    # agents restart the group for a joining machine without counting a restart.
    assert_attempts(cluster.records(1), 2, 3, step, (0, None), (1, None))
    assert_attempts(cluster.records(2), 2, 3, step, (1, None), (2, None))
    assert recorded(cluster.records(0), 0) == sampled(3, 0, step)
    assert_every_sample_once(2, 3, step)


@pytest.mark.skipif(reason is not None, reason=reason or "")
def test_a_shared_run_directory_is_detected_and_holds_one_copy(tmp_path: Path) -> None:
    """Two machines given the same --out (one file system): found shared, nothing copied.

    Both launchers run to their end at once (a rendezvous of exactly 2): forks of one request of
    the tests' fork server, each in its machine's namespace (forkgroup.py, as ``ip netns exec``
    puts a command there); the torchrun agent each starts, and its worker, fresh interpreters, as
    on users' machines (SCALELOOP_TEST_FORK_LAUNCH=0)."""
    with hosts(f"sf{os.getpid() % 10000}", 2) as machines:
        outs = [tmp_path / f"out{i}.txt" for i in (0, 1)]
        spec, codes = tmp_path / "machines.json", tmp_path / "codes.json"
        spec.write_text(json.dumps({"codes": str(codes), "runs": [
            {"argv": [sys.executable, "-m", "scaleloop", *TRAIN, "--epochs", "1", "--nproc", "1", "--nnodes", "2",
                      "--timeout", "60", "--rdzv-endpoint", f"{machines[0].address}:29400",
                      "--out", str(tmp_path / "shared")],
             "env": {**env_for(tmp_path / f"records{i}", host, delay="0"), FORK_LAUNCH_VAR: "0"},
             "cwd": str(tmp_path), "stdout": str(outs[i]), "stderr": str(outs[i]), "netns": host.namespace}
            for i, host in enumerate(machines)]}), encoding="utf-8")
        try:
            group = run([sys.executable, str(Path(__file__).resolve().parent / "forkgroup.py"), str(spec)],
                        cwd=tmp_path, timeout=180, merge=True)
        finally:
            for host in machines:
                kill_inside(host.namespace)
        outputs = [out.read_text() if out.exists() else "" for out in outs]
    assert group.returncode == 0 and codes.exists() and json.loads(codes.read_text()) == [0, 0], (
        group.stdout + "\n".join(outputs))
    said = "\n".join(outputs)
    assert "every machine sees the run directory (a shared file system): one copy" in said, said
    assert "keeps a verified copy" not in said
    assert not list((tmp_path / "shared").glob(".scaleloop-shared-fs-*")), "the probe file is removed"
    assert (tmp_path / "shared" / "model.pt").exists()
