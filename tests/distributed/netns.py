"""Two "machines" on one host: network namespaces joined by a veth pair (needs root and iproute2)."""
from __future__ import annotations

import contextlib
import os
import shutil
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
