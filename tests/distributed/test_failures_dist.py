"""Failures that explain themselves, on real 2-process Gloo groups under ``scaleloop train --nproc 2``.

- rank 1 raises at its third forward: a short report names rank 1, the step, the exception and
  the user's line; no traceback or torchrun summary on the console; failure.json; the logs;
- rank 1 sleeps in forward with ``--timeout 5``: the run ends within seconds of the timeout and
  the report names rank 1, the line it is stuck on, and the collective rank 0 waited in;
- Ctrl-C: one line that says how to continue;
- a usage error found by the workers (the model's output): said exactly once, exit 2;
- the same report from ``scaleloop verify`` (a raising rank; a stalled one under --timeout) and
  from ``scaleloop bench`` (a raising worker).

The misbehaving models are in scripts/failing_models.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forked_launch import FORK_LAUNCH_VAR
from procs import SRC, ForkedRun, child_env, kill_group, run, sigint_state
from scaleloop.commands.doctor import diagnose

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MODELS = SCRIPTS / "failing_models.py"
TRAIN = [sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--epochs", "1", "--no-progress"]
VERIFY = [sys.executable, "-m", "scaleloop", "verify", "--steps", "3"]


def line_of(mark: str) -> int:
    return next(i for i, text in enumerate(MODELS.read_text().splitlines(), 1) if mark in text)


def report_of(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("scaleloop: error:"))
    return lines[start:]


def env() -> dict[str, str]:
    return child_env({"PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS)])})


def test_a_raising_rank_is_reported_in_a_few_lines(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run([*TRAIN, "--model", "failing_models:raises", "--out", str(out)], cwd=SCRIPTS, timeout=180, env=env())
    assert res.returncode == 1, res.stderr
    report = report_of(res.stderr)
    assert len(report) <= 15, res.stderr
    assert report[0] == "scaleloop: error: rank 1 of 2 failed at epoch 1, step 3: ValueError: bad batch on rank 1"
    assert report[1] == f"  raised at: {MODELS}:{line_of('RAISE-LINE')} in forward"
    assert "rank 0 lost its peer" in res.stderr or "rank 0 was stopped by torchrun" in res.stderr
    assert report[-1] == f"  nothing was kept (no checkpoint, no logged step); once fixed, run the same command again: it starts over in {out}"
    for noise in ("Traceback", "Root Cause", "ChildFailedError", "[rank1]"):
        assert noise not in res.stdout + res.stderr
    assert f"logs: {out}/logs/rank-1.log" in res.stderr
    for rank in (0, 1):
        assert (out / "logs" / f"rank-{rank}.log").is_file()
    assert "ValueError: bad batch on rank 1" in (out / "logs" / "rank-1.log").read_text()  # the full traceback
    saved = json.loads((out / "failure.json").read_text())
    assert {k: saved[k] for k in ("kind", "rank", "epoch", "step", "error_type", "message")} == {
        "kind": "failed", "rank": 1, "epoch": 1, "step": 3, "error_type": "ValueError", "message": "bad batch on rank 1"}
    assert saved["frame"] == f"{MODELS}:{line_of('RAISE-LINE')} in forward"
    assert saved["logs"] == {"0": "logs/rank-0.log", "1": "logs/rank-1.log"} and saved["report"] == report
    told = diagnose(out)   # scaleloop doctor, later, from the run directory alone
    assert told.state == "failed"
    assert told.what == "failed on rank 1 at epoch 1, step 3 with ValueError: bad batch on rank 1"
    assert f"raised at {MODELS}:{line_of('RAISE-LINE')} in forward" in told.details


def test_one_process_gets_the_same_short_report_and_the_retry_reuses_the_directory(tmp_path: Path) -> None:
    """At --nproc 1 the run trains in the launcher's own process: the same short report as N
    workers give (not a raw traceback), the traceback in logs/rank-0.log, failure.json for doctor;
    and the corrected command with the same --out is not refused."""
    out = tmp_path / "run"
    one = [sys.executable, "-m", "scaleloop", "train", "--nproc", "1", "--epochs", "1", "--no-progress",
           "--out", str(out)]
    res = run([*one, "--model", "failing_models:wrong_width"], cwd=SCRIPTS, timeout=180, env=env())
    assert res.returncode == 1, res.stderr
    report = report_of(res.stderr)
    assert len(report) <= 10, res.stderr
    assert report[0].startswith("scaleloop: error: the run failed at epoch 1, step 1: RuntimeError: mat1 and mat2 "
                                "shapes cannot be multiplied"), res.stderr
    assert report[1] == f"  raised at: {MODELS}:{line_of('WIDTH-LINE')} in forward"
    assert report[2].strip() == "return self.net(x.flatten(1))  # WIDTH-LINE"
    assert f"  traceback: {out}/logs/rank-0.log" in report
    assert report[-1] == (f"  nothing was kept (no checkpoint, no logged step); once fixed, run the same command "
                          f"again: it starts over in {out}")
    assert "Traceback" not in res.stderr
    assert "Traceback (most recent call last)" in (out / "logs" / "rank-0.log").read_text()
    saved = json.loads((out / "failure.json").read_text())
    assert (saved["kind"], saved["rank"], saved["step"], saved["error_type"]) == ("failed", 0, 1, "RuntimeError")
    assert saved["report"] == report
    told = diagnose(out)
    assert told.state == "failed" and "RuntimeError: mat1 and mat2" in told.what
    fixed = run([*one, "--model", "failing_models:raises", "--max-steps", "1"], cwd=SCRIPTS, timeout=180, env=env())
    assert fixed.returncode == 0, fixed.stderr
    assert "held a run that stopped before its first step; this run starts over in it" in fixed.stderr
    assert not (out / "failure.json").exists() and (out / "model.pt").is_file()


def test_a_nonfinite_loss_on_one_rank_names_it_and_doctor_reads_the_record(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run([*TRAIN, "--model", "failing_models:nan_on_rank_1", "--log-every", "1", "--out", str(out)],
              cwd=SCRIPTS, timeout=180, env=env())
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "scaleloop: error: the run diverged: the training loss became nan at step 3 (epoch 1) on rank 1; "), res.stderr
    saved = json.loads((out / "failure.json").read_text())
    assert (saved["kind"], saved["rank"], saved["step"]) == ("diverged", 1, 3)
    told = diagnose(out)
    assert told.state == "diverged"
    assert told.what == "diverged: the training loss became nan at step 3 (epoch 1) on rank 1"


def test_the_record_of_a_divergence_is_rank_0_s_even_when_another_rank_is_done_first(tmp_path: Path) -> None:
    # Every rank stops alike on a non-finite loss; torchrun ends the others once one has exited.
    # Rank 1 waits until rank 0 has recorded and said the ending (before, on a busy machine, rank 0
    # could be ended first: the launcher then recorded a bare usage error, with no rank or step).
    out = tmp_path / "run"
    res = run([*TRAIN, "--model", "failing_models:nan_on_rank_1_recorded_late", "--log-every", "1",
               "--checkpoint-every", "2", "--out", str(out)], cwd=SCRIPTS, timeout=180,
              env={**env(), "FAILING_MODELS_WAITING": str(tmp_path / "rank-1-waits")})
    assert res.returncode == 2, res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")] == [
        "scaleloop: error: the run diverged: the training loss became nan at step 3 (epoch 1) on rank 1; stopped "
        f"there and wrote no checkpoint of it; the newest valid checkpoint is {str(out / 'checkpoints' / 'step-00000002')!r} "
        f"(step 2); continue from it with gradient clipping: scaleloop train --out {out} --clip-grad 1.0, or start "
        "over with a lower --lr"], res.stderr
    saved = json.loads((out / "failure.json").read_text())
    assert (saved["kind"], saved["rank"], saved["epoch"], saved["step"]) == ("diverged", 1, 1, 3), saved
    assert not list(out.glob("usage-error-rank-*.txt"))


def test_a_stalled_rank_is_named_with_where_it_is_stuck(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Bounded by run()'s own timeout (180 s, far under the 30-minute default a lost --timeout would
    # leave): no measured time is asserted, which a slow machine could break.
    res = run([*TRAIN, "--model", "failing_models:stalls", "--timeout", "5", "--out", str(out)],
              cwd=SCRIPTS, timeout=180, env=env())
    assert res.returncode == 1, res.stderr
    report = report_of(res.stderr)
    assert len(report) <= 15, res.stderr
    assert report[0].startswith("scaleloop: error: the run stalled at epoch 1, step 3: rank 1 stopped taking part; "
                                "rank 0 gave up waiting after 5 s (--timeout)"), res.stderr
    assert f"  rank 1 was at: {MODELS}:{line_of('SLEEP-LINE')} in forward" in report
    assert "  rank 0 waited in: gradient all-reduce in backward (DDP)" in "\n".join(report)
    assert "Traceback" not in res.stderr
    saved = json.loads((out / "failure.json").read_text())
    assert saved["kind"] == "stalled" and saved["rank"] == 1 and saved["step"] == 3
    assert saved["frame"] == f"{MODELS}:{line_of('SLEEP-LINE')} in forward"
    assert saved["waiting_in"] == "gradient all-reduce in backward (DDP)"
    told = diagnose(out)
    assert told.state == "stalled"
    assert told.what == (f"stalled: rank 1 stopped taking part at epoch 1, step 3, stuck at "
                         f"{MODELS}:{line_of('SLEEP-LINE')} in forward")
    assert "the other ranks waited in gradient all-reduce in backward (DDP)" in told.details


@pytest.mark.parametrize("model,place", [
    ("fails_in_evaluation", "in the evaluation after epoch 1: ValueError: bad test batch on rank 1"),
    ("fails_at_start", "while starting up (reading the data, building the model, its strategy and its optimizer): "
                       "ValueError: cannot build this model on rank 1"),
])
def test_a_failures_place_is_exact(tmp_path: Path, model: str, place: str) -> None:
    out = tmp_path / "run"
    res = run([*TRAIN, "--model", f"failing_models:{model}", "--max-steps", "3", "--out", str(out)], cwd=SCRIPTS,
              timeout=180, env=env())
    assert res.returncode == 1, res.stderr
    report = report_of(res.stderr)
    assert report[0] == f"scaleloop: error: rank 1 of 2 failed {place}", res.stderr
    told = diagnose(out)
    assert told.what.startswith(f"failed on rank 1 {place.partition(':')[0]}"), told.what


@pytest.mark.parametrize("model,said", [
    ("exits", "rank 1 of 2 exited with code 3 and no Python error"),
    ("killed", "rank 1 of 2 was killed by SIGKILL: most often the kernel's out-of-memory killer"),
])
def test_a_rank_that_dies_without_a_python_error_is_named(tmp_path: Path, model: str, said: str) -> None:
    out = tmp_path / "run"
    # Fresh workers: how a worker's death reaches the launcher is torchrun's subprocess handling
    # (a forked worker's is multiprocessing's, which reports a signal differently). The launcher
    # is a fork (it imports the model's module, and torch, to check it); its agent and workers
    # start fresh, as users' do (forked_launch.py).
    res = run([*TRAIN, "--model", f"failing_models:{model}", "--out", str(out)], cwd=SCRIPTS, timeout=180,
              env={**env(), FORK_LAUNCH_VAR: "0"})
    assert res.returncode == 1, res.stderr
    report = report_of(res.stderr)
    assert report[0].startswith(f"scaleloop: error: {said}"), res.stderr
    if model == "exits":
        assert "  its log ends with: rank 1: about to leave" in report, res.stderr
    assert "Traceback" not in res.stderr and "pair.cc" not in res.stderr    # C++ frames stay in the logs
    record = json.loads((out / "failure.json").read_text())
    assert record["rank"] == 1, record
    told = diagnose(out)
    assert "rank 1" in told.what and "rank-1.log" in "\n".join(told.lines()), told.lines()


@pytest.mark.parametrize("to", ["group", "launcher"])
def test_ctrl_c_prints_one_line(tmp_path: Path, to: str) -> None:
    """SIGINT to the group (a terminal's Ctrl-C), or to the launcher's pid alone (kill -INT PID,
    from a script or a scheduler): the run stops the same way."""
    out = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, "--epochs", "500", "--out", str(out)], cwd=SCRIPTS, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("epoch 2:"):  # training, with a checkpoint written
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(timeout=120), "".join(lines)
        before = sigint_state(proc.pid)   # for the message, if the interrupt goes unheard
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)  # as the terminal does: the whole foreground group
        else:
            os.kill(proc.pid, signal.SIGINT)
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    reader.join(timeout=10)
    said = [line for line in err.splitlines() if line.strip()]
    assert said == [f"scaleloop: interrupted; everything written so far is kept; continue from the last "
                    f"checkpoint with: scaleloop train --out {out}"], (
        f"{err}\nexit {proc.returncode}; launcher before the signal: {before}; this test's process: "
        f"{sigint_state(os.getpid())}; its last lines:\n" + "".join(lines[-5:]))
    assert proc.returncode == 130
    epochs = [line for line in (out / "metrics.csv").read_text().splitlines() if line.startswith("epoch,")]
    assert len(epochs) < 500, "the run went on to its end after the interrupt"
    assert json.loads((out / "failure.json").read_text())["kind"] == "interrupted"
    told = diagnose(out)
    assert told.state == "interrupted" and told.checkpoint is not None
    assert told.continue_with == f"scaleloop train --out {out}"


def verify_report(stdout: str) -> list[str]:
    """verify's failure report: from its first line to the line before verify's own verdict."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("scaleloop: error:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("verify: FAIL"))
    return lines[start:end]


def test_verify_names_a_raising_rank_in_a_few_lines(tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    res = run([*VERIFY, "--model", "failing_models:raises", "--report", str(report_dir)], cwd=SCRIPTS,
              timeout=180, env=env())
    assert res.returncode == 1, res.stdout + res.stderr
    report = verify_report(res.stdout)
    assert len(report) <= 15, res.stdout
    assert report[0] == "scaleloop: error: rank 1 of 2 failed at step 3: ValueError: bad batch on rank 1"
    assert report[1] == f"  raised at: {MODELS}:{line_of('RAISE-LINE')} in forward"
    assert f"  logs: {report_dir}/logs/rank-1.log (rank 1's full output)" in res.stdout
    assert "ValueError: bad batch on rank 1" in (report_dir / "logs" / "rank-1.log").read_text()
    assert "verdict: FAIL - the distributed run finished 2 of 3 step(s)" in res.stdout  # the steps before it
    for noise in ("Traceback", "Root Cause", "ChildFailedError", "no known cause"):
        assert noise not in res.stdout + res.stderr
    saved = json.loads((report_dir / "failure.json").read_text())
    assert (saved["kind"], saved["rank"], saved["step"], saved["error_type"]) == ("failed", 1, 3, "ValueError")


def test_verify_names_a_stalled_rank_and_where_it_is_stuck(tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    res = run([*VERIFY, "--model", "failing_models:stalls", "--timeout", "5", "--report", str(report_dir)],
              cwd=SCRIPTS, timeout=180, env=env())   # bounded by run()'s timeout, as above
    assert res.returncode == 1, res.stdout + res.stderr
    report = verify_report(res.stdout)
    assert len(report) <= 15, res.stdout
    assert report[0] == ("scaleloop: error: the run stalled at step 3: rank 1 stopped taking part; "
                         "rank 0 gave up waiting after 5 s (--timeout)"), res.stdout
    assert f"  rank 1 was at: {MODELS}:{line_of('SLEEP-LINE')} in forward" in report
    assert any(line.startswith("  rank 0 waited in: gradient all-reduce in backward (DDP)") for line in report)
    assert "Traceback" not in res.stdout + res.stderr


def test_bench_names_a_raising_worker_in_a_few_lines(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scaleloop", "bench", "scaling", "--quick", "--device", "cpu", "--workers", "1,2",
           "--model", "failing_models:raises", "--data", "digits", "--out", str(tmp_path / "out")]
    res = run(cmd, cwd=SCRIPTS, timeout=180, env={**env(), "TMPDIR": str(tmp_path)})  # the kept logs: in tmp_path
    assert res.returncode == 1, res.stdout + res.stderr
    report = report_of(res.stderr)
    assert len(report) <= 15, res.stderr
    assert report[0] == "scaleloop: error: rank 1 of 2 failed at step 3: ValueError: bad batch on rank 1"
    assert report[1] == f"  raised at: {MODELS}:{line_of('RAISE-LINE')} in forward"
    [kept] = tmp_path.glob("scaleloop-bench-*")
    assert f"  logs: {kept}/logs/rank-1.log (rank 1's full output)" in report[-1]
    assert "ValueError: bad batch on rank 1" in (kept / "logs" / "rank-1.log").read_text()
    for noise in ("Traceback", "Root Cause", "ChildFailedError", "exit code"):
        assert noise not in res.stdout + res.stderr


def test_a_usage_error_of_the_workers_is_said_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run([*TRAIN, "--model", "failing_models:bad_output", "--out", str(out)], cwd=SCRIPTS, timeout=180, env=env())
    assert res.returncode == 2, res.stdout + res.stderr
    said = [line for line in (res.stdout + res.stderr).splitlines()
            if "scaleloop: error" in line or "the model returned" in line or "Traceback" in line]
    assert said == ["scaleloop: error: the model returned a str; expected a tensor, a tuple or list whose first "
                    "element is the prediction, or a mapping or object with 'logits' (a Hugging Face ModelOutput) "
                    "or with its own 'loss'"], res.stdout + res.stderr
    assert not list(out.glob("usage-error*")), "the workers' messages are taken by the launcher"
    told = diagnose(out).what   # recorded by rank 0's loop, kept by the launcher
    assert told.startswith("stopped on bad input") and ": the model returned a str;" in told, told


def test_a_console_whose_reader_goes_away_does_not_stop_the_run(tmp_path: Path) -> None:
    """`scaleloop train --nproc 2 ... | head -1`: once the reader has gone, rank 0's prints go nowhere
    (launching.worker.Console); every rank trains on to the end, and the run's files are written.
    (A BrokenPipeError ended rank 0's run alone, and the other rank then waited for it.)"""
    out = tmp_path / "run"
    # The run's console is a pipe (a named one: the run is a fork of the tests' fork server, which
    # opens it for writing as the run's standard output; its standard error goes to /dev/null).
    console = tmp_path / "console"
    os.mkfifo(console)
    proc = ForkedRun([*TRAIN, "--max-steps", "4", "--out", str(out)], cwd=SCRIPTS, env=env(), timeout=180,
                     streams=(str(console), os.devnull))
    try:
        with open(console, "rb") as reader:   # opened once the run has opened its end
            first = reader.readline()         # the launcher's first line: the run is starting
        # (closed: the reader goes away, as `head -1` does)
        assert first.startswith(b"scaleloop:")
        assert proc.wait(timeout=180) == 0
    finally:
        kill_group(proc)
    rows = [line for line in (out / "metrics.csv").read_text().splitlines() if line.startswith("stop,")]
    assert rows and rows[-1].split(",")[2] == "4"   # the run reached its last step
    assert (out / "model.pt").is_file() and not (out / "failure.json").exists()
