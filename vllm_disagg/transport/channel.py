"""Every message the transfer engine sends on its side channel leaves through one object.

Prefill answers decode, and pushes TCP data frames, through the ROUTER socket decode dialled; decode talks to a
prefill through that prefill's DEALER socket. Keeping all sends in one place is what lets tests drop, delay or
damage messages by wrapping this object (``transport/faults.py``) instead of branching in the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq

from vllm_disagg.wire import Message, encode

_SNDMORE = int(zmq.SNDMORE)

# Messages the I/O loop reads from one socket before it turns again (deadlines, commands, the other sockets): a
# peer that floods delays its own messages, not everyone's work.
MESSAGES_PER_TURN = 256


class SideChannel:
    """The engine's sends; all run on the I/O thread, which owns the sockets."""

    def __init__(self, router: zmq.Socket[Any]) -> None:
        self._router = router

    def reply(self, identity: bytes, msg: Message) -> None:
        """P -> D control message. A decode that went away is not an error here (its loads fail on its side)."""
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([identity, *encode(msg)])

    def send_layer(self, identity: bytes, frames: list[Any]) -> zmq.MessageTracker | None:
        """P -> D: one layer's encoded header and block frames. A frame below zmq's copy threshold is copied by zmq
        at once; larger ones go zero-copy, and the tracker (None: none did) says when zmq stopped reading them.
        Raises zmq.ZMQError when decode is unreachable.

        Frames are sent one by one with plain int flags: pyzmq's ``send_multipart`` costs several times as much
        per frame (type checks, a tracked Frame object even for frames it then copies, enum arithmetic), which a
        prefill pays for every layer of every step."""
        send, threshold = self._router.send, self._router.copy_threshold
        last = len(frames) - 1
        send(identity, _SNDMORE)
        tracked: list[zmq.MessageTracker] = []
        for i, frame in enumerate(frames):
            flags = 0 if i == last else _SNDMORE
            if memoryview(frame).nbytes < threshold:
                send(frame, flags)
            else:
                tracked.append(send(frame, flags, copy=False, track=True))
        if not tracked:
            return None
        return tracked[0] if len(tracked) == 1 else zmq.MessageTracker(*tracked)

    def tell(self, sock: zmq.Socket[Any], msg: Message) -> bool:
        """D -> P control message on that prefill's connection; False when it could not be queued.

        Never blocks: a DEALER whose only connection zmq tore down (the far end failed the ZMTP handshake, e.g. a
        port that is not a side channel) has no peer left, and a blocking send there would wait forever."""
        try:
            sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again included: nobody to send to
            return False
        return True

    def poll(self, now: float) -> None:
        """Called on every turn of the I/O loop; nothing is deferred here (a fault wrapper sends what it delayed)."""
        return None
