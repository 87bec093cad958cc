"""Several runs at once, each as the tests' fork server runs one: ``python forkgroup.py SPEC.json``.

The fork server (``forkserver.py``) runs one request at a time, but the machines of one job (a
Kubeflow job's pods, a SLURM job's tasks, the launchers of ``--nnodes 2``) must all be running
for any of them to get past the rendezvous. Started as one request of the server, this script
forks every run of ``SPEC`` (a JSON object: ``runs``, a list of the server's requests, each with
an optional ``delay`` in seconds, an optional ``after`` (paths: the run starts once they all exist,
as a machine that comes back once the others wait for it), an optional ``code`` (a path that gets
its exit code as soon as it ends, while the others may go on) and an optional ``netns``; ``codes``,
the file that gets all their exit codes) and turns each fork into its run exactly as the server does (``forkserver._child``):
this process, like the server, has only imported modules, so its forks are as clean as the
server's. A run with ``netns`` first joins that network namespace as ``ip netns exec NETNS``
would (:func:`enter_network_namespace`): a pod of tests/distributed/test_kubernetes.py. It ends
once every run has ended.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from pathlib import Path

import forkserver

# <sched.h> and <sys/mount.h>
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_BIND, MS_REC, MS_SLAVE = 0x1, 0x1000, 0x4000, 0x80000
MNT_DETACH = 0x2


def enter_network_namespace(name: str) -> None:
    """Do what ``ip netns exec NAME`` does before it starts its command: join the network
    namespace ``ip netns add NAME`` made, in a mount namespace of this process's own (nothing
    mounted here reaches the host) where /sys describes that namespace's network and each file of
    /etc/netns/NAME is bind-mounted over its namesake in /etc (a pod's own /etc/hosts)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def call(what: str, result: int) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what} (joining network namespace {name!r}): {os.strerror(errno)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        call("setns", libc.setns(fd, CLONE_NEWNET))
    finally:
        os.close(fd)
    call("unshare", libc.unshare(CLONE_NEWNS))
    call("mount --make-rslave /", libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None))
    # As ip does: a /sys that cannot be unmounted is overlaid (read-only if it was).
    flags = 0
    if libc.umount2(b"/sys", MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = MS_RDONLY
    call("mount /sys", libc.mount(name.encode(), b"/sys", b"sysfs", flags, None))
    etc = Path("/etc/netns") / name
    for config in sorted(etc.iterdir()) if etc.is_dir() else []:
        call(f"bind-mount {config}", libc.mount(str(config).encode(), f"/etc/{config.name}".encode(), b"none",
                                                MS_BIND, None))


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    running: dict[int, dict] = {}   # pid: its request
    ended: dict[int, int] = {}      # pid: its exit code
    pids = []

    def reap(block: bool) -> None:
        """Collect the runs that have ended (``block``: wait for one), writing each one's ``code``."""
        while running:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                return
            ended[pid] = os.waitstatus_to_exitcode(status)
            request = running.pop(pid, {})
            if request.get("code"):
                # Written whole, then renamed: a test that polls for the file never reads it empty.
                code = Path(request["code"])
                code.with_name(code.name + ".part").write_text(str(ended[pid]), encoding="utf-8")
                code.with_name(code.name + ".part").replace(code)
            block = False

    started = time.monotonic()
    for request in spec["runs"]:
        # A later start (the second pod of a job) is part of what some runs check.
        time.sleep(max(0.0, float(request.get("delay", 0)) - (time.monotonic() - started)))
        while not all(os.path.exists(path) for path in request.get("after", [])):
            reap(block=False)
            time.sleep(0.02)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            if request.get("netns"):
                try:
                    enter_network_namespace(request["netns"])
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
            forkserver._child(request)   # never returns
        pids.append(pid)
        running[pid] = request
    while running:
        reap(block=True)
    Path(spec["codes"]).write_text(json.dumps([ended[pid] for pid in pids]), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
