"""Failure reports from what workers leave behind: error files, stack dumps, the report, failure.json.

The error files here are written by the worker's real handler (``scaleloop.launching.worker``)
from exceptions raised in this process; the stack dumps have faulthandler's format. The real
2-process runs are in tests/distributed/test_failures_dist.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleloop.config import TrainConfig
from scaleloop.launching.failures import FAILURE_FILE, analyse, read_stack_dump
from scaleloop.runtime.frames import note_where, where_of
from scaleloop.launching.worker import ATTEMPT_MARK, _RankErrorHandler

ELASTIC = "logs/torchrun/launch/run-id_x"
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:5289. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"


def user_forward(step: int) -> None:
    raise ValueError(f"bad batch at {step}")  # the user's line


def record(run: Path, monkeypatch: pytest.MonkeyPatch, rank: int, exc_fn, log_text: str = "") -> dict:
    """Raise through ``exc_fn`` and record it as rank ``rank``'s worker would."""
    path = run / ELASTIC / "attempt_0" / str(rank) / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    (run / "logs" / f"rank-{rank}.log").write_text(f"{ATTEMPT_MARK} rank {rank}, attempt 0 ====\n{log_text}")
    try:
        exc_fn()
    except Exception as exc:  # as torch's record() does
        _RankErrorHandler(rank, open(run / "logs" / f"rank-{rank}.log", "a"), run / "logs").record_exception(exc)
    return json.loads(path.read_text())


def raise_in_loop() -> None:
    try:
        user_forward(3)
    except Exception as exc:
        note_where(exc, epoch=1, step=3)
        raise


def dump(*frames: tuple[str, int, str], thread: bool = True) -> str:
    """A faulthandler dump: a helper thread, then the main thread (innermost frame first)."""
    lines = []
    if thread:
        lines += ["Thread 0x00007f0000000001 (most recent call first):",
                  '  File "/usr/lib/python3.11/threading.py", line 324 in wait',
                  '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap', ""]
    lines.append("Current thread 0x00007f0000000002 (most recent call first):")
    lines += [f'  File "{p}", line {n} in {name}' for p, n, name in frames]
    lines.append('  File "<frozen runpy>", line 198 in _run_module_as_main')
    return "\n".join(lines) + "\n"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()
    return tmp_path


def test_the_error_file_holds_rank_epoch_step_and_the_users_frame(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = record(run, monkeypatch, 1, raise_in_loop)
    assert data["message"]["message"] == "ValueError: bad batch at 3"       # torch's own fields stay
    assert "py_callstack" in data["message"]["extraInfo"]
    ours = data["message"]["extraInfo"]["scaleloop"]
    assert ours["rank"] == 1 and ours["epoch"] == 1 and ours["step"] == 3
    assert ours["frame"].endswith(f"test_failures.py:{user_forward.__code__.co_firstlineno + 1} in user_forward")
    assert ours["communication"] is False and ours["waiting_in"] is None


def test_a_dataloaders_sigchld_handler_does_not_break_the_record(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DataLoader raises from its SIGCHLD handler when one of its workers ends, in whatever
    code runs then: here while the failure is being described (issue 51.6: no error file was written)."""
    import os
    import signal

    from scaleloop.launching import worker

    def like_torchs(signum: int, frame: object) -> None:
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    class ChildEndsNow(worker.FrameKinds):
        def __init__(self) -> None:
            os.kill(os.getpid(), signal.SIGCHLD)   # a worker ends while the record is being made
            super().__init__()

    monkeypatch.setattr(worker, "FrameKinds", ChildEndsNow)
    previous = signal.signal(signal.SIGCHLD, like_torchs)
    try:
        data = record(run, monkeypatch, 1, raise_in_loop)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert data["message"]["extraInfo"]["scaleloop"]["error_type"] == "ValueError"


def test_a_batch_whose_worker_died_mid_hand_over_is_said_as_the_workers_death() -> None:
    # The batch's hand-over (multiprocessing's resource sharer) can find the SIGKILLed worker gone
    # before torch's own check does: a ConnectionResetError, which is the same death.
    import signal
    from types import SimpleNamespace

    from scaleloop.launching.worker import describe_exception

    class Iterator:   # stands for torch's multi-process DataLoader iterator: its workers, one killed
        _workers = [SimpleNamespace(pid=4242, exitcode=0), SimpleNamespace(pid=4343, exitcode=-signal.SIGKILL)]

        def next_batch(self) -> None:
            raise ConnectionResetError(104, "Connection reset by peer")

    try:
        Iterator().next_batch()
    except ConnectionResetError as exc:
        said = describe_exception(exc, 0)
    assert said["error_type"] == "RuntimeError"
    assert said["message"] == ("a DataLoader worker (pid 4343) was killed by signal SIGKILL: most often the kernel's "
                               "out-of-memory killer (see `dmesg`); fewer --num-workers use less memory")
    try:
        raise ConnectionResetError(104, "Connection reset by peer")   # no DataLoader on the stack: as it is
    except ConnectionResetError as exc:
        assert describe_exception(exc, 0)["error_type"] == "ConnectionResetError"


def test_a_raising_rank_is_named_and_the_others_summarised(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(run, monkeypatch, 1, raise_in_loop)
    record(run, monkeypatch, 0, lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED)))
    (run / "logs" / "rank-2.log").write_text(f"{ATTEMPT_MARK} rank 2 ====\n" + dump(
        ("/venv/lib/python3.11/site-packages/torch/autograd/graph.py", 829, "_engine_run_backward")))
    failure = analyse(run, run / "logs/torchrun/launch", [0, 1, 2], 300.0, 1, "CONTINUE")
    failure.write(run)
    report = failure.report
    assert len(report) <= 15
    assert report[0] == "scaleloop: error: rank 1 of 3 failed at epoch 1, step 3: ValueError: bad batch at 3"
    assert report[1].startswith("  raised at: ") and report[1].endswith("in user_forward")
    assert report[2].strip() == 'raise ValueError(f"bad batch at {step}")  # the user\'s line'
    then = next(line for line in report if line.startswith("  then: "))
    assert "rank 0 lost its peer (RuntimeError: Connection closed by peer [127.0.0.1]:5289.)" in then
    assert "rank 2 was stopped by torchrun" in then
    assert f"{run}/logs/rank-1.log" in "\n".join(report) and report[-1] == "  CONTINUE"
    saved = json.loads((run / FAILURE_FILE).read_text())
    assert saved["kind"] == "failed" and saved["rank"] == 1 and (saved["epoch"], saved["step"]) == (1, 3)
    assert saved["error_type"] == "ValueError" and saved["message"] == "bad batch at 3"
    assert saved["frame"] == report[1].partition(": ")[2]
    assert saved["logs"] == {"0": "logs/rank-0.log", "1": "logs/rank-1.log", "2": "logs/rank-2.log"}
    assert saved["report"] == report and saved["waiting_in"] is None and saved["time"]


@pytest.mark.parametrize("machines", [1, 2])
def test_ranks_that_only_lost_their_peers_point_to_another_machine(run: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  machines: int) -> None:
    """Machine 1 of a 2-machine job whose machine 0 stopped (bad input there): its one rank lost its
    peer and nothing here failed of itself, so the report says where to look."""
    record(run, monkeypatch, 1, lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED)))
    failure = analyse(run, run / "logs/torchrun/launch", [1], None, 1, "CONTINUE", machines=machines)
    report = "\n".join(failure.report)
    assert "  then: rank 1 lost its peer (RuntimeError: Connection closed by peer" in report
    pointed = "  cause: on another machine of the job (this machine's ranks only lost their peers)"
    assert (pointed in report) == (machines > 1), report


def test_the_first_of_two_raising_ranks_is_the_cause(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(run, monkeypatch, 0, lambda: user_forward(1))
    record(run, monkeypatch, 1, lambda: user_forward(2))
    failure = analyse(run, run / "logs/torchrun/launch", [0, 1], None, 1, "CONTINUE")
    assert failure.rank == 0 and "also raised: rank 1: ValueError: bad batch at 2" in "\n".join(failure.report)


def test_a_stall_names_the_rank_behind_where_it_is_and_the_collective(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace: dict = {}
    # A function that torch.distributed would hold: its file name is what counts.
    exec(compile("def all_reduce(t):\n    raise RuntimeError(%r)\n" % GLOO_TIMEOUT,
                 "/venv/site-packages/torch/distributed/distributed_c10d.py", "exec"), namespace)

    def sum_over_ranks() -> None:
        namespace["all_reduce"](1)

    data = record(run, monkeypatch, 0, sum_over_ranks)["message"]["extraInfo"]["scaleloop"]
    assert data["communication"] and data["timed_out"]
    assert data["waiting_in"].startswith("all_reduce in sum_over_ranks (") and "test_failures.py:" in data["waiting_in"]
    model = run / "mymodel.py"
    model.write_text("import time\n\ndef forward(x):\n    time.sleep(600)  # stuck here\n")
    (run / "logs" / "rank-1.log").write_text(f"{ATTEMPT_MARK} rank 1 ====\nstep lines\n" + dump(
        (str(model), 4, "forward"),
        ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1789, "_call_impl"),
        ("/repo/src/scaleloop/loop/step.py", 75, "micro")))
    failure = analyse(run, run / "logs/torchrun/launch", [0, 1], 5.0, 1, "CONTINUE")
    assert failure.kind == "stalled" and failure.rank == 1 and failure.frame == f"{model}:4 in forward"
    assert failure.waiting_in == data["waiting_in"]
    text = "\n".join(failure.report)
    assert failure.report[0].startswith("scaleloop: error: the run stalled: rank 1 stopped taking part; "
                                        "rank 0 gave up waiting after 5 s (--timeout)")
    assert f"rank 1 was at: {model}:4 in forward\n      time.sleep(600)  # stuck here" in text
    assert "rank 0 waited in: all_reduce in sum_over_ranks" in text and "raise --timeout (now 5 s)" in text


def test_a_crashed_rank_without_python_error(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(run, monkeypatch, 0, lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED)))
    (run / "logs" / "rank-1.log").write_text(f"{ATTEMPT_MARK} rank 1 ====\nFatal Python error: Segmentation fault\n\n"
                                             + dump(("/home/u/ext.py", 9, "kernel"), thread=False))
    failure = analyse(run, run / "logs/torchrun/launch", [0, 1], None, 1, "CONTINUE")
    assert failure.kind == "failed" and failure.rank == 1 and failure.frame == "/home/u/ext.py:9 in kernel"
    assert failure.report[0] == "scaleloop: error: rank 1 crashed: Segmentation fault"


# torchrun's own failure when --master-port is taken (its log's last line, as torch 2.13 writes it).
PORT_TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 33569, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


@pytest.mark.parametrize("log,first", [
    (f"starting\nTraceback (most recent call last):\n  File x\n{PORT_TAKEN}\n",
     "port 33569 is already in use, so torchrun could not start the workers' rendezvous there; choose a free port "
     "with --master-port"),
    ("starting\nRuntimeError: the agent broke. More text here\n",
     "the workers failed (torchrun exit code 1) and recorded no Python error; torchrun ended with RuntimeError: "
     "the agent broke. More text here"),
    ("starting\nERROR something odd\n",
     "the workers failed (torchrun exit code 1) and recorded no Python error; torchrun ended with this last "
     "message: ERROR something odd"),
])
def test_torchruns_own_failure_is_one_whole_line_that_points_only_to_files_there(run: Path, log: str,
                                                                                  first: str) -> None:
    """No worker wrote a log or an error (torchrun failed before starting them): the first line says
    what torchrun ended with (a port in use, by its number), and the report names torchrun's log,
    not rank logs that do not exist (issue 41.6: it ended on "torchrun's own messages end with:")."""
    (run / "logs" / "torchrun.log").write_text(log)
    failure = analyse(run, run / "logs/torchrun/launch", [], None, 1, "CONTINUE")
    assert failure.rank is None and failure.report[0] == f"scaleloop: error: {first}"
    assert failure.message == first
    assert failure.report[1] == f"  torchrun's messages: {run / 'logs' / 'torchrun.log'}"
    assert not any("rank-" in line for line in failure.report), failure.report


def test_only_the_last_attempt_of_a_log_is_read(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text(f"{ATTEMPT_MARK} 0\n" + dump(("/a/old.py", 1, "f")) + f"{ATTEMPT_MARK} 1\nno dump\n")
    assert read_stack_dump(log) is None
    log.write_text(f"{ATTEMPT_MARK} 0\n" + dump(("/a/new.py", 2, "g")))
    found = read_stack_dump(log)
    assert found is not None and str(found.frames[-1]) == "/a/new.py:2 in g" and not found.waiting()


def test_where_is_found_through_chained_exceptions() -> None:
    inner = ValueError("x")
    note_where(inner, epoch=2, step=7, last_progress=1234.5)
    note_where(inner, epoch=9, step=9)          # the first note wins
    outer = RuntimeError("y")
    outer.__cause__ = inner
    assert where_of(outer) == {"epoch": 2, "step": 7, "last_progress": 1234.5, "during": None}
    assert where_of(KeyError()) == {"epoch": None, "step": None, "last_progress": None, "during": None}
    evaluating = ValueError("z")
    note_where(evaluating, epoch=2, step=15, during="the evaluation after epoch 1")
    assert where_of(evaluating)["during"] == "the evaluation after epoch 1"


def test_flight_recorder_variables_for_cuda_workers_only(tmp_path: Path) -> None:
    from scaleloop.launching.torchrun import workers_env

    env = workers_env(TrainConfig(device="cuda", nproc=2), tmp_path / "logs", environ={"PATH": "/bin"})
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "logs" / "nccl-trace-rank-") and env["PATH"] == "/bin"
    mine = workers_env(TrainConfig(device="cuda", nproc=2), tmp_path, environ={"TORCH_FR_BUFFER_SIZE": "64"})
    assert mine["TORCH_FR_BUFFER_SIZE"] == "64"                       # the user's own setting wins
    assert "TORCH_FR_BUFFER_SIZE" not in workers_env(TrainConfig(device="cpu", nproc=2), tmp_path, environ={})


def test_supervised_command_is_torchrun_with_logs(tmp_path: Path) -> None:
    from scaleloop.launching.torchrun import launch_for

    launch = launch_for(TrainConfig(nproc=2), "scaleloop", ["train"], logs=tmp_path, launch_id="L1",
                        entry="scaleloop.cli", python="py")
    cmd = launch.supervised_command()
    assert cmd[:4] == ["py", "-m", "scaleloop.launching.agent", str(tmp_path / "torchrun.log")]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and f"--log-dir={tmp_path}/torchrun/L1" in cmd
    assert cmd[-5:] == ["-m", "scaleloop.launching.worker", str(tmp_path), "scaleloop.cli", "train"]
    # The plain command shown to the user has the same torchrun flags, and the user-facing module.
    plain = launch.plain_command()
    assert plain == ["py", "-m", "torch.distributed.run", *launch.torchrun_flags(), "-m", "scaleloop", "train"]


def test_timeout_flag_and_default() -> None:
    from scaleloop.cli import build_parser
    from scaleloop.commands.cmdline import flag_values
    from scaleloop.runtime.dist import DEFAULT_TIMEOUT_S

    assert TrainConfig().timeout == DEFAULT_TIMEOUT_S
    assert flag_values(build_parser().parse_args(["train", "--timeout", "5"]))["timeout"] == 5.0
    assert flag_values(build_parser().parse_args(["verify", "--timeout", "7"]))["timeout"] == 7.0


def test_verify_names_the_rank_whose_own_code_failed(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scaleloop.verify.diagnose import failure_cause

    def kept(data: dict) -> dict:  # the keys Recorder.fail adds from the same description
        ours = data["message"]["extraInfo"]["scaleloop"]
        return {k: ours[k] for k in ("frame", "communication", "timed_out", "waiting_in", "time")}

    own = kept(record(run, monkeypatch, 1, raise_in_loop))
    lost = kept(record(run, monkeypatch, 0, lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED))))
    # as verify's Recorder.fail writes them: both at step 3, rank 0's loss of its peer first in rank order
    failures = [{"rank": 0, "step": 3, "error": f"RuntimeError: {GLOO_CLOSED}", **lost},
                {"rank": 1, "step": 3, "error": "ValueError: bad batch at 3", **own}]
    cause = failure_cause(failures)
    assert cause.detail.startswith("rank 1 at step 3: ValueError: bad batch at 3 (raised at ")
    timed_out = dict(failures[0], error=f"RuntimeError: {GLOO_TIMEOUT}", timed_out=True,
                     waiting_in="gradient all-reduce in backward (DDP)")
    cause = failure_cause([timed_out])
    assert cause.title == "the distributed run stalled"
    assert "rank(s) 0 gave up at step 3 after --timeout, waiting in gradient all-reduce in backward (DDP)" in cause.detail
