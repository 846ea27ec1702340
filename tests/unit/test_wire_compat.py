"""Peers of another wire version are refused with a reason that names both versions (wire v3 changed the Hello)."""

from __future__ import annotations

import time

import msgspec
from support.side_channel_peer import RawPeer
from support.transfer_engines import geometry, make

from vllm_disagg import __version__
from vllm_disagg.wire import MAGIC, WIRE_VERSION, Refuse


def test_a_wire_v2_hello_is_refused_naming_both_versions() -> None:
    """A v2 decode's Hello, as it was encoded (transports + nixl fields), reaches a v3 prefill."""
    p = make("P", seed=1, transport="tcp")
    peer = RawPeer(p.port)
    try:
        v2_hello = {
            "type": "hello",
            "wire_version": 2,
            "connector_version": __version__,
            "engine_id": "old-decode",
            "geometry": msgspec.to_builtins(geometry()),
            "nonce": "n",
            "ts": time.time(),
            "auth": "",
            "transports": ["nixl", "tcp"],
            "nixl": None,
        }
        peer.send([MAGIC, msgspec.msgpack.encode(v2_hello)])
        reply = peer.recv()
        assert isinstance(reply, Refuse) and reply.field == "wire_version"
        assert (reply.ours, reply.theirs) == ("2", str(WIRE_VERSION))  # the decode's view
        assert f"prefill speaks {WIRE_VERSION}, decode 2" in reply.reason
        assert p.stats["handshakes_refused"] == 1
    finally:
        peer.close()
        p.close()
