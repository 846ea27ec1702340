"""The tokenize worker process: its answers equal in-process tokenization and hashing; a dead child fails what it
had in flight with TokenizeWorkerError (intake then tokenizes in-process) and the next request starts a new one."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from vllm_disagg.router.prefix_index import block_keys
from vllm_disagg.router.tokenize_worker import TokenizeWorker, TokenizeWorkerError
from vllm_disagg.router.tokenizer import PromptTokenizer


def test_answers_match_in_process_tokenization_and_survive_a_dead_child(tiny_model: str) -> None:
    tok = PromptTokenizer(tiny_model)
    texts = ["word " * 5_000, "straße 東京 " * 3_000, "x" * 40_000, ""]

    async def scenario() -> None:
        worker = TokenizeWorker(tiny_model, 16)
        try:
            # pipelined: all written before the first answer is read, answered in order
            answers = await asyncio.gather(*(worker.encode_keys(t, True) for t in texts))
            for text, (count, keys) in zip(texts, answers, strict=True):
                ids = tok.encode_text(text, True)
                assert count == len(ids) and keys == block_keys(ids, 16)
            assert (await worker.encode_keys("word " * 100, False))[0] == len(
                tok.encode_text("word " * 100, False)
            )
            proc = worker._proc
            assert proc is not None
            pending = asyncio.ensure_future(worker.encode_keys("word " * 200_000, True))
            await asyncio.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(TokenizeWorkerError, match="stopped answering"):
                await pending
            count, _ = await worker.encode_keys(texts[0], True)  # a new child
            assert count == len(tok.encode_text(texts[0], True))
            assert worker._proc is not None and worker._proc.pid != proc.pid
        finally:
            await worker.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
