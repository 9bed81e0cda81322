"""Engine URLs name hosts; each address a host resolves to is one engine.

`--engine http://engine:8200` under `docker compose up --scale engine=N` names N replicas: Docker's
DNS answers the service name with every running replica's address. The pool re-resolves each
configured URL on every poll and keeps one engine per address, so routing is least-loaded per
replica and each replica's health is its own; replicas that join are probed before they are
routed to, replicas that leave the answer leave the pool (requests running on them finish).
An IP literal is one engine and needs no DNS (`deepinfer up` passes 127.0.0.1 URLs).

IPv4 addresses are preferred: a name with both (`localhost`: 127.0.0.1 and ::1) is one engine,
not two. A name that fails to resolve keeps its last addresses (their probes tell whether they
still serve): a DNS hiccup must not empty the pool.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit, urlunsplit


def address_url(url: str, address: str) -> str:
    """`url` with its host replaced by `address` (an IP; IPv6 bracketed), port and path kept."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")


async def replica_urls(url: str) -> list[str]:
    """One URL per address `url`'s host resolves to, in address order. Raises OSError
    (socket.gaierror) when the name does not resolve, ValueError when the URL has no host."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"engine URL {url!r} has no host")
    try:
        return [address_url(url, str(ipaddress.ip_address(host)))]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    by_family = {family: sorted({info[4][0] for info in infos if info[0] == family}, key=ipaddress.ip_address)
                 for family in (socket.AF_INET, socket.AF_INET6)}
    addresses = by_family[socket.AF_INET] or by_family[socket.AF_INET6]
    if not addresses:
        raise OSError(f"{host} resolves to no IPv4 or IPv6 address")
    return [address_url(url, address) for address in addresses]
