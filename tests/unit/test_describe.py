"""The proxy asking an instance's side channel for its KV geometry, over real sockets."""

from __future__ import annotations

import asyncio

from support.listeners import Listener

from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.instances import InstanceRegistry
from vllm_disagg.router.upstream import UpstreamPool


def test_describing_a_port_that_answers_garbage_gives_up_at_the_deadline() -> None:
    """A side channel address that is some other service: zmq's handshake fails and leaves the socket no peer, so
    the whole question (send included) must end, at the describe deadline or when the monitor reports the failed
    handshake, whichever is first."""
    sink = Listener(garbage=True)

    async def scenario() -> list[str]:
        reg = InstanceRegistry(UpstreamPool(1.0, 1.0, 5.0), describe_timeout_s=0.3)
        cfg = InstanceConfig(
            url="http://p:8000", role="prefill", id="p", side_channel=f"127.0.0.1:{sink.port}"
        )
        try:
            return [(await reg._ask_geometry(cfg))[1] for _ in range(20)]
        finally:
            reg.probes.close()

    try:
        # A hang fails here (the bound is far above 20 deadlines), whatever this machine's speed.
        whys = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        sink.close()
    assert sink.accepted > 0
    assert all(
        "did not answer within 0.3 s" in why or "is it a vllm-disagg side channel?" in why for why in whys
    ), whys
