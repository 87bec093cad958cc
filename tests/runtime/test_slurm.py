"""SLURM: the host-list and tasks-per-node parsers, and DistEnv.from_env under srun's variables."""
from __future__ import annotations

import pytest
import torch

from scaleloop.runtime.dist import DistEnv, launched_by_slurm
from scaleloop.errors import UsageError
from scaleloop.runtime.slurm import first_host, parse_nodelist, parse_tasks_per_node, port_for_job, task_from_env

# What srun gives task 3 of `sbatch --nodes 2 --ntasks-per-node 2` + `srun python train.py`.
SRUN_TASK_3 = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize("value,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b[1,3],c", ["a", "b1", "b3", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu-a100-[0-1].cluster", ["gpu-a100-0.cluster", "gpu-a100-1.cluster"]),
    ("localhost", ["localhost"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_parse_nodelist(value: str, hosts: list[str]) -> None:
    assert parse_nodelist(value) == hosts
    assert first_host(value) == hosts[0]


@pytest.mark.parametrize("value,match", [
    ("node[01-03", "unmatched '\\['"), ("node]1", "unmatched '\\]'"), ("node[a-b]", "bad range"),
    ("node[3-1]", "descending"), ("", "empty"), (" , ", "empty"),
])
def test_parse_nodelist_errors(value: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_nodelist(value)


@pytest.mark.parametrize("value,counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2),3(x1)", [1, 1, 3]), ("8(x16)", [8] * 16),
])
def test_parse_tasks_per_node(value: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2x3", "2(3)", "a"])
def test_parse_tasks_per_node_errors(value: str) -> None:
    with pytest.raises(UsageError, match="tasks-per-node"):
        parse_tasks_per_node(value)


def test_port_for_job_is_deterministic_and_in_range() -> None:
    assert port_for_job("123456") == port_for_job("123456") == 15000 + 3456
    assert port_for_job("123457") == port_for_job("123456") + 1
    for job in ("0", "9999", "10000", "987654321", "", "not-a-number"):
        assert 15000 <= port_for_job(job) < 25000


def test_task_from_env_under_srun() -> None:
    task = task_from_env(SRUN_TASK_3)
    assert task is not None
    assert (task.rank, task.world_size, task.local_rank, task.local_world_size) == (3, 4, 1, 2)
    assert (task.master_addr, task.master_port) == ("gpu07", 18456)


def test_local_world_size_is_this_nodes_entry() -> None:
    # 5 tasks on 2 nodes: 3 on node 0, 2 on node 1 (SLURM_NTASKS_PER_NODE is not set then).
    environ = {**SRUN_TASK_3, "SLURM_NTASKS": "5", "SLURM_PROCID": "4", "SLURM_TASKS_PER_NODE": "3,2"}
    del environ["SLURM_NTASKS_PER_NODE"]
    assert task_from_env(environ).local_world_size == 2
    assert task_from_env({**environ, "SLURM_NODEID": "0"}).local_world_size == 3
    # The step's own list wins over the allocation's.
    assert task_from_env({**environ, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}).local_world_size == 1


def test_step_nodelist_wins_and_master_variables_override() -> None:
    environ = {**SRUN_TASK_3, "SLURM_STEP_NODELIST": "gpu08", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert task_from_env(environ).master_addr == "gpu08"
    environ = {**SRUN_TASK_3, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    task = task_from_env(environ)
    assert (task.master_addr, task.master_port) == ("10.0.0.7", 29400)


def test_the_batch_script_is_not_a_task() -> None:
    # sbatch's script sees SLURM_PROCID=0 and SLURM_NTASKS=4 too, but no job step.
    batch_script = {k: v for k, v in SRUN_TASK_3.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert task_from_env(batch_script) is None
    assert not launched_by_slurm(batch_script)
    assert DistEnv.from_env(batch_script, device="cpu") == DistEnv()


def test_launched_by_slurm() -> None:
    assert launched_by_slurm(SRUN_TASK_3)
    assert not launched_by_slurm({**SRUN_TASK_3, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})  # one task
    assert not launched_by_slurm({})
    legacy = {k: v for k, v in SRUN_TASK_3.items() if k != "SLURM_STEP_ID"} | {"SLURM_STEPID": "0"}
    assert launched_by_slurm(legacy)


def test_from_env_reads_srun_variables() -> None:
    env = DistEnv.from_env(SRUN_TASK_3, device="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.backend == "gloo" and env.device == torch.device("cpu")
    assert (env.master_addr, env.master_port) == ("gpu07", 18456)


def test_torchrun_variables_win_over_slurm() -> None:
    # srun started one torchrun per node: its workers are torchrun's, MASTER_* in the environment.
    environ = {**SRUN_TASK_3, "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
               "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    env = DistEnv.from_env(environ, device="cpu")
    assert (env.rank, env.world_size, env.local_world_size) == (5, 8, 4)
    assert env.master_addr is None and env.master_port is None


def test_a_single_task_needs_no_node_list() -> None:
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    env = DistEnv.from_env(environ, device="cpu")
    assert env == DistEnv()  # one process: no backend, no rendezvous address


@pytest.mark.parametrize("change,match", [
    ({"SLURM_PROCID": "x"}, "malformed"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside SLURM_NTASKS=4"),
    ({"SLURM_JOB_NODELIST": "", "SLURM_STEP_NODELIST": ""}, "no node list"),
    ({"SLURM_TASKS_PER_NODE": "2(x"}, "tasks-per-node"),
    ({"MASTER_PORT": "http"}, "malformed"),
])
def test_bad_slurm_environment_is_a_usage_error(change: dict[str, str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        DistEnv.from_env({**SRUN_TASK_3, **change}, device="cpu")


def test_a_task_knows_its_job_step_and_the_variables_it_was_read_from() -> None:
    task = task_from_env(SRUN_TASK_3)
    assert (task.job, task.step) == ("123456", "0")
    assert task.describe() == "rank 3 of 4 of SLURM job 123456, step 0"
    assert task.rendezvous == "gpu07:18456"
    # Every variable read, and only those: a shell left with them is told which to unset.
    assert task.read == ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_LOCALID",
                         "SLURM_NODEID", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST",
                         "SLURM_JOB_NODELIST")
    assert set(task.read) == set(SRUN_TASK_3)
    assert task.unset_command() == "unset " + " ".join(task.read)
    ipv6 = task_from_env({**SRUN_TASK_3, "MASTER_ADDR": "fd00::7", "MASTER_PORT": "29400"})
    assert ipv6.rendezvous == "[fd00::7]:29400" and ipv6.read[-2:] == ("MASTER_ADDR", "MASTER_PORT")


def test_from_env_keeps_the_srun_task_for_the_rendezvous() -> None:
    assert DistEnv.from_env(SRUN_TASK_3, device="cpu").srun_task == task_from_env(SRUN_TASK_3)
    one_task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert DistEnv.from_env(one_task, device="cpu").srun_task is None
