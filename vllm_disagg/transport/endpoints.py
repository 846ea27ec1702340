"""zmq TCP endpoints for side channels: IPv4 addresses, hostnames and IPv6 literals alike.

zmq reads ``tcp://[::1]:5700`` only from a socket with ``zmq.IPV6`` set (which also keeps IPv4 working), and an
IPv6 literal needs its brackets in the endpoint; kv_transfer_params and ``side=HOST:PORT`` may carry it with or
without them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import zmq

_Sock = TypeVar("_Sock", bound="zmq.Socket[Any]")


def bare_host(host: str) -> str:
    """``host`` without the brackets an IPv6 literal may come in."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def bracketed(host: str) -> str:
    """``host`` as it stands in a URL or endpoint: an IPv6 literal in brackets (once), anything else as is."""
    bare = bare_host(host)
    return f"[{bare}]" if ":" in bare else bare


def tcp_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://HOST[:PORT]``, an IPv6 literal in brackets."""
    return f"tcp://{bracketed(host)}" if port is None else f"tcp://{bracketed(host)}:{port}"


def dual_stack(sock: _Sock) -> _Sock:
    """``sock`` able to bind IPv6 as well as IPv4."""
    sock.setsockopt(zmq.IPV6, 1)
    return sock


def for_host(sock: _Sock, host: str) -> _Sock:
    """``sock`` ready to dial ``host``: IPv6 only for an IPv6 literal. With ``zmq.IPV6`` set, zmq resolves a name to
    its IPv6 address first (``localhost`` to ::1 where /etc/hosts says so, as in many containers), and a prefill
    bound to 0.0.0.0 does not listen there."""
    if ":" in bare_host(host):
        sock.setsockopt(zmq.IPV6, 1)
    return sock
