"""Who may open a side-channel connection: with a shared secret, zmq's PLAIN handshake must carry a password
derived from it, checked (by a ZAP handler the engine's I/O thread answers) before zmq reads any message.

The side channel's own proofs (Hello, Describe, Release: each an HMAC) say who a message is from, but zmq reads a
whole multipart message into memory before the engine sees it, so a peer that proves nothing could still make an
instance buffer without bound. Refused at the handshake, such a peer has no message read at all. The password is
an HMAC of a fixed label, never the secret itself; PLAIN sends it in clear, so it keeps out hosts that lack the
secret, not one that watches the network. Without a secret nothing changes: zmq's NULL mechanism, as before.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from vllm_disagg import proof
from vllm_disagg.transport.zmq_monitor import unwatch, watch

logger = logging.getLogger("vllm_disagg.transfer")

# zmq asks the handler bound here in the socket's own context (ZAP, zmq RFC 27)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
USERNAME = b"vllm-disagg"
DOMAIN = b"vllm-disagg"
_LABEL = "vllm-disagg side channel zmq password v1"
_LOG_EVERY_S = 60.0  # one refusal line per peer address per minute: a peer retries every reconnect interval
_LOGGED_ADDRESSES = 1024  # the addresses remembered for that; forgotten all at once beyond it

# what a connecting socket's monitor reports when the other side refused the handshake
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

_Sock = TypeVar("_Sock", bound="zmq.Socket[Any]")


def password(secret: bytes) -> bytes:
    """The PLAIN password every holder of ``secret`` sends and expects."""
    return proof.make(secret, _LABEL).encode()


def as_client(sock: _Sock, secret: bytes | None) -> _Sock:
    """``sock`` ready to dial a side channel of an instance that has ``secret`` (unchanged without one). Set
    before ``connect``."""
    if secret:
        sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
        sock.setsockopt(zmq.PLAIN_PASSWORD, password(secret))
    return sock


def as_server(sock: _Sock, secret: bytes | None) -> _Sock:
    """``sock`` accepting only peers that prove ``secret`` (unchanged without one). Set before ``bind``, in a
    context whose ``Gatekeeper`` is already bound."""
    if secret:
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    return sock


def handshake_failure(event: int, value: int) -> str:
    """Why a connecting socket's handshake failed, as its monitor reported it, for a log line."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"it refused this side's credentials (status {value}): the shared_secret differs between them. Fix: "
            "give every instance and the proxy the same shared_secret (or VLLM_DISAGG_SECRET)"
        )
    return (
        f"the zmq handshake failed (protocol error {value:#x}): is it a vllm-disagg side channel? One side having "
        "a shared_secret and the other none, or a vllm-disagg too old to authenticate connections, fails this "
        "way too. Fix: the same shared_secret and vllm-disagg version on every instance and the proxy"
    )


class Gatekeeper:
    """Answers zmq's ZAP requests for one context: PLAIN with the secret's password passes, anything else is
    refused (and logged, at most once a minute per address). A peer that offers no credentials at all fails
    before any ZAP request; ``guard`` watches a listening socket for those. The owner polls ``sockets`` and calls
    ``answer``."""

    def __init__(
        self, ctx: zmq.Context[Any], secret: bytes, on_refused: Callable[[], None] | None = None
    ) -> None:
        self._ctx = ctx
        self._password = password(secret)
        self._on_refused = on_refused
        self._logged: dict[str, float] = {}
        self.refused = 0
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.sockets: list[zmq.Socket[Any]] = [self.sock]
        self._watched: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []

    def guard(self, listener: _Sock) -> _Sock:
        """``listener`` accepting only peers that prove the secret, its failed handshakes counted and logged."""
        as_server(listener, b"set")
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        monitor: zmq.Socket[Any] = watch(self._ctx, listener, events, "gate")
        self._watched.append((listener, monitor))
        self.sockets.append(monitor)
        return listener

    def answer(self, now: float, limit: int) -> None:
        """Answer the requests waiting and read the failed handshakes, at most ``limit`` of each (the I/O loop's
        per-socket share of a turn)."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.sock.send_multipart(self._verdict(frames, now))
        for _, monitor in self._watched:
            for _ in range(limit):
                try:
                    monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._refuse("a peer", "no credentials, or another zmq mechanism", now)

    def _verdict(self, frames: list[bytes], now: float) -> list[bytes]:
        request_id = frames[1] if len(frames) > 1 else b""
        if len(frames) >= 6 and frames[0] == b"1.0" and self._passes(frames[5], frames[6:]):
            return [b"1.0", request_id, b"200", b"OK", USERNAME, b""]
        address = frames[3].decode("utf-8", "replace") if len(frames) > 3 else "?"
        mechanism = frames[5].decode("utf-8", "replace") if len(frames) > 5 else "?"
        self._refuse(address, f"{mechanism}, wrong password", now)
        return [b"1.0", request_id, b"400", b"wrong or missing side-channel credentials", b"", b""]

    def _refuse(self, address: str, what: str, now: float) -> None:
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused()
        self._log(address, what, now)

    def _passes(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        return (
            mechanism == b"PLAIN"
            and len(credentials) == 2
            and credentials[0] == USERNAME
            and hmac.compare_digest(credentials[1], self._password)
        )

    def _log(self, address: str, what: str, now: float) -> None:
        last = self._logged.get(address)
        if last is not None and now - last < _LOG_EVERY_S:
            return
        if len(self._logged) >= _LOGGED_ADDRESSES:
            self._logged.clear()
        self._logged[address] = now
        logger.warning(
            "side channel: refused a connection from %s (%s): its credentials do not prove this instance's "
            "shared_secret. If it is one of this deployment's instances or its proxy, give it the same "
            "shared_secret and vllm-disagg version; otherwise keep the side-channel port private (refusals %d so "
            "far; one line per address a minute)",
            address,
            what,
            self.refused,
        )

    def close(self) -> None:
        for listener, monitor in self._watched:
            unwatch(listener, monitor)
        self.sock.close(linger=0)
