"""A forked worker waits, before it touches the network, until the agent has forked all its siblings.

Why: the elastic agent that forks the workers has threads, among them its store's server, which
looks up the address of every worker that connects to it (glibc's ``getnameinfo``, under the
resolver's lock). A worker forked while that thread holds the lock inherits the lock held, with
no thread left to release it, and its own first lookup (the store's address, at
``init_process_group``) waits forever: seen about once in 60 launches of 4 workers on a 2-core
machine, the worker stuck in ``getaddrinfo`` -> ``__resolv_context_get``, the others at the
rendezvous until its timeout. A spawned worker (a fresh interpreter) cannot inherit a lock; a
forked one can, but not from a fork that happens before any worker has connected. So each
worker waits until the agent has as many children as there are workers on this machine: after
that, the agent forks no more in this attempt.

Linux tells a process's children in ``/proc/PID/task/TID/children``; elsewhere (or if it cannot
be read) the worker does not wait.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Optional

#: The longest a worker waits for its siblings; past it, it goes on (a sibling that failed to start).
WAIT_S = 30.0


def children_file(parent: int) -> Path:
    """Where Linux lists the children that ``parent``'s main thread forked."""
    return Path(f"/proc/{parent}/task/{parent}/children")


def count_children(listing: Path) -> Optional[int]:
    """How many processes ``listing`` names (None: it cannot be read)."""
    try:
        return len(listing.read_text().split())
    except OSError:
        return None


def wait_for_siblings(environ: Mapping[str, str] = os.environ, parent: Optional[int] = None,
                      listing: Optional[Path] = None, timeout_s: float = WAIT_S) -> bool:
    """Wait until the agent (``parent``, default this process's parent) has forked
    ``LOCAL_WORLD_SIZE`` workers. True once it has; False when there is nothing to wait for or
    the count cannot be read, or after ``timeout_s``."""
    local = environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 2:
        return False
    listing = listing or children_file(parent or os.getppid())
    deadline = time.monotonic() + timeout_s
    while True:
        count = count_children(listing)
        if count is None:
            return False
        if count >= int(local):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)   # the agent forks the next worker within milliseconds
