"""Listening ports given on the command line: checked before a command starts anything.

`check_listen(host, port, flag)` raises `PortInUseError` when another process listens there
and `CannotListenError` when the host is not an address of this machine, each naming the flag
that sets it; `listen_error` words a bind failure that slipped past the check (a port taken in
between) the same way. `free_ports` picks ports for processes a command starts itself.
"""

from __future__ import annotations

import errno
import socket

from evolving_infra.errors import CommandError, os_error_line

WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")
LOOPBACK = "127.0.0.1"  # where a command's own processes listen


class PortInUseError(CommandError):
    """Another process listens on the port; `flag` is the option that chooses another."""

    def __init__(self, host: str, port: int, flag: str) -> None:
        self.host = host
        self.port = port
        self.flag = flag
        super().__init__(
            f"cannot listen on {_address(host, port)}: port {port} is taken",
            f"choose another with {flag} (0: any free port)",
        )


class CannotListenError(CommandError):
    """The host is not one this machine can listen on (not its address, not resolvable)."""

    def __init__(self, host: str, port: int, reason: str, flag: str = "--host") -> None:
        self.host = host
        self.port = port
        super().__init__(
            f"cannot listen on {_address(host, port)}: {reason}",
            f"give {flag} an address of this machine (127.0.0.1, 0.0.0.0)",
        )


def _address(host: str, port: int) -> str:
    """`host:port` (`[host]:port` for IPv6), the host alone for port 0 (any free port)."""
    host = host.strip("[]") or "*"
    if port == 0:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_listen(host: str, port: int, flag: str, *, host_flag: str = "--host") -> None:
    """Raises unless a listener could bind `host:port` now (asyncio's way: SO_REUSEADDR, IPv6
    sockets IPv6-only), so that a command fails before it starts anything. Port 0 (any free
    port) checks the host only."""
    name = None if host.strip("[]") in WILDCARDS else host.strip("[]")
    try:
        found = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        reason = (e.strerror or str(e)).lower()
        raise CannotListenError(host, port, reason, host_flag) from None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise listen_error(e, host, port, flag, host_flag=host_flag) from None


def port_taken(host: str, port: int) -> bool:
    """Whether another process listens on `host:port` now."""
    try:
        check_listen(host, port, "")
    except PortInUseError:
        return True
    except CommandError:
        return False
    return False


def listen_error(
    e: OSError, host: str, port: int, flag: str, *, host_flag: str = "--host"
) -> CommandError:
    """The error line for a failed bind of `host:port` (`flag` chooses the port)."""
    if e.errno == errno.EADDRINUSE or "address already in use" in str(e).lower():
        return PortInUseError(host, port, flag)
    if e.errno is None and port and port_taken(host, port):  # grpc's bind error has no errno
        return PortInUseError(host, port, flag)
    if e.errno in (errno.EADDRNOTAVAIL, errno.ENODEV) or isinstance(e, socket.gaierror):
        return CannotListenError(host, port, (e.strerror or str(e)).lower(), host_flag)
    if e.errno == errno.EACCES:
        return CommandError(
            f"cannot listen on {_address(host, port)}: permission denied",
            f"ports below 1024 need root; choose another with {flag}",
        )
    return CommandError(f"cannot listen on {_address(host, port)}: {os_error_line(e)}")


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports the kernel reports free on `host` right now (a wildcard: on
    every address; IPv6 for an IPv6 host).

    All sockets stay open until every port is picked, so the kernel cannot hand one out twice
    (picked one at a time it may, and the second bind then fails with "Address already in
    use"); another process can still take one before its user binds it (the pool master's
    `start` retries).
    """
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("" if host in WILDCARDS else name, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
