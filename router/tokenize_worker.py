"""Long prompts tokenized and hashed into prefix-index keys in a child process, so the event loop never waits for it.

A worker thread is not enough: ``tokenizers`` holds the GIL while it builds the id list (~4 ms for 90k tokens on
the development machine) and for parts of the encode, and the hashing is Python. The event loop then waits for the GIL
and every stream's relay stalls with it. The child shares no GIL; it runs at background priority (nice 10,
router/priority.py), so on a core it shares with the proxy it gets about a tenth of it. It returns the prompt's
token count and the chained keys of its whole blocks (``prefix_index.iter_block_keys``), a few KB where the ids
would be hundreds.

Protocol over the child's stdin/stdout, one request at a time in order: a request is ``<I`` length, ``<B`` add
special tokens, UTF-8 text; an answer is ``<I`` length and msgpack ``[count, [key, ...]]``, or ``[-1, message]`` when
the text could not be tokenized. All I/O is non-blocking on the event loop: no thread in the proxy's process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import struct
import sys
from typing import Any

import msgspec

from vllm_disagg.router.priority import background_priority

logger = logging.getLogger("vllm_disagg.proxy")

_REQ = struct.Struct("<IB")
_LEN = struct.Struct("<I")


class TokenizeWorkerError(RuntimeError):
    """The child could not answer (it died, or failed to start); the caller tokenizes another way."""


class TokenizeWorker:
    """The parent's side: ``encode_keys`` sends a text and awaits (token count, block keys). Started lazily, and
    again after the child dies; requests in flight then fail with ``TokenizeWorkerError``."""

    def __init__(self, tokenizer_dir: str, block_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.block_size = block_size
        self._proc: asyncio.subprocess.Process | None = None
        self._start_lock = asyncio.Lock()
        self._waiting: collections.deque[asyncio.Future[tuple[int, list[int]]]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async with self._start_lock:
            if self._reader is not None and not self._reader.done():
                return  # the child is up: its reader ends when it stops answering
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "vllm_disagg.router.tokenize_worker", self.tokenizer_dir,
                    str(self.block_size), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
            except OSError as exc:
                raise TokenizeWorkerError(f"tokenize worker did not start: {exc}") from exc
            self._reader = asyncio.create_task(self._read_answers(self._proc))

    async def encode_keys(self, text: str, add_special_tokens: bool) -> tuple[int, list[int]]:
        """(token count, keys of the whole blocks) of ``text``; ValueError when the tokenizer refuses it."""
        await self.start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        data = text.encode("utf-8", "surrogatepass")
        fut: asyncio.Future[tuple[int, list[int]]] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        proc.stdin.write(_REQ.pack(len(data), int(add_special_tokens)))
        proc.stdin.write(data)
        try:
            await proc.stdin.drain()
        except (ConnectionError, BrokenPipeError) as exc:
            self._fail_all(f"tokenize worker pipe closed: {exc}")
        return await fut

    async def _read_answers(self, proc: asyncio.subprocess.Process) -> None:
        out = proc.stdout
        assert out is not None
        decode = msgspec.msgpack.Decoder().decode
        try:
            while True:
                (n,) = _LEN.unpack(await out.readexactly(_LEN.size))
                answer = decode(await out.readexactly(n))
                fut = self._waiting.popleft()
                if fut.done():
                    continue
                if answer[0] < 0:
                    fut.set_exception(ValueError(str(answer[1])))
                else:
                    fut.set_result((int(answer[0]), list(answer[1])))
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError, IndexError) as exc:
            why = f"tokenize worker (pid {proc.pid}) stopped answering ({exc!r}); prompts are tokenized in-process"
            logger.warning(why)
            self._fail_all(why)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _fail_all(self, why: str) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(TokenizeWorkerError(why))

    async def close(self) -> None:
        """Stop the child and wait for it (its pipes close with it)."""
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all("the proxy is stopping")
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()


def serve(tokenizer_dir: str, block_size: int, stdin: Any, stdout: Any) -> None:
    """The child's loop: answer each request in order until stdin closes."""
    from tokenizers import Tokenizer

    from vllm_disagg.router.prefix_index import iter_block_keys

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    encode = msgspec.msgpack.Encoder().encode
    while True:
        head = stdin.read(_REQ.size)
        if len(head) < _REQ.size:
            return
        n, special = _REQ.unpack(head)
        data = stdin.read(n)
        try:
            ids = tok.encode_batch_fast([data.decode("utf-8", "surrogatepass")], False, bool(special))[0].ids
            answer = encode([len(ids), list(iter_block_keys(ids, block_size, len(ids) // block_size))])
        except Exception as exc:  # the parent reports it as the request's error
            answer = encode([-1, f"{type(exc).__name__}: {exc}"])
        stdout.write(_LEN.pack(len(answer)))
        stdout.write(answer)
        stdout.flush()


if __name__ == "__main__":
    background_priority()
    serve(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer, sys.stdout.buffer)
