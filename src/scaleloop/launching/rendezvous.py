"""The c10d rendezvous of a multi-machine job: which address this machine has, and whether it hosts.

torchrun decides both from host names: a machine hosts the rendezvous store when the endpoint's
name matches its own, and it tells the other machines to reach it at ``socket.getfqdn()``. Both
go wrong where a host name resolves to an address the others cannot use (an ``/etc/hosts``
entry of ``127.0.1.1``, containers, network namespaces): the job then waits at the rendezvous
or fails with "connection refused". scaleloop asks the network instead and passes the answers
to torchrun explicitly (``--local-addr`` and ``--rdzv-conf is_host=...``).
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Any, Callable, Optional, TypeVar

from scaleloop.config import conf_pairs, split_endpoint  # noqa: F401 (split_endpoint re-exported; both parsed with the config)

T = TypeVar("T")




def route_address(host: str, port: int) -> Optional[str]:
    """The address of this machine's interface that reaches ``host`` (None if it cannot be found).

    A UDP socket's ``connect`` only chooses the route (nothing is sent), so this works before
    the other machine listens.
    """
    return _first_socket(host, port, socket.SOCK_DGRAM, lambda probe, address: (
        probe.connect(address), str(probe.getsockname()[0]))[1])


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one a socket here can bind to."""
    return _first_socket(host, 0, socket.SOCK_STREAM, lambda probe, address: probe.bind(address) or True) is not None


def _first_socket(host: str, port: int, kind: int, use: Callable[[socket.socket, Any], T]) -> Optional[T]:
    """``use(socket, address)`` for each address ``host`` resolves to, until one does not raise."""
    try:
        infos = socket.getaddrinfo(host, port, type=kind)
    except (OSError, UnicodeError):
        return None
    for family, sock_kind, proto, _name, address in infos:
        try:
            with socket.socket(family, sock_kind, proto) as probe:
                return use(probe, address)
        except OSError:
            continue
    return None




def rdzv_conf(user_conf: Optional[str], host: str) -> str:
    """torchrun's ``--rdzv-conf``: the user's settings, plus ``is_host`` where they did not set it."""
    pairs = conf_pairs(user_conf)
    if not any(p.partition("=")[0].strip() == "is_host" for p in pairs) and not _is_loopback(host):
        # (A loopback endpoint is left to torchrun: several "machines" on one host all match it,
        # and torchrun then lets the first to bind host the store and the others join it.)
        pairs.append(f"is_host={'true' if is_this_machine(host) else 'false'}")
    return ",".join(pairs)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
