"""Machines on one host: network namespaces joined by veth pairs (needs root and iproute2)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str


def can_make_namespaces() -> str | None:
    """None if this process can create namespaces, else the reason it cannot."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts(tag: str) -> Iterator[tuple[Host, Host]]:
    """Namespaces ``<tag>a``/``<tag>b`` with 10.231.7.1 and .2 on a veth pair; always removed."""
    a = Host(f"{tag}a", f"v{tag}a", "10.231.7.1")
    b = Host(f"{tag}b", f"v{tag}b", "10.231.7.2")
    made: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for host in (a, b):
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield a, b
    finally:
        # Deleting a namespace also deletes the veth end inside it (and so its peer).
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@contextlib.contextmanager
def hosts(tag: str, n: int, subnet: str = "10.231.8") -> Iterator[list[Host]]:
    """``n`` namespaces ``<tag>0..`` at ``<subnet>.1..n``, each with a veth pair to a bridge in
    namespace ``<tag>hub``, so that one machine can be cut off (:func:`cut`) while the others
    still reach each other; all removed on exit. ``Host.interface`` is the machine's end."""
    hub = f"{tag}hub"
    machines = [Host(f"{tag}{i}", f"v{tag}{i}", f"{subnet}.{i + 1}") for i in range(n)]
    made: list[str] = []
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, host in enumerate(machines):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            peer = f"h{tag}{i}"
            _ip("link", "add", host.interface, "type", "veth", "peer", "name", peer)
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("link", "set", peer, "netns", hub)
            _ip("-n", hub, "link", "set", peer, "master", "br0")
            _ip("-n", hub, "link", "set", peer, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield machines
    finally:
        # Processes outlive their namespace's deletion: end the ones left in these (all started by
        # the test), then delete; deleting a namespace deletes the veth ends inside it, and their peers.
        for name in made:
            kill_inside(name)
        for name in reversed(made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def kill_inside(namespace: str) -> list[int]:
    """SIGKILL every process in ``namespace`` (a machine dying); returns their ids."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in found:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return [int(p) for p in found if p.isdigit()]


def cut(host: Host) -> None:
    """Take the machine's network link down: its processes keep running, unreachable."""
    _ip("-n", host.namespace, "link", "set", host.interface, "down")


def reconnect(host: Host) -> None:
    """Bring the machine's link back up."""
    _ip("-n", host.namespace, "link", "set", host.interface, "up")
