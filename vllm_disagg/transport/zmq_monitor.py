"""A zmq socket's monitor, read through a PAIR socket: how decode, prefill's gatekeeper and the proxy learn of a
refused handshake or a dropped connection, which zmq does not report on the socket itself."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, TypeVar

import zmq

_ids = itertools.count()
_S = TypeVar("_S", bound="zmq.Socket[Any]")


def watch(ctx: zmq.Context[_S], sock: zmq.Socket[Any], events: int, name: str) -> _S:
    """A PAIR socket of ``ctx`` that receives ``sock``'s monitor events in ``events``.

    The endpoint is unique per call: pyzmq's default name reuses the socket's fd, which collides after fd reuse."""
    endpoint = f"inproc://vllm-disagg-{name}-monitor-{next(_ids)}"
    sock.monitor(endpoint, events)
    pair = ctx.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(endpoint)
    return pair


def unwatch(sock: zmq.Socket[Any], pair: zmq.Socket[Any]) -> None:
    """Stop ``sock``'s monitor and close the PAIR that read it (``sock`` stays open: closing it is the owner's)."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    pair.close(linger=0)
