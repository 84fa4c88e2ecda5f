"""Network addresses as the daemon judges them: which host is loopback.

One rule for the two places that ask: the config (may the HTTP front listen
there without an ``api_key``?) and the HTTP guard (may a request's ``Host``
name us?).
"""

from __future__ import annotations

import ipaddress

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_address(name: str) -> IpAddress | None:
    """``name`` as an IP address (IPv6 in brackets or not), or None for a name."""
    try:
        return ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback: ``localhost`` (any case),
    an address of 127.0.0.0/8, ``::1``, or an IPv4-mapped loopback address
    (``::ffff:127.0.0.1``); IPv6 in brackets or not. Other names do not
    count: what they resolve to can change."""
    if host.lower() == "localhost":
        return True
    ip = ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # Python before 3.13 calls ::ffff:127.0.0.1 not loopback
    return ip is not None and ip.is_loopback
