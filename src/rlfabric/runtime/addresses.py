"""The addresses a service binds and the ones it announces to others.

A service binds `server.host`; the address it announces (in the replica registry, in GetInfo) must be one
its peers can reach. That is the bind host when the service binds one address, and something else when it
binds every interface (0.0.0.0, ::) or sits behind NAT: then `advertise_address` names it.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
"""Bind hosts that mean every interface: no peer can use one as an address."""


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARD_HOSTS


def split_host_port(address: str) -> tuple[str, int | None]:
    """ "h:1" -> ("h", 1); "h" -> ("h", None); "[::1]:1" -> ("::1", 1); "::1" (bare IPv6) -> ("::1", None)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, None


def join_host_port(host: str, port: int) -> str:
    """host:port, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def announced_address(bind_host: str, port: int, advertise_address: str | None) -> str:
    """The host:port a service announces: `advertise_address` when set (its port, else the bound one),
    else the bind host with the bound port. A wildcard bind host without an advertise address is a
    ValueError (the config validators refuse it before anything binds)."""
    if advertise_address:
        host, advertised_port = split_host_port(advertise_address)
        return join_host_port(host, advertised_port or port)
    if is_wildcard(bind_host):
        raise ValueError(f"bound to {bind_host!r} (every interface): set advertise_address")
    return join_host_port(bind_host.strip("[]"), port)


def check_advertise_address(address: str) -> str:
    """Validates an `advertise_address` value (host or host:port, not a wildcard); returns it."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        raise ValueError(f"not host or host:port: {address!r}") from None
    if not host or is_wildcard(host):
        raise ValueError(f"must name an address peers can reach, not {address!r}")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port out of range in {address!r}")
    return address


def route_source(host: str) -> str:
    """The local address this machine sends from to reach `host` (its own address when `host` is local):
    the address to bind so that `host`'s side can connect back. No packet is sent (a UDP socket's connect
    only asks the routing table). Raises OSError when no route leads to `host`."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
