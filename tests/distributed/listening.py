"""The TCP ports a process tree listens on, read from /proc (Linux): which address each binds."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue   # ended meanwhile
            parents[int(entry.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _address(hex_addr: str) -> str:
    if len(hex_addr) == 8:   # IPv4, little-endian
        return str(ipaddress.IPv4Address(bytes.fromhex(hex_addr)[::-1]))
    words = [bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, 32, 8)]
    return str(ipaddress.IPv6Address(b"".join(words)))


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = _socket_inodes(pids)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:   # 0A: LISTEN
                addr, port = local.rsplit(":", 1)
                found.add((_address(addr), int(port, 16)))
    return found
