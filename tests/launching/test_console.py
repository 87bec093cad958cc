"""A run's console once its reader has gone (scaleloop.launching.console): writes go nowhere and
the run trains on (`scaleloop train ... | head`)."""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from scaleloop.launching.console import Console, console_stream, kept_console

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC.parent / "tests" / "distributed"))
from procs import ForkedRun, child_env, kill_group  # noqa: E402


def test_writes_after_the_reader_has_gone_go_nowhere() -> None:
    read, write = os.pipe()
    stream = console_stream(write, sys.stdout, "strict")
    try:
        stream.write("seen\n")
        assert os.read(read, 100) == b"seen\n"
        os.close(read)                       # the reader goes away
        stream.write("lost\n")               # no BrokenPipeError
        stream.write("lost too\n")
        assert isinstance(stream.buffer, Console) and stream.buffer.gone   # type: ignore[attr-defined]
    finally:
        os.close(write)


def test_captured_streams_are_left_as_they_are() -> None:
    captured = io.StringIO()               # no file descriptor (as pytest's capsys)
    saved = sys.stdout
    sys.stdout = captured
    try:
        with kept_console():
            assert sys.stdout is captured
            print("kept")
    finally:
        sys.stdout = saved
    assert captured.getvalue() == "kept\n"


def test_a_workers_streams_to_the_console_and_its_log_are_left_as_they_are() -> None:
    """Rank 0's streams in a worker (launching.worker's tee, ``console_kept``) write to the console and
    the rank's log: replaced by the console alone, the log would get none of the rank's lines."""
    class Tee(io.StringIO):
        console_kept = True

        def fileno(self) -> int:
            return 1

    tee, saved = Tee(), sys.stdout
    sys.stdout = tee
    try:
        with kept_console():
            assert sys.stdout is tee
            print("kept")
    finally:
        sys.stdout = saved
    assert tee.getvalue() == "kept\n"


def test_a_one_process_run_piped_into_head_trains_to_its_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Its standard output a pipe (a named one: the run is a fork of the tests' fork server, which opens
    # it for writing), its standard error /dev/null.
    console = tmp_path / "console"
    os.mkfifo(console)
    proc = ForkedRun([sys.executable, "-m", "scaleloop", "train", "--epochs", "3", "--no-progress",
                      "--no-tensorboard", "--out", str(out)], cwd=tmp_path, env=child_env(), timeout=300,
                     streams=(str(console), os.devnull))
    try:
        with open(console, "rb") as reader:  # opened once the run has opened its end
            first = reader.readline()
            while first.startswith(b"start-up:"):   # a slow start-up (a loaded machine) is said before the run's first line
                first = reader.readline()
        assert first.startswith(b"scaleloop:")   # (and the reader is gone, as `head -1` does)
        assert proc.wait(timeout=300) == 0
    finally:
        kill_group(proc)
    epochs = [line for line in (out / "metrics.csv").read_text().splitlines() if line.startswith("epoch,")]
    assert [row.split(",")[1] for row in epochs] == ["1", "2", "3"]
    assert (out / "model.pt").is_file() and not (out / "failure.json").exists()


def test_a_terminal_stays_a_terminal() -> None:
    # The progress bar draws only on a terminal: the stream must say it is one when its fd is.
    import pty

    main_fd, tty_fd = pty.openpty()
    try:
        assert console_stream(tty_fd, sys.stdout, "strict").isatty()
        read, write = os.pipe()
        assert not console_stream(write, sys.stdout, "strict").isatty()
        os.close(read)
        os.close(write)
    finally:
        os.close(main_fd)
        os.close(tty_fd)
