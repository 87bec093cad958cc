"""Run scaleloop (and torchrun) in child processes, and never leave one behind."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

SRC = Path(__file__).resolve().parents[2] / "src"

# Every process a test starts carries this mark in its environment, and so do the processes
# they start in turn (torchrun's workers run in sessions of their own, and outlive a killed
# torchrun): it is how the tests find, and end, exactly the processes they started.
OWNER_VAR = "SCALELOOP_TEST_OWNER"
OWNER = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    env[OWNER_VAR] = OWNER
    return env


# Set to run every command in a fresh interpreter instead of a fork of the fork server.
FRESH_VAR = "SCALELOOP_TEST_FRESH"


class ForkServer:
    """This pytest process's client of ``forkserver.py`` (why it exists: that module's doc).

    One run at a time; the server is started at the first run and ends with this process
    (it reads its requests from a pipe that closes then).
    """

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._unread = b""   # the server's replies read from its pipe but not yet taken

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         bufsize=0)
            self._unread = b""
            ready = self._reply(120)
            assert "ready" in ready, ready
        return self.proc

    def _reply(self, timeout: Optional[float]) -> dict:
        """The server's next reply line. Read from the pipe's descriptor, never through a
        buffered reader: a reader could take two replies at once (a child that ended at once),
        and a wait on the descriptor would then miss the second."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._unread:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired("fork server", timeout or 0)
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the tests' fork server ended")
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: Sequence[str], *, cwd: Path, timeout: float, env: dict[str, str],
            merge: bool = False, sweep: bool = True, streams: Optional[tuple[str, str]] = None,
            on_start: Optional[Callable[[int], None]] = None) -> subprocess.CompletedProcess:
        """``cmd`` (``python -m M ...``, ``python -c CODE`` or ``python SCRIPT ...``) in a fork: its
        status and output (``merge``: the standard error in the output, as ``2>&1``). Its session is
        ended after it, and (``sweep``) every other process this test session started: False for a
        run that goes on beside one on another server (two machines at once), whose caller sweeps.
        ``streams``: the paths its standard output and error are opened at instead of files read back
        (none is returned): a terminal (a pseudo-terminal's other end, ``os.ttyname``, which becomes
        its controlling terminal, as ``pty.fork`` gives a child), a named pipe (a pipe's other end,
        as ``Popen(stdout=PIPE)`` gives one; the fork opens it for writing, so the caller opens it
        for reading), /dev/null. ``on_start(pid)``: called once the fork is there, with its pid."""
        with self._lock, tempfile.TemporaryDirectory(prefix="sl-fork-") as tmp:
            server = self._start()
            out = Path(tmp) / "stdout"   # what is read back: nothing for ``streams`` (read at their other end)
            err = out if merge else Path(tmp) / "stderr"
            to = streams or (str(out), str(err))
            server.stdin.write((json.dumps({"argv": list(cmd), "env": env, "cwd": str(cwd),  # type: ignore[union-attr]
                                            "stdout": to[0], "stderr": to[1]}) + "\n").encode())
            pid = self._reply(60)["pid"]
            if on_start is not None:
                on_start(pid)
            try:
                code = self._reply(timeout)["code"]
            except subprocess.TimeoutExpired:
                _kill_session(pid, sweep)
                self._reply(60)
                raise RunTimedOut(list(cmd), timeout, _text(out), None if merge else _text(err)) from None
            finally:
                _kill_session(pid, sweep)   # torchrun's workers, should any outlive it
            return subprocess.CompletedProcess(list(cmd), code, _text(out), None if merge else _text(err))


class RunTimedOut(subprocess.TimeoutExpired):
    """A run past its time limit, whose message ends with the last lines it printed (a hang inside
    the whole suite is then seen where it stopped)."""

    def __str__(self) -> str:
        said = "\n".join(f"{name}: {text[-3000:]}" for name, text in (("stdout", self.output), ("stderr", self.stderr))
                         if text)
        return f"{super().__str__()}; the last of what it printed:\n{said or '(nothing)'}"


def sigint_state(pid: int) -> str:
    """How process ``pid`` stands towards SIGINT, from the kernel (not Python's own record): for a
    test's message when an interrupt went unheard (ignored or blocked, e.g. inherited)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return f"pid {pid}: no /proc entry (ended)"
    bit = 1 << (signal.SIGINT - 1)
    said = {name: bool(int(fields[key].strip(), 16) & bit) for name, key in
            (("ignored", "SigIgn"), ("blocked", "SigBlk"), ("caught", "SigCgt"), ("pending", "SigPnd"))}
    return f"pid {pid} SIGINT: " + ", ".join(f"{name} {value}" for name, value in said.items())


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _kill_session(pid: int, sweep: bool = True) -> None:
    # Listed before the signal: a killed process soon cannot be recognised (kill_owned says why).
    listed = owned_pids() if sweep else []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if sweep:
        kill_owned(also=listed)


SERVER = ForkServer()


def forkable(cmd: Sequence[str]) -> bool:
    """Whether ``cmd`` can run as a fork of the server: this Python running a module, code or a script."""
    return (len(cmd) >= 2 and cmd[0] == sys.executable and os.environ.get(FRESH_VAR) != "1"
            and (cmd[1] in ("-m", "-c") and len(cmd) >= 3 or cmd[1].endswith(".py")))


def owned_pids() -> list[int]:
    """Live processes started (directly or not) by this test session (the fork server aside)."""
    mark = f"{OWNER_VAR}={OWNER}".encode()
    found = []
    skip = {os.getpid(), SERVER.pid}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_owned(wait_s: float = 30, also: Sequence[int] = ()) -> None:
    """SIGKILL every process this test session started that is still alive, and wait until each of
    them (and of ``also``: listed by :func:`owned_pids` before they were signalled) has ended (gone,
    or a zombie: its files, and so its flocks on a run directory, are closed).

    Why wait: a signal is delivered, not obeyed, by the time ``kill`` returns; a test that starts
    the next run at once could still find the killed one holding its run directory. Why ``also``:
    a process that is ending has given up its memory, and with it the environment that
    :func:`owned_pids` recognises, before it closes its files (torchrun's agent, killed with its
    launcher's process group, can hold the run directory's lock a while longer).
    """
    killed = owned_pids()
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    for pid in dict.fromkeys([*also, *killed]):
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def no_process_left(grace_s: float = 5) -> None:
    """After a test: processes that are ending on their own get ``grace_s``; any still running are
    the test's leak: they are ended, and the test fails so the leak is seen."""
    deadline = time.monotonic() + grace_s
    while owned_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = owned_pids()
    kill_owned()
    assert not left, f"the test left processes behind: {left}"


def _ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def run(cmd: Sequence[str], *, cwd: Path, timeout: float = 240, env: Optional[dict[str, str]] = None,
        fresh: bool = False, merge: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout or error kill the whole group.

    ``python -m M`` and ``python SCRIPT`` run as forks of the fork server (see ``forkserver.py``),
    and so do the torchrun agent and workers they launch (``forked_launch.py``), unless ``fresh``:
    a test of the interpreter's own start (its imports, its command line as ``ps`` shows it), and
    the tests of the users' path (``test_users_launch.py``), need fresh ones.
    """
    if not fresh and forkable(cmd):
        return SERVER.run(cmd, cwd=cwd, timeout=timeout, env=env or child_env(), merge=merge)
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    kill_group(proc)  # torchrun's workers, should any outlive it
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ForkedRun:
    """``cmd`` (as :func:`run` takes it) as a fork of the tests' fork server that goes on while the
    caller watches or signals it: what ``subprocess.Popen(cmd, start_new_session=True)`` gives, for
    a command the fork server runs. ``pid`` is the run's (its session's leader); its output is
    returned once it has ended (``communicate``). The server runs nothing else meanwhile.

    For a launcher whose agent and workers must start as users' do, pass
    ``SCALELOOP_TEST_FORK_LAUNCH=0`` in ``env`` (forked_launch.py): only the launcher is a fork."""

    def __init__(self, cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float,
                 merge: bool = False, streams: Optional[tuple[str, str]] = None) -> None:
        assert forkable(cmd), cmd
        self.args = list(cmd)
        self.returncode: Optional[int] = None
        started: list[int] = []
        ready = threading.Event()
        self._pool = ThreadPoolExecutor(1)
        self._done: Future = self._pool.submit(SERVER.run, cmd, cwd=cwd, timeout=timeout, env=env, merge=merge,
                                               streams=streams,
                                               on_start=lambda pid: (started.append(pid), ready.set()))
        while not ready.wait(0.1):
            if self._done.done():   # it could not start: say why
                self._done.result()
                raise RuntimeError(f"{cmd} ended before it started")
        self.pid = started[0]

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._done.done():
            self.returncode = self._done.result().returncode
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, Optional[str]]:
        """Its output and standard error (None with ``merge``) once it has ended (subprocess's
        TimeoutExpired after ``timeout`` seconds)."""
        try:
            res = self._done.result(timeout=timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        self.returncode = res.returncode
        return res.stdout, res.stderr

    def wait(self, timeout: Optional[float] = None) -> int:
        self.communicate(timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def end(self) -> None:
        """End it (its session) and every other process this test session started, and wait until
        the server has said so."""
        _kill_session(self.pid)
        try:
            self._done.result(timeout=60)
        except Exception:   # a timeout, a failure: the caller's own check says what went wrong
            pass
        self._pool.shutdown(wait=False)


def kill_group(proc: "subprocess.Popen | ForkedRun") -> None:
    """End ``proc``, its process group, and every other process this session started."""
    if isinstance(proc, ForkedRun):
        proc.end()
        return
    listed = owned_pids()   # before the signal (kill_owned says why)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    kill_owned(also=listed)
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def scaleloop(args: Sequence[str], *, cwd: Path, timeout: float = 240,
              fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m scaleloop <args>`` (``fresh``: every process a fresh interpreter, see :func:`run`);
    asserts success with the output in the message."""
    res = run([sys.executable, "-m", "scaleloop", *args], cwd=cwd, timeout=timeout, fresh=fresh)
    assert res.returncode == 0, f"scaleloop {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res
