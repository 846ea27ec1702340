"""The tokenize worker process: its answers equal in-process tokenization and hashing; a dead child fails what it
had in flight with TokenizeWorkerError (intake then tokenizes in-process) and the next request starts a new one."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from vllm_disagg.router.prefix_index import block_keys
from vllm_disagg.router.priority import BACKGROUND_NICE
from vllm_disagg.router.tokenize_worker import TokenizeWorker, TokenizeWorkerError
from vllm_disagg.router.tokenizer import PromptTokenizer
from vllm_disagg.router.tokenizer import _pool as tokenizer_pool


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
            # which of the two the parent sees first depends on whether the child had read the request whole
            with pytest.raises(TokenizeWorkerError, match="stopped answering|pipe closed"):
                await pending
            count, _ = await worker.encode_keys(texts[0], True)  # a new child
            assert count == len(tok.encode_text(texts[0], True))
            assert worker._proc is not None and worker._proc.pid != proc.pid
        finally:
            await worker.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def _expected_nice() -> int:
    """Background priority, or this process's own where it is already lower (raising it back needs privilege)."""
    return max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, 0))


def test_background_tokenizing_runs_at_nice_10_not_the_idle_class(tiny_model: str) -> None:
    """An idle-class tokenizer waits for every core to idle, so on a host busy with engines each request's routing
    waited hundreds of milliseconds; background work runs in the normal class at a lower weight instead."""
    tok = PromptTokenizer(tiny_model)

    def thread_priority() -> tuple[int, int]:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0)

    async def scenario() -> None:
        assert await tok.encode_off_loop("word " * 1_000, True) == tok.encode_text("word " * 1_000, True)
        loop = asyncio.get_running_loop()
        nice, policy = await loop.run_in_executor(tokenizer_pool(), thread_priority)
        assert (nice, policy) == (_expected_nice(), os.SCHED_OTHER)
        worker = TokenizeWorker(tiny_model, 16)
        try:
            await worker.encode_keys("word " * 100, True)
            assert worker._proc is not None
            pid = worker._proc.pid
            assert os.getpriority(os.PRIO_PROCESS, pid) == _expected_nice()
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        finally:
            await worker.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
