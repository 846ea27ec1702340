"""A raw peer on a transfer engine's side channel: any frames in, replies out, and the refusal check."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from support.transfer_engines import geometry
from vllm_disagg import __version__
from vllm_disagg.transport.engine import TransferEngine
from vllm_disagg.transport.zmq_auth import Gatekeeper, as_client
from vllm_disagg.wire import Abort, Heartbeat, HelloAck, Message, Refuse, decode, encode, make_hello

_ids = itertools.count()


class RawPeer:
    """A hand-driven DEALER: sends arbitrary frames to an engine's ROUTER and reads what comes back. ``secret``:
    the zmq credentials it dials with (an engine with a secret reads nothing from a peer without them)."""

    def __init__(self, port: int, secret: bytes | None = None) -> None:
        self.sock: zmq.Socket[Any] = as_client(zmq.Context.instance().socket(zmq.DEALER), secret)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 5.0) -> Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply from the engine within {timeout} s")
        msg, _ = decode(self.sock.recv_multipart())
        return msg

    def drain(self, quiet: float = 0.05) -> list[Message]:
        out = []
        while self.sock.poll(int(quiet * 1000)):
            out.append(decode(self.sock.recv_multipart())[0])
        return out

    def handshake(self, secret: bytes | None) -> None:
        self.send(encode(make_hello(secret, f"raw-{next(_ids)}", geometry(), __version__)))
        reply = self.recv()
        assert isinstance(reply, HelloAck), reply

    def sync(self, tag: str) -> list[Message]:
        """Replies up to a marker: after a handshake, a Heartbeat for an unknown id is answered by an Abort."""
        self.send(encode(Heartbeat(transfer_ids=[tag])))
        seen: list[Message] = []
        while True:
            msg = self.recv()
            if isinstance(msg, Abort) and msg.transfer_id == tag:
                return seen
            seen.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)


def refusals(engine: TransferEngine) -> float:
    return engine.stats["messages_rejected"] + engine.stats["handshakes_refused"]


def expect_refused(engine: TransferEngine, peer: RawPeer, frames: Sequence[bytes]) -> Refuse:
    """Exactly one Refuse back, exactly one more refusal counted, and the I/O thread still running."""
    before = refusals(engine)
    peer.send(frames)
    reply = peer.recv()
    assert isinstance(reply, Refuse), reply
    assert refusals(engine) == before + 1  # counted on the I/O thread before it replied
    assert engine._thread.is_alive()
    return reply


def guarded_router(secret: bytes | None) -> zmq.Socket[Any]:
    """A ROUTER that, like a prefill's side channel, accepts only peers whose zmq credentials prove ``secret``
    (any peer without one): its own context, with a thread answering zmq's ZAP requests until it is closed."""
    if not secret:
        return zmq.Context.instance().socket(zmq.ROUTER)
    ctx: zmq.Context[Any] = zmq.Context()
    gate = Gatekeeper(ctx, secret)
    sock = gate.guard(ctx.socket(zmq.ROUTER))

    def answer() -> None:
        poller = zmq.Poller()
        for s in gate.sockets:
            poller.register(s, zmq.POLLIN)
        while not sock.closed:
            if poller.poll(50):
                gate.answer(time.monotonic(), 64)
        gate.close()
        ctx.term()

    threading.Thread(target=answer, name="test-zap", daemon=True).start()
    return sock
