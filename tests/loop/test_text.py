"""The progress bar as a person sees it: ``scaleloop train`` run in a real pseudo-terminal (its
standard output and error, and its controlling terminal; the run a fork of the tests' fork server,
``tests/distributed/forkserver.py``, as the suite's other runs).

The bar says which loss it shows (that of the last ``--log-every`` steps: the epoch line prints
the epoch's mean), reads ``samples/s``, fits the terminal's width, and on a terminal that reports
0 columns draws nothing rather than lines that wrap into blank ones.
"""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest

from scaleloop.loop.text import BAR_FORMAT, UNSIZED_BAR_FORMAT, bar_postfix as _bar_postfix

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from procs import SERVER, child_env, forkable  # noqa: E402

BAR = re.compile(r"epoch 1/1: +\d+%\|")


def run_in_terminal(tmp_path: Path, columns: int, env_columns: Optional[str] = None) -> str:
    """``scaleloop train`` in a pseudo-terminal ``columns`` wide; everything it showed, as text."""
    argv = [sys.executable, "-m", "scaleloop", "train", "--data", "random", "--n-samples", "640", "--epochs", "1",
            "--batch-size", "32", "--log-every", "4", "--device", "cpu", "--no-checkpoints", "--tracker", "none",
            "--out", str(tmp_path / "run")]
    env = {k: v for k, v in (child_env() if forkable(argv) else os.environ).items()
           if k not in ("COLUMNS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT / "src")
    if env_columns is not None:
        env["COLUMNS"] = env_columns
    if forkable(argv):
        return _forked_in_terminal(argv, env, tmp_path, columns)
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    shown = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    text = shown.decode("utf-8", errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    return text


def _forked_in_terminal(argv: list[str], env: dict[str, str], cwd: Path, columns: int) -> str:
    """``argv`` as a fork of the tests' fork server, on a new pseudo-terminal ``columns`` wide; what
    it showed. This end of the terminal stays open until the run has ended, so that every read
    waits for output (none fails for want of a writer)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    shown = b""
    try:
        with ThreadPoolExecutor(1) as pool:
            ran = pool.submit(SERVER.run, argv, cwd=cwd, timeout=120, env=env,
                              streams=(os.ttyname(slave), os.ttyname(slave)))
            while not ran.done():
                if select.select([master], [], [], 0.1)[0]:
                    shown += os.read(master, 65536)
            code = ran.result().returncode
        os.close(slave)
        slave = -1
        while True:   # what is left, up to the terminal's end (EIO: no writer is left)
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    text = shown.decode("utf-8", errors="replace")
    assert code == 0, text
    return text


def screens(text: str) -> list[str]:
    """Every line as drawn: each carriage return redraws the line, each newline starts a new one."""
    return re.split(r"\r\n|\r|\n", text)


# Widths that hold the whole labelled line (about 92 columns with a 6-digit samples/s): narrower, tqdm
# trims its end, and whether "samples/s" survives would depend on how fast the machine ran.
@pytest.mark.parametrize("columns, env_columns, width", [(100, None, 100), (0, "120", 120)])
def test_the_bar_labels_its_loss_and_fits_the_terminal(tmp_path: Path, columns: int, env_columns: Optional[str],
                                                       width: int) -> None:
    text = run_in_terminal(tmp_path, columns, env_columns)
    bars = [line for line in screens(text) if BAR.match(line)]
    assert bars, text
    labelled = [line for line in bars if "samples/s" in line]
    assert labelled, bars
    assert re.search(r"loss \d+\.\d{4} \(last 4 steps\), grad norm [\d.e+-]+, [\d,]+ samples/s$", labelled[-1]), labelled[-1]
    assert "samples_s" not in text
    assert all(len(line) <= width for line in bars), max(bars, key=len)
    assert re.search(r"^epoch 1: train loss \d", text, re.MULTILINE)


@pytest.mark.parametrize("env_columns", [None, "0"])
def test_a_terminal_of_0_columns_gets_plain_lines(tmp_path: Path, env_columns: Optional[str]) -> None:
    text = run_in_terminal(tmp_path, 0, env_columns)
    assert "%|" not in text and "\r" not in text.replace("\r\n", ""), text   # no bar, nothing redrawn
    lines = text.split("\r\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1]), lines   # and no blank line
    assert any(line.startswith("epoch 1: train loss") for line in lines), lines
    assert any(line.startswith("summary") for line in lines), lines


def test_the_postfix_names_its_window() -> None:
    assert _bar_postfix(0.123456, 10, 12345.6) == "loss 0.1235 (last 10 steps), 12,346 samples/s"
    assert _bar_postfix(2.0, 1, 5.0) == "loss 2.0000 (last 1 step), 5 samples/s"


def test_token_data_shows_tokens_per_s_and_the_mfu_where_known() -> None:
    assert (_bar_postfix(2.5, 10, 100.0, 0.5123, 6400.0, 0.3814)
            == "loss 2.5000 (last 10 steps), grad norm 0.512, 6,400 tokens/s, MFU 38.1%")
    assert _bar_postfix(2.5, 10, 100.0, None, 6400.0, None) == "loss 2.5000 (last 10 steps), 6,400 tokens/s"


@pytest.mark.parametrize("total, fmt, drawn", [
    (20, BAR_FORMAT, r"epoch 1/3:  25%\|.*\| \S+ left, loss 0\.5000 \(last 4 steps\), 1,000 samples/s"),
    (None, UNSIZED_BAR_FORMAT, r"epoch 1/3: 5 steps \[\S+, loss 0\.5000 \(last 4 steps\), 1,000 samples/s\]"),
])
def test_a_pass_of_unknown_length_shows_steps_not_a_share(total: Optional[int], fmt: str, drawn: str) -> None:
    import io

    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(total=total, desc="epoch 1/3", bar_format=fmt, file=out, ncols=80, mininterval=0, miniters=1)
    bar.update(5)
    bar.set_postfix_str(_bar_postfix(0.5, 4, 1000.0))
    bar.close()
    last = out.getvalue().split("\r")[-1].rstrip("\n")
    assert re.fullmatch(drawn, last), last
