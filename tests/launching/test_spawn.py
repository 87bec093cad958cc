"""scaleloop.launch: a function in N worker processes, its result, its errors, and no leftovers."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import scaleloop as sl
from scaleloop.errors import UsageError
from scaleloop.launching.spawn import (WorkerError, WorkerFailure, _failure, _parse_nnodes, choose_start_method, launch,
                                    resolve_start_method)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from procs import SERVER  # noqa: E402

TIME_LIMIT_S = 60  # per test; far above what a 2-process run needs, far below "hung"


# --- functions the workers run (module level, so that "spawn" can import them) -----------

def train(steps: int = 6, lr: float = 0.1) -> dict[str, Any]:
    """A few DDP steps of SimpleNet through scaleloop's strategy API; the same code runs on 1 or N."""
    torch.manual_seed(0)
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env)
    try:
        data = sl.RandomDataset(256, input_dim=8, generator=torch.Generator().manual_seed(0))
        strategy = sl.strategy("ddp", env)
        model, optimizer = strategy.setup(sl.SimpleNet(input_dim=8, hidden_dim=16, output_dim=1),
                                          lambda params: torch.optim.SGD(params, lr=lr))
        loader = strategy.loader(data, batch_size=32, shuffle=True, seed=0)
        criterion = nn.BCEWithLogitsLoss()
        loader.set_epoch(0)
        for step, batch in enumerate(loader):
            if step == steps:
                break
            x, y = batch
            with strategy.micro_step(model, batch):
                strategy.backward(criterion(model(x), y), batch)
            strategy.optimizer_step(optimizer)
        net = strategy.unwrap(model)
        x_all = torch.stack([data[i][0] for i in range(len(data))])
        y_all = torch.stack([data[i][1] for i in range(len(data))])
        with torch.no_grad():
            loss = criterion(net(x_all), y_all).item()
        result = {"world_size": env.world_size, "loss": loss,
                  "state": {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}}
    finally:
        sl.destroy_process_group()
    # The wrapper is still held here (and by the strategy): a Reducer left in it would free the
    # group on return, which can hang the worker (runtime.dist.release_reducer).
    result["reducer_left"] = "reducer" in model.__dict__
    return result


def whoami(tag: str, *, suffix: str = "") -> dict[str, Any]:
    env = sl.DistEnv.from_env(device="cpu")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {"rank": env.rank, "world_size": env.world_size, "tag": tag + suffix, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "collecting": __import__("gc").isenabled(), "vars": {k: os.environ.get(k) for k in keys}}


def fail_on_rank_1() -> None:
    env = sl.DistEnv.from_env(device="cpu")
    if env.rank == 1:
        raise ValueError("bad batch shape on this rank")  # RAISED-HERE
    # Rank 0 waits for rank 1 in the rendezvous, which never comes: the launcher must stop it.
    sl.init_process_group(env, timeout_s=TIME_LIMIT_S)
    torch.distributed.barrier()


class _Litter:
    """Garbage in a reference cycle whose finaliser notes the process that collected it."""

    def __init__(self, notes: Path) -> None:
        self.notes, self.me = notes, self

    def __del__(self) -> None:
        (self.notes / str(os.getpid())).touch()


def collect_and_report() -> bool:
    import gc

    gc.collect()
    return gc.isenabled()


def crash_on_rank_1() -> None:
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env, timeout_s=TIME_LIMIT_S)
    torch.distributed.barrier()
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # CRASHED-HERE: as a crash in C++ would
    torch.distributed.barrier()


def stall_on_rank_1() -> None:
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env, timeout_s=5)
    torch.distributed.barrier()
    if env.rank == 1:
        time.sleep(600)  # STUCK-HERE
    torch.distributed.barrier()


def line_of(mark: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if mark in text
                and "line_of" not in text)


def exit_without_raising() -> None:
    if os.environ["RANK"] == "1":
        os._exit(3)


# --- fixtures: every test ends with no worker left, and none runs forever -----------------

def _children() -> list[tuple[int, str]]:
    """This process's live child processes (pid, command line), from /proc (none known without it)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        # multiprocessing's resource tracker lives as long as this process, by design, and so
        # does the tests' fork server (tests/distributed/forkserver.py).
        if ppid == me and state != "Z" and "resource_tracker" not in cmd and int(entry.name) != SERVER.pid:
            found.append((int(entry.name), cmd))
    return found


@pytest.fixture(autouse=True)
def no_leftover_workers() -> Iterator[None]:
    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test ran over {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, too_long)  # the agent stops its workers on any exception
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        deadline = time.monotonic() + 10
        while _children() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _children()
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)  # our own children only
        assert not left, f"processes left behind: {left}"


# --- real runs ---------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_two_workers_train_the_same_model_as_one() -> None:
    one = train()                                           # this process, no process group
    # DDP imports torch._dynamo (seconds); imported here once, the forked workers inherit it.
    import torch._dynamo  # noqa: F401

    two = launch(train, 2, kwargs={"steps": 6})            # "auto": fork on Linux
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert not two["reducer_left"], "destroy_process_group left a live DDP wrapper its Reducer"
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert one["state"].keys() == two["state"].keys()
    for name in one["state"]:
        torch.testing.assert_close(two["state"][name], one["state"][name], atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_the_result_is_rank_0s_and_workers_see_torchrun_variables() -> None:
    result = launch(whoami, 2, args=("run",), kwargs={"suffix": "!"})
    assert result["rank"] == 0 and result["world_size"] == 2 and result["tag"] == "run!"
    assert result["pid"] != os.getpid()
    assert result["collecting"]   # the garbage collector runs in workers, as it did here
    assert result["vars"]["MASTER_ADDR"] and result["vars"]["MASTER_PORT"] not in (None, "0")
    every = launch(whoami, 2, args=("run",), all_ranks=True)
    assert sorted(every) == [0, 1]
    assert [every[r]["rank"] for r in (0, 1)] == [0, 1]
    assert [every[r]["vars"]["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]
    if "OMP_NUM_THREADS" not in os.environ:
        assert every[0]["threads"] == 1  # as torchrun: workers sharing a machine get one thread each


@pytest.mark.distributed
@pytest.mark.slow
def test_spawn_starts_fresh_interpreters_for_an_importable_function() -> None:
    result = launch(whoami, 2, args=("spawned",), kwargs={"suffix": "?"}, start_method="spawn")
    assert result["rank"] == 0 and result["tag"] == "spawned?" and result["pid"] != os.getpid()


@pytest.mark.distributed
def test_closures_run_in_forked_workers() -> None:
    offset = 10
    assert launch(lambda: int(os.environ["RANK"]) + offset, 2) == 10


@pytest.mark.distributed
def test_a_worker_exception_names_the_rank_and_the_error() -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(WorkerError) as info:
        launch(fail_on_rank_1, 2)
    err = info.value
    # The short report: the rank, the exception and the user's line, first; a few lines in all.
    lines = str(err).splitlines()
    assert lines[0] == "rank 1 of 2 failed: ValueError: bad batch shape on this rank", str(err)
    assert lines[1] == f"  raised at: {Path(__file__).resolve()}:{line_of('RAISED-HERE')} in fail_on_rank_1"
    assert len(lines) <= 15 and "Traceback" not in str(err)
    assert err.ranks == [1]
    failure = err.failures[1]
    assert failure.error_type == "ValueError" and failure.message == "bad batch shape on this rank"
    assert "fail_on_rank_1" in failure.traceback
    assert "fail_on_rank_1" in str(err.__cause__)            # the worker's traceback, chained
    # The elastic agent's signal handlers do not outlive the call (Ctrl-C stays KeyboardInterrupt).
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.distributed
def test_a_stalled_worker_is_named_with_where_it_is_stuck(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerError) as info:
        launch(stall_on_rank_1, 2)
    lines = str(info.value).splitlines()
    assert lines[0] == ("the run stalled: rank 1 stopped taking part; rank 0 gave up waiting after its timeout "
                        "(init_process_group's timeout_s)"), str(info.value)
    assert f"  rank 1 was at: {Path(__file__).resolve()}:{line_of('STUCK-HERE')} in stall_on_rank_1" in lines
    assert any(line.startswith("  rank 0 waited in: barrier in stall_on_rank_1") for line in lines)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Terminating process" not in out + err  # the agent's noise: not shown


@pytest.mark.distributed
def test_forked_workers_never_collect_the_callers_garbage(tmp_path: Path) -> None:
    import gc

    gc.disable()   # so that the litter is still here when the workers are forked
    try:
        _Litter(tmp_path)   # unreachable at once, but only the collector can free it
        results = launch(collect_and_report, 2, start_method="fork", all_ranks=True)
        assert results == {0: False, 1: False}               # the caller's choice holds in the workers
        assert not gc.isenabled()                            # and here, after the launch
    finally:
        gc.enable()
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(os.getpid())]  # freed here, and only here


@pytest.mark.distributed
def test_a_worker_that_crashes_is_named_with_where_it_was() -> None:
    with pytest.raises(WorkerError) as info:
        launch(crash_on_rank_1, 2)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 1 crashed: Segmentation fault", str(info.value)
    assert lines[1] == f"  at: {Path(__file__).resolve()}:{line_of('CRASHED-HERE')} in crash_on_rank_1", str(info.value)
    # Rank 0, waiting in a barrier, either notices the lost peer first (and the report says so)
    # or is stopped by the agent before it does (nothing of its own to report): which one comes
    # first depends on the machine's load, so either is right; nothing else may follow.
    assert len(lines) in (2, 3), str(info.value)
    assert all(line.startswith("  then: rank 0 lost its peer ") for line in lines[2:]), str(info.value)


@pytest.mark.distributed
def test_a_worker_that_exits_without_an_exception() -> None:
    with pytest.raises(WorkerError, match=r"^worker rank 1 failed: exited with code 3 "):
        launch(exit_without_raising, 2)


CALLER = """
import os, pathlib, sys, time
import scaleloop as sl

notes = pathlib.Path(sys.argv[1])

def stay() -> None:
    (notes / f"worker-{os.getpid()}").touch()
    time.sleep(600)

if __name__ == "__main__":
    sl.launch(stay, 2)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a lifeline needs Linux's PR_SET_PDEATHSIG")
@pytest.mark.parametrize("killed", ["the caller", "its process group"])
def test_sigkill_of_the_caller_leaves_no_agent_and_no_worker(tmp_path: Path, killed: str) -> None:
    """scaleloop.launch's agent is the supervisor's child, and its workers hold their lifeline to it:
    a script (or notebook kernel) killed mid-run takes them along within 10 s."""
    import subprocess

    from procs import child_env, kill_group

    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=child_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + TIME_LIMIT_S - 15
        while len(list(tmp_path.glob("worker-*"))) < 2:
            assert caller.poll() is None, f"the caller ended ({caller.returncode}) before its workers started"
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        workers = [int(p.name.partition("-")[2]) for p in tmp_path.glob("worker-*")]
        agents = {int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]) for pid in workers}
        assert len(agents) == 1 and caller.pid not in agents, "the workers' parent is the agent, not the caller"
        if killed == "the caller":
            os.kill(caller.pid, signal.SIGKILL)
        else:
            os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(timeout=10)
        gone_by = time.monotonic() + 10
        while any(_alive(pid) for pid in [*workers, *agents]):
            assert time.monotonic() < gone_by, (f"left after 10 s: {[p for p in [*workers, *agents] if _alive(p)]} "
                                                f"(workers {workers}, agent {agents})")
            time.sleep(0.05)
    finally:
        kill_group(caller)


def test_the_public_name_stays_the_function_after_the_cli_modules_are_imported() -> None:
    import importlib

    for name in ("scaleloop.cli", "scaleloop.launching.torchrun"):
        importlib.import_module(name)
    assert sl.launch is launch


# --- no processes ------------------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="auto forks on Linux only")
def test_start_method_auto_forks_on_linux() -> None:
    assert resolve_start_method("auto", whoami) == "fork"
    assert resolve_start_method("auto", lambda: 0) == "fork"
    assert resolve_start_method("spawn", whoami) == "spawn"


def test_start_method_auto_spawns_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert resolve_start_method("auto", whoami) == "spawn"          # importable from a module
    with pytest.raises(UsageError, match="must be spawned, but it cannot be pickled"):
        resolve_start_method("auto", lambda: 0)
    with pytest.raises(UsageError, match="forked workers cannot use it"):
        resolve_start_method("fork", whoami)


LINUX = {"platform": "linux", "available": ["fork", "spawn", "forkserver"]}


@pytest.mark.parametrize("facts,fn_importable,expected", [
    ({"gpus": False, "cuda_initialised": False}, True, "fork"),     # CPU machine: fork is safe and quick
    ({"gpus": True, "cuda_initialised": False}, True, "spawn"),     # is_available() may have started the driver
    ({"gpus": True, "cuda_initialised": True}, True, "spawn"),
    ({"gpus": True, "cuda_initialised": False}, False, "fork"),     # a notebook's function: the only way it runs
    ({"gpus": False, "cuda_initialised": False, "platform": "darwin", "available": ["fork", "spawn"]}, True, "spawn"),
    ({"gpus": False, "cuda_initialised": False, "platform": "win32", "available": ["spawn"]}, True, "spawn"),
])
def test_auto_spawns_where_a_gpu_is_and_forks_where_that_is_safe(facts: dict[str, Any], fn_importable: bool,
                                                                 expected: str) -> None:
    reason = None if fn_importable else "it is defined in a notebook or an interactive session"
    assert choose_start_method("auto", **{**LINUX, **facts}, not_importable=reason) == expected


def test_a_start_method_named_is_kept_or_refused_never_changed() -> None:
    facts = {**LINUX, "gpus": True, "cuda_initialised": False, "not_importable": None}
    assert choose_start_method("fork", **facts) == "fork"              # the caller's choice, on a GPU machine too
    assert choose_start_method("forkserver", **facts) == "forkserver"
    with pytest.raises(UsageError, match="forked workers cannot use it"):
        choose_start_method("fork", **{**facts, "cuda_initialised": True})
    with pytest.raises(UsageError, match="must be spawned, but it cannot be pickled"):
        choose_start_method("auto", **{**facts, "cuda_initialised": True, "not_importable": "it cannot be pickled"})
    with pytest.raises(UsageError, match="'fork' is not available"):
        choose_start_method("fork", **{**facts, "available": ["spawn"]})


def test_start_method_errors() -> None:
    with pytest.raises(UsageError, match="unknown start_method"):
        resolve_start_method("thread", whoami)
    with pytest.raises(UsageError, match="cannot be pickled.*start_method='fork'"):
        resolve_start_method("spawn", lambda: 0)


@pytest.mark.parametrize("kwargs,match", [
    ({"nproc": 0}, "nproc must be a positive"),
    ({"nproc": 2, "nnodes": 2}, "needs rdzv_endpoint"),
    ({"nproc": 2, "nnodes": "x"}, "nnodes must be"),
    ({"nproc": 2, "nnodes": "3:2"}, "MIN <= MAX"),
    ({"nproc": 2, "max_restarts": -1}, "max_restarts"),
])
def test_bad_arguments_are_usage_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        launch(whoami, **kwargs)


def test_nnodes_forms() -> None:
    assert _parse_nnodes(1) == (1, 1)
    assert _parse_nnodes("2") == (2, 2)
    assert _parse_nnodes("1:4") == (1, 4)


def test_failure_from_a_signal_and_from_an_error_record() -> None:
    killed = SimpleNamespace(exitcode=-9, message="Signal 9 (SIGKILL) received by PID 7",
                             error_file_data={"message": "<NONE>"}, signal_name=lambda: "SIGKILL")
    assert str(_failure(3, killed)) == "rank 3: killed by signal SIGKILL"
    record = {"message": "KeyError: 'x'", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "0"}}
    raised = SimpleNamespace(exitcode=1, message=record, error_file_data={"message": record})
    assert _failure(0, raised) == WorkerFailure(0, 1, "KeyError", "'x'", "Traceback ...")
    both = WorkerError({2: _failure(2, killed), 0: _failure(0, raised)})
    assert str(both) == "workers failed: rank 0: KeyError: 'x'; rank 2: killed by signal SIGKILL"
