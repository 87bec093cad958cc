"""Recovery records: what a failed attempt leaves, and how the next one times and reports it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from scaleloop.runtime.recovery import (FAULT_PREFIX, Recovery, clear_faults, last_worker_exit, leave_fault,
                                        read_recoveries, take_faults)


def fault(rank: int, t: float, progress: float, **extra) -> dict:
    return {"rank": rank, "time": t, "last_progress": progress, "error_type": "RuntimeError",
            "message": "Connection closed by peer", "communication": True, "timed_out": False, **extra}


def test_faults_are_left_and_taken_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    leave_fault(tmp_path, 1, fault(1, 10.0, 9.0), world_size=3)
    record = json.loads((tmp_path / f"{FAULT_PREFIX}1.json").read_text())
    assert (record["rank"], record["world_size"], record["attempt"]) == (1, 3, 2)
    assert record["agent"] == os.getppid()      # the torchrun agent that started the worker
    assert take_faults(tmp_path) == [record]
    assert take_faults(tmp_path) == [] and take_faults(tmp_path / "none") == []
    # One left under another agent (an earlier launch) is dropped, not reported.
    (tmp_path / f"{FAULT_PREFIX}0.json").write_text(json.dumps({**record, "rank": 0, "agent": -1}))
    assert take_faults(tmp_path) == [] and not list(tmp_path.glob(f"{FAULT_PREFIX}*"))
    leave_fault(tmp_path, 1, fault(1, 10.0, 9.0), world_size=3)
    clear_faults(tmp_path)
    assert not list(tmp_path.glob(f"{FAULT_PREFIX}*"))


def test_a_lost_machine_is_named_and_the_phases_timed(tmp_path: Path) -> None:
    # Ranks 1 and 2 of 3 survived; rank 0's machine left no record.
    records = [fault(1, 100.3, 100.0, world_size=3), fault(2, 100.5, 99.9, world_size=3),
               fault(2, 100.5, 99.9, world_size=3)]   # read twice from a shared run directory
    rec = Recovery.from_records(records, world_after=2, group_formed=107.3)
    assert rec is not None and rec.lost_ranks == [0] and len(rec.records) == 2
    assert "rank 0 of 3 stopped answering: its connections dropped" in rec.cause
    rec.resumed_step, rec.first_step = 8, 108.8
    phases = rec.phases
    assert [round(phases[k], 3) for k in ("noticed_s", "new_group_s", "first_step_s", "total_s")] == [0.3, 7.0, 1.5, 8.8]
    line = rec.describe()
    assert "a new group of 2 process(es) (was 3) formed 7.0 s later, resumed from step 8" in line
    rec.write(tmp_path)
    rec.write(tmp_path)
    entries = read_recoveries(tmp_path)
    assert len(entries) == 2 and entries[0]["total_s"] == phases["total_s"] and "records" not in entries[0]


def test_a_timeout_and_a_rank_of_its_own_are_told_apart() -> None:
    cut = Recovery.from_records([fault(0, 30.0, 15.0, world_size=2, timed_out=True)], 1, 40.0)
    assert cut is not None and "timed out (--timeout), as when a machine is cut off" in cut.cause
    own = Recovery.from_records([fault(0, 5.0, 4.0, world_size=2, communication=False, error_type="ValueError",
                                       message="bad batch"), fault(1, 5.1, 4.0, world_size=2)], 2, 9.0)
    assert own is not None and own.cause == "rank 0 failed: ValueError: bad batch" and own.lost_ranks == []
    assert Recovery.from_records([], 2, 1.0) is None


def test_unreadable_recovery_file_reads_as_none(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text("{not json")
    assert read_recoveries(tmp_path) == []


def test_a_machine_joining_is_not_called_a_loss() -> None:
    # Admitting a machine, the agents stop the old group: its ranks see each other go.
    rec = Recovery.from_records([fault(1, 50.0, 49.8, world_size=2)], world_after=3, group_formed=55.0)
    assert rec is not None and rec.lost_ranks == []
    assert rec.cause.startswith("a machine joined: the agents restarted the group of 2 process(es)")


# torchrun's own line for a killed worker, as torch 2.13 writes it into logs/torchrun.log.
KILLED = ("2026-11-29 09:00:05,123 ERROR torch.distributed.elastic.multiprocessing.api: failed (exitcode: -9) "
          "local_rank: 1 (pid: 5640) of binary: /usr/bin/python\n")


def test_a_restart_after_a_killed_rank_is_told_even_without_a_record(tmp_path: Path) -> None:
    """Issue 41.9: the survivor was stopped by torchrun before its collective failed, so nobody left a
    record; torchrun's log still says which rank died and how, and the restart is numbered."""
    (tmp_path / "torchrun.log").write_text("starting\n" + KILLED + "restarting\n")
    died = last_worker_exit(tmp_path)
    assert died is not None and (died.local_rank, died.code) == (1, -9) and died.how() == "was killed by SIGKILL"
    found = Recovery.from_records([], 2, died.time + 10, restart=1, max_restarts=2, died=died)
    assert found is not None and found.lost_ranks == [1]
    assert found.describe().startswith("recovered (torchrun's restart 1 of 2): rank 1 of 2 was killed by SIGKILL "
                                       "(torchrun's log); noticed 0.0 s after the last step, a new group of 2 "
                                       "process(es) formed 10.0 s later"), found.describe()
    assert last_worker_exit(tmp_path / "none") is None
    assert Recovery.from_records([], 2, 0.0) is None   # a first attempt


def test_a_survivors_record_and_torchruns_log_name_the_rank_and_the_step(tmp_path: Path) -> None:
    (tmp_path / "torchrun.log").write_text(KILLED)
    died = last_worker_exit(tmp_path)
    found = Recovery.from_records([fault(0, 110.0, 100.0, step=7, world_size=2)], 2, 120.0, restart=1,
                                  max_restarts=2, died=died)
    assert found is not None
    assert found.describe().startswith("recovered (torchrun's restart 1 of 2): rank 1 of 2 was killed by SIGKILL "
                                       "in step 7; noticed 10.0 s after the last step"), found.describe()

