"""A worker's lifeline to the process that started it: when that process dies, so does this one.

``kill -9`` of a launcher gives it no chance to stop torchrun, and torchrun's workers run in
sessions of their own, so a signal to the launcher's process group never reaches them: they
would go on writing checkpoints into a run directory whose lock now looks stale. On Linux,
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill this process the moment its parent
ends, however it ends. Each link of the chain holds its own: the torchrun agent (the launcher's
child), each worker (the agent's child), and ``scaleloop.launch``'s agent (the caller's fork)
and workers.

The parent names itself in :data:`PARENT_VAR` of the child's environment (:func:`child_env`):
the child checks, right after asking, that it still has that parent, for the parent may have
died between starting the child and the request (then no signal would ever come).

Elsewhere (macOS, Windows) there is no such request: :func:`hold` does nothing there, and a
killed launcher's workers end only when their next collective or rendezvous fails.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Mapping, MutableMapping, Optional

# The pid of the process a child must not outlive; set by the parent in the child's environment.
PARENT_VAR = "SCALELOOP_LIFELINE_PARENT"
_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a child that holds its lifeline to this process."""
    return {**env, PARENT_VAR: str(os.getpid())}


def supported() -> bool:
    """Whether this platform can end a process with its parent (Linux)."""
    return sys.platform.startswith("linux")


def hold(parent: Optional[int] = None, environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """End this process (SIGKILL) when ``parent`` ends; from here on, this process's children
    started with this environment hold their lifeline to it.

    ``parent``: the pid to watch, by default the one in :data:`PARENT_VAR` (nothing to do when it
    is not set: this process was not started by scaleloop). Returns whether the lifeline is held.
    Where ``parent`` has ended already, this process ends now.
    """
    environ = os.environ if environ is None else environ
    if parent is None:
        named = environ.get(PARENT_VAR, "")
        if not named.isdigit():
            return False
        parent = int(named)
    held = supported() and _request_parent_death_signal()
    if held and not _still_there(parent):
        # The parent died before the request: the kernel will never send the signal.
        os.kill(os.getpid(), signal.SIGKILL)
    environ[PARENT_VAR] = str(os.getpid())   # for this process's own children
    return held


def _load_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl``, found once when this module is imported: a worker forked from a process
    with many threads (``scaleloop.launch`` inside a test run or a notebook) must not go looking
    for libraries (``find_library`` runs a subprocess) between the fork and its first step."""
    if not supported():
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl   # the running program's symbols: libc's among them
    except (OSError, AttributeError):  # no prctl: nothing to hold
        return None


_PRCTL = _load_prctl()


def _request_parent_death_signal() -> bool:
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _still_there(parent: int) -> bool:
    """Whether ``parent`` is still alive: it is this process's parent, or (a start method such as
    ``forkserver`` puts a process between them) it still exists."""
    if os.getppid() == parent:
        return True
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
