"""Replica groups under torchft (``--replica-groups 2``): a lost group, and the others go on.

Without a fault, two groups of one process, started one by one as on machines of their own (the
lighthouse, then ``--replica-group I --lighthouse HOST:PORT`` for each), train what ``--nproc 2
--strategy ddp`` trains: each group's samples are that DDP rank's, and the weights agree to within
1e-6 of the largest weight. The one-command form (``--replica-groups 2 --nproc 2``) runs the rest:
SIGKILL of group 1's worker inside step 3: group 0 takes step 3 again and trains on alone (one
process, never restarted), group 1 is restarted by its own torchrun, takes group 0's state and
rejoins at a step boundary; both end with the same weights, no step is lost (every step committed),
and every step's samples are trained once by a group present or recorded as not trained
(``replica-steps.jsonl``). docs/fault-tolerance.md.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from listening import listening
from procs import SERVER, SRC, ForkedRun, ForkServer, child_env, kill_group, owned_pids, run
from scaleloop.data.sampler import StepSampler
from scaleloop.launching.lighthouse import free_port_pair

import torchft  # noqa: F401,E402  (the dev extras install it: missing, this file fails)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BATCH, N, STEPS = 64, 1000, 16
COMMON = ["train", "--data", "replica_data:build", "--model", "simplenet", "--epochs", "1", "--batch-size", str(BATCH),
          "--optimizer", "sgd", "--lr", "0.05", "--strategy", "ddp", "--no-progress", "--no-tensorboard",
          "--log-every", "1"]
ARGS = [*COMMON, "--nproc", "2"]


# The lighthouse's line for each quorum request of group 1 (torchft 0.2.0's lighthouse log).
ASKED = "Received quorum request for replica group1:"


def env_for(records: Path, **extra: str) -> dict[str, str]:
    records.mkdir()
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)]), "RECORD_DIR": str(records), **extra})


def recorded(records: Path, tag: str) -> list[int]:
    path = records / f"{tag}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def shares(rank: int, steps: range, world: int = 2) -> list[int]:
    """The samples data rank ``rank`` of ``world`` trains in ``steps`` (1-based), by the sampler."""
    sampler = StepSampler(N, BATCH, world_size=world, rank=rank, seed=0)
    return [i for mb in sampler.micro_batches(0, 0) if mb.step + 1 in steps for i in mb.indices.tolist()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--nproc 2 --strategy ddp``, the same run without replica groups."""
    base = tmp_path_factory.mktemp("ft-ddp")
    res = run([sys.executable, "-m", "scaleloop", *ARGS, "--out", str(base / "run")], cwd=base,
              env=env_for(base / "records"))
    assert res.returncode == 0, res.stdout + res.stderr
    return base / "run"


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--nproc 4 --strategy ddp``: what two groups of two processes train together."""
    base = tmp_path_factory.mktemp("ft-ddp4")
    res = run([sys.executable, "-m", "scaleloop", *COMMON, "--nproc", "4", "--out", str(base / "run")], cwd=base,
              env=env_for(base / "records"), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return base / "run"


def start_lighthouse(tmp_path: Path, env: dict[str, str]) -> tuple["subprocess.Popen[str]", str]:
    """``python -m scaleloop.launching.lighthouse --replica-groups 2 --port P``, as on a machine of its
    own; the process and its ``HOST:PORT`` once it listens."""
    port = free_port_pair()
    # Its messages (torchft's log) apart from its lines: a log line would cut into the line read here.
    with open(tmp_path / "lighthouse.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scaleloop.launching.lighthouse", "--replica-groups", "2",
                                 "--port", str(port), "--host", "localhost"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith("lighthouse listening at "), f"the lighthouse did not start: {line!r}"
    return proc, line.split()[-1]


def test_without_a_fault_groups_started_one_by_one_train_what_ddp_trains(
        tmp_path: Path, ddp: Path, second_server: ForkServer) -> None:
    """The form for several machines: the lighthouse, then each group, as commands of their own."""
    records = tmp_path / "records"
    env = env_for(records)
    lighthouse, endpoint = start_lighthouse(tmp_path, env)
    commands = [[sys.executable, "-m", "scaleloop", *COMMON, "--nproc", "1", "--replica-groups", "2", "--replica-group", str(group),
                 "--lighthouse", endpoint, "--out", str(tmp_path / "run" / f"group-{group}")] for group in (0, 1)]
    try:
        # Each run's session is ended after it, not every process of the test (the other group's would go too).
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(server.run, cmd, cwd=tmp_path, timeout=180, env=env, merge=True, sweep=False)
                    for server, cmd in zip((SERVER, second_server), commands)]
            results = [r.result() for r in runs]
        lighthouse.terminate()
        said, _ = lighthouse.communicate(timeout=30)
    finally:
        kill_group(lighthouse)
    for group, res in enumerate(results):
        assert res.returncode == 0, f"group {group}:\n{res.stdout}"
    assert "lighthouse stopped by SIGTERM" in said, said
    reference, largest = weights(ddp), max(w.abs().max().item() for w in weights(ddp).values())
    for group in (0, 1):
        final = weights(tmp_path / "run" / f"group-{group}")
        for key, w in reference.items():
            assert (final[key] - w).abs().max().item() <= 1e-6 * largest, f"group {group}: {key} differs from ddp"
        # The data rule, all groups present: group g trains DDP rank g's share of every step.
        assert recorded(records, f"group{group}-rank0-restart0") == shares(group, range(1, STEPS + 1))
    assert not (tmp_path / "run" / "group-0" / "replica-steps.jsonl").exists()


def test_a_killed_group_rejoins_from_a_live_one_while_the_other_trains_on(tmp_path: Path) -> None:
    records = tmp_path / "records"
    # Group 1 stops inside step 3 (after its quorum) and is killed there: group 0's step 3 fails. The
    # restarted group 1 waits until group 0 has trained step 3 again alone; group 0 waits after step 8
    # until group 1 is back: the rejoin is inside the run on any machine's speed.
    env = env_for(records, RECORD_DELAY="0.005", REPLICA_HOLD=f"0:{8 * BATCH // 2}", REPLICA_STOP_IN="1:3",
                  REPLICA_REJOIN="1")
    command = [arg.replace("simplenet", "replica_data:model") for arg in ARGS]   # (SimpleNet, and the stop)
    proc = subprocess.Popen([sys.executable, "-m", "scaleloop", *command, "--replica-groups", "2",
                             "--max-restarts", "2", "--out", str(tmp_path / "run")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (records / "in-step-3").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "group 1 did not reach step 3"
            time.sleep(0.02)
        lighthouse = tmp_path / "run" / "lighthouse.log"
        asked = lighthouse.read_text().count(ASKED)
        os.kill(int((records / "pid-group1-rank0-restart0").read_text()), signal.SIGKILL)
        short_steps = tmp_path / "run" / "group-0" / "replica-steps.jsonl"
        while not (short_steps.exists() and short_steps.read_text().endswith("\n")):
            assert proc.poll() is None and time.monotonic() < deadline, "group 0 did not take step 3 again"
            time.sleep(0.05)
        (records / "rejoin").touch()
        # Released once the restarted group asks the lighthouse for a quorum (group 0 then joins it).
        while lighthouse.read_text().count(ASKED) <= asked:
            assert proc.poll() is None and time.monotonic() < deadline, "group 1 did not come back"
            time.sleep(0.05)
        (records / "release").touch()
        output, _ = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output
    run_dir = tmp_path / "run"
    # Group 0 went on in its one process: never restarted.
    assert not (records / "pid-group0-rank0-restart1").exists(), output
    # Both groups end with the same weights.
    a, b = weights(run_dir / "group-0"), weights(run_dir / "group-1")
    assert all(torch.equal(a[k], b[k]) for k in a), "the groups' final weights differ"
    # recovery.json, and the console, name the group, the steps it left after and rejoined at.
    [recovery] = json.loads((run_dir / "group-1" / "recovery.json").read_text())
    left, back = recovery["left_after_step"], recovery["rejoined_step"]
    assert recovery["replica_group"] == 1 and left == 2 and 3 < back <= STEPS, recovery
    assert f"replica group 1 left after step {left} and rejoined at step {back}" in output
    # The state group 1 took from group 0 (torchft's HTTP transfer): its request is in group 0's log,
    # not on the console.
    assert "GET /checkpoint" not in output, output
    assert f'"GET /checkpoint/{back - 1}/full HTTP/1.1" 200' in (run_dir / "group-0" / "logs" / "rank-0.log").read_text()
    # The data rule with a group missing: group 0 trained its share of every step; group 1 its share
    # of the steps before the fault and from its return; the steps between are recorded.
    assert recorded(records, "group0-rank0-restart0") == shares(0, range(1, STEPS + 1))
    before = recorded(records, "group1-rank0-restart0")
    assert before == shares(1, range(1, STEPS + 1))[:len(before)]   # (killed inside step 3)
    assert recorded(records, "group1-rank0-restart1") == shares(1, range(back, STEPS + 1))
    short = [json.loads(line) for line in (run_dir / "group-0" / "replica-steps.jsonl").read_text().splitlines()]
    assert [e["step"] for e in short] == list(range(left + 1, back)), short
    # No step lost: step 3, which group 1 died in, was not committed, and group 0 took it again alone;
    # every step is committed, by both groups or, recorded, by group 0 at half the global batch.
    assert re.findall(r"\[group 0\] scaleloop: step (\d+) was not committed: a replica group failed during it; "
                      r"the groups present take it again", output) == ["3"], output
    assert all(e["committed"] and e["groups"] == 1 and e["global_batch"] == BATCH // 2 for e in short), short


def checkpointed(run_dir: Path, step: int) -> bool:
    """Whether every group's newest checkpoint is step ``step`` (``latest`` names it once it is whole)."""
    latest = [run_dir / f"group-{group}" / "checkpoints" / "latest" for group in (0, 1)]
    return all(p.exists() and p.read_text().strip() == f"step-{step:08d}" for p in latest)


def running_lighthouses() -> list[int]:
    """The lighthouses this test session's runs started and that run now."""
    found = []
    for pid in owned_pids():
        try:
            if b"scaleloop.launching.lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:   # ended meanwhile
            continue
    return found


def lighthouse_pid() -> int:
    """The lighthouse this test's run started (the one process of this session that runs it)."""
    [pid] = running_lighthouses()
    return pid


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_lighthouse_of_groups_on_one_machine_listens_on_loopback_only(tmp_path: Path) -> None:
    """``--replica-groups 2 --nproc 2`` starts every group here: its lighthouse and gate listen on
    127.0.0.1 only (the form for several machines, tested above, listens on every interface)."""
    records = tmp_path / "records"
    env = env_for(records, REPLICA_HOLD=f"0:{2 * BATCH // 2}")   # group 0 waits in step 3 until released
    command = [sys.executable, "-m", "scaleloop", *ARGS, "--replica-groups", "2", "--out", str(tmp_path / "run")]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(SERVER.run, command, cwd=tmp_path, timeout=180, env=env, merge=True)
        try:
            deadline, bound = time.monotonic() + 180, set()
            while len(bound) < 2:   # both servers listen before the launcher starts a group
                assert not running.done() and time.monotonic() < deadline, "the lighthouse did not listen"
                time.sleep(0.05)
                bound = listening(set(running_lighthouses()))
        finally:
            (records / "release").touch()
        done = running.result()
    assert done.returncode == 0, done.stdout
    [port] = [int(p) for p in re.findall(r"meeting at the torchft lighthouse 127\.0\.0\.1:(\d+) ", done.stdout)]
    assert bound == {("127.0.0.1", port), ("127.0.0.1", port + 1)}, sorted(bound)


def test_the_lighthouse_lost_ends_the_run_in_one_line_and_the_same_command_continues(tmp_path: Path, ddp: Path) -> None:
    """Nothing can go on without the lighthouse: one line, a non-zero exit; the same command with the
    same --out then continues from each group's newest checkpoint and trains what ddp trains."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "scaleloop", *ARGS, "--replica-groups", "2", "--checkpoint-every", "2",
               "--out", str(run_dir)]
    first = tmp_path / "first"
    # Group 0 waits before step 7 (both groups have the checkpoint of step 6 then) until released.
    env = env_for(first, REPLICA_HOLD=f"0:{6 * BATCH // 2}")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(SERVER.run, command, cwd=tmp_path, timeout=180, env=env, merge=True)
        deadline = time.monotonic() + 180
        while not checkpointed(run_dir, 6):
            assert not running.done() and time.monotonic() < deadline, "no checkpoint of step 6"
            time.sleep(0.05)
        os.kill(lighthouse_pid(), signal.SIGKILL)
        (first / "release").touch()
        stopped = running.result()
    assert stopped.returncode == 1, stopped.stdout
    said = [line for line in stopped.stdout.splitlines() if not line.startswith("[group ")]
    assert said[-2:] == [
        "scaleloop: the torchft lighthouse ended while the groups trained: they cannot meet; stopping them",
        "scaleloop: the torchft lighthouse ended: the replica groups cannot meet; continue from the last checkpoints "
        f"with: scaleloop train --replica-groups 2 --nproc 2 --out {run_dir}"], said
    assert "Traceback" not in stopped.stdout
    # The same command again: each group from its checkpoint of step 6, both present, as DDP from there.
    second = tmp_path / "second"
    done = run(command, cwd=tmp_path, env=env_for(second), merge=True, timeout=180)
    assert done.returncode == 0, done.stdout
    reference, largest = weights(ddp), max(w.abs().max().item() for w in weights(ddp).values())
    for group in (0, 1):
        assert f"[group {group}] resuming from {run_dir / f'group-{group}' / 'checkpoints' / 'step-00000006'}" in done.stdout
        final = weights(run_dir / f"group-{group}")
        for key, w in reference.items():
            assert (final[key] - w).abs().max().item() <= 1e-6 * largest, f"group {group}: {key} differs from ddp"
        # The data rule across the two runs: steps 7 to the end once each, by the group whose share it is.
        assert recorded(second, f"group{group}-rank0-restart0") == shares(group, range(7, STEPS + 1))


def test_every_group_lost_ends_the_run_in_one_line_and_the_line_continues_it(tmp_path: Path, ddp: Path) -> None:
    """Both groups' workers killed (``--max-restarts 0``: none restarts): one line, a non-zero exit, no
    traceback; each group's report names the job's command, not its own; the command the line gives
    (not the whole first command: the job's settings are in its directory) continues from each
    group's newest checkpoint and trains what ddp trains."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "scaleloop", *ARGS, "--replica-groups", "2", "--checkpoint-every", "2",
               "--max-restarts", "0", "--out", str(run_dir)]
    first = tmp_path / "first"
    # Group 0 waits before step 7 (both groups have the checkpoint of step 6 then) until released.
    env = env_for(first, REPLICA_HOLD=f"0:{6 * BATCH // 2}")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(SERVER.run, command, cwd=tmp_path, timeout=180, env=env, merge=True)
        try:
            deadline = time.monotonic() + 180
            while not checkpointed(run_dir, 6):
                assert not running.done() and time.monotonic() < deadline, "no checkpoint of step 6"
                time.sleep(0.05)
            for group in (1, 0):
                os.kill(int((first / f"pid-group{group}-rank0-restart0").read_text()), signal.SIGKILL)
        finally:
            (first / "release").touch()
        stopped = running.result()
    assert stopped.returncode == 1, stopped.stdout
    assert "Traceback" not in stopped.stdout
    continue_job = f"scaleloop train --replica-groups 2 --nproc 2 --out {run_dir}"
    said = [line for line in stopped.stdout.splitlines() if not line.startswith("[group ")]
    assert said[-1] == ("scaleloop: every replica group failed (exit codes 1, 1): nothing can go on; continue from "
                        f"the last checkpoints with: {continue_job}"), said
    assert not [line for line in said[3:-1] if line.startswith("scaleloop: ")], said   # the only line after the start
    for group in (0, 1):
        assert f"[group {group}] scaleloop: error: rank 0 was killed by SIGKILL" in stopped.stdout
        # Not `scaleloop train --out run/group-I`: that group alone would wait for a lighthouse that is gone.
        assert (f"[group {group}]   once fixed, continue the whole job (every replica group) with: {continue_job}"
                in stopped.stdout), stopped.stdout
    # The line's command: each group from its checkpoint of step 6, both present, as DDP from there.
    second = tmp_path / "second"
    done = run([sys.executable, "-m", "scaleloop", *continue_job.split()[1:]], cwd=tmp_path, env=env_for(second),
               merge=True, timeout=180)
    assert done.returncode == 0, done.stdout
    reference, largest = weights(ddp), max(w.abs().max().item() for w in weights(ddp).values())
    for group in (0, 1):
        assert f"[group {group}] resuming from {run_dir / f'group-{group}' / 'checkpoints' / 'step-00000006'}" in done.stdout
        final = weights(run_dir / f"group-{group}")
        for key, w in reference.items():
            assert (final[key] - w).abs().max().item() <= 1e-6 * largest, f"group {group}: {key} differs from ddp"
        assert recorded(second, f"group{group}-rank0-restart0") == shares(group, range(7, STEPS + 1))


def test_fsdp_inside_groups_of_two_trains_what_ddp_over_all_their_processes_trains(tmp_path: Path, ddp4: Path) -> None:
    """``--replica-groups 2 --nproc 4 --strategy fsdp``: each group shards over its own 2 processes,
    torchft averages each rank's shards with the same rank's of the other group (HSDP, the groups its
    replicas). Without a fault it trains what ``--nproc 4 --strategy ddp`` trains."""
    records = tmp_path / "records"
    command = [arg.replace("ddp", "fsdp") for arg in COMMON]
    res = run([sys.executable, "-m", "scaleloop", *command, "--nproc", "4", "--replica-groups", "2",
               "--out", str(tmp_path / "run")], cwd=tmp_path, env=env_for(records), merge=True, timeout=300)
    assert res.returncode == 0, res.stdout
    for group in (0, 1):
        assert re.search(rf"\[group {group}\] scaleloop: .* fsdp \(.*\) x 2 replica groups \(torchft; this is group "
                         rf"{group}\) x 2 ", res.stdout), res.stdout
    reference, largest = weights(ddp4), max(w.abs().max().item() for w in weights(ddp4).values())
    for group in (0, 1):
        final = weights(tmp_path / "run" / f"group-{group}")
        for key, w in reference.items():
            assert (final[key] - w).abs().max().item() <= 1e-6 * largest, f"group {group}: {key} differs from ddp"
        # The data rule: group g's rank r trains DDP rank 2g + r's share of every step.
        for rank in (0, 1):
            assert recorded(records, f"group{group}-rank{rank}-restart0") == shares(2 * group + rank, range(1, STEPS + 1), 4)


def test_an_fsdp_group_killed_rejoins_with_a_live_groups_shards(tmp_path: Path) -> None:
    """Groups of 2 processes under fsdp, with Adam (state to take): group 1's rank 0 killed inside
    step 3; group 0 trains on, group 1's torchrun restarts both its ranks, each takes the same rank's
    shards of the weights and optimizer state from group 0, and both groups end with the same weights."""
    records = tmp_path / "records"
    per_rank = BATCH // 4
    env = env_for(records, RECORD_DELAY="0.005", REPLICA_HOLD=f"0:{8 * per_rank}", REPLICA_STOP_IN="1:3",
                  REPLICA_REJOIN="1")
    command = [arg.replace("simplenet", "replica_data:model").replace("ddp", "fsdp").replace("sgd", "adam")
               for arg in COMMON]
    # A fork of the tests' fork server, as are the groups' launchers, agents and workers (forked_launch.py);
    # the killed group's restart and rejoin as users start it, fresh: the test above.
    proc = ForkedRun([sys.executable, "-m", "scaleloop", *command, "--nproc", "4", "--replica-groups", "2",
                      "--max-restarts", "2", "--out", str(tmp_path / "run")], cwd=tmp_path, env=env, timeout=300, merge=True)
    try:
        deadline = time.monotonic() + 240
        while not (records / "in-step-3").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "group 1 did not reach step 3"
            time.sleep(0.02)
        lighthouse = tmp_path / "run" / "lighthouse.log"
        asked = lighthouse.read_text().count(ASKED)
        os.kill(int((records / "pid-group1-rank0-restart0").read_text()), signal.SIGKILL)
        short_steps = tmp_path / "run" / "group-0" / "replica-steps.jsonl"
        while not (short_steps.exists() and short_steps.read_text().endswith("\n")):
            assert proc.poll() is None and time.monotonic() < deadline, "group 0 did not take step 3 again"
            time.sleep(0.05)
        (records / "rejoin").touch()
        while lighthouse.read_text().count(ASKED) <= asked:
            assert proc.poll() is None and time.monotonic() < deadline, "group 1 did not come back"
            time.sleep(0.05)
        (records / "release").touch()
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, output
    run_dir = tmp_path / "run"
    assert not (records / "pid-group0-rank0-restart1").exists(), output
    [recovery] = json.loads((run_dir / "group-1" / "recovery.json").read_text())
    back = recovery["rejoined_step"]
    assert recovery["replica_group"] == 1 and recovery["left_after_step"] == 2 and 3 < back <= STEPS, recovery
    a, b = weights(run_dir / "group-0"), weights(run_dir / "group-1")
    assert all(torch.equal(a[k], b[k]) for k in a), "the groups' final weights differ"
    # Each restarted rank trained its own share (2 + r of 4) from the step it rejoined at.
    for rank in (0, 1):
        assert recorded(records, f"group1-rank{rank}-restart1") == shares(2 + rank, range(back, STEPS + 1), 4)
    assert "Traceback" not in output and "GET /checkpoint" not in output
