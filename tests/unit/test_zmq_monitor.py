"""watch/unwatch: a monitor PAIR per socket that sees its events, on unique endpoints."""

from __future__ import annotations

import zmq

from vllm_disagg.transport.zmq_monitor import unwatch, watch


def test_watch_reports_events_and_unwatch_stops_them() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        clients = [ctx.socket(zmq.DEALER) for _ in range(2)]
        pairs = [watch(ctx, c, zmq.EVENT_CONNECTED, "test") for c in clients]
        for c in clients:
            c.connect(f"tcp://127.0.0.1:{port}")
        for pair in pairs:  # each PAIR hears its own socket's connection (two watches: two endpoints)
            assert pair.poll(5000), "no monitor event"
            pair.recv_multipart()
        for c, pair in zip(clients, pairs, strict=True):
            unwatch(c, pair)
            assert pair.closed and not c.closed
            unwatch(c, pair)  # twice is harmless: a close path may run after an error path
            c.close(linger=0)
        server.close(linger=0)
    finally:
        ctx.term()
