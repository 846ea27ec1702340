"""A stand-in for a vLLM instance's probe routes (/health, /v1/models, /metrics) on a real socket, for registry
tests that need an instance to go down and come back without starting vLLM."""

from __future__ import annotations

import asyncio
import json


class FakeInstance:
    """HTTP/1.1 keep-alive server on 127.0.0.1; ``stop`` closes the listener and every open connection, so the next
    probe is refused as it would be by a dead instance."""

    def __init__(self, port: int, model: str = "m", max_model_len: int = 2048, metrics: str = "") -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.routes = {
            "/health": (200, b""),
            "/v1/models": (
                200,
                json.dumps({"data": [{"id": model, "max_model_len": max_model_len}]}).encode(),
            ),
            "/metrics": (200, metrics.encode()),
        }
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> FakeInstance:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                self.requests.append(path)
                status, body = self.routes.get(path, (404, b'{"detail":"Not Found"}'))
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
