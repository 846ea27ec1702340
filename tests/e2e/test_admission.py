"""Admission (router/admission.py): slots, a bounded queue served by priority and tenants in turn, timeouts and
cancellation; then the same through a running proxy in front of a backend that holds requests."""

from __future__ import annotations

import asyncio

import pytest

from vllm_disagg.router.admission import Admission, Refused


async def _queued(adm: Admission, order: list[str], name: str, priority: int = 0, tenant: str = "") -> None:
    await adm.acquire(priority, tenant)
    order.append(name)


def test_a_free_slot_is_taken_at_once_and_released_slots_go_to_waiters() -> None:
    async def main() -> None:
        adm = Admission(max_active=1, max_queued=10, timeout_s=5)
        assert adm.try_acquire() and adm.active == 1
        order: list[str] = []
        tasks = [asyncio.create_task(_queued(adm, order, n)) for n in ("a", "b")]
        await asyncio.sleep(0)
        assert adm.queued == 2 and not adm.try_acquire()  # nobody jumps the queue
        adm.release()
        await asyncio.sleep(0)
        assert order == ["a"] and adm.active == 1  # the slot passed to "a", it was never free
        adm.release()
        await asyncio.gather(*tasks)
        assert order == ["a", "b"]
        adm.release()
        assert adm.active == 0 and adm.queued == 0

    asyncio.run(main())


def test_higher_priority_first_then_tenants_take_turns() -> None:
    async def main() -> None:
        adm = Admission(max_active=1, max_queued=10, timeout_s=5)
        adm.try_acquire()
        order: list[str] = []
        # tenant x floods first; y and a high-priority request arrive later
        specs = [
            ("x1", 0, "x"),
            ("x2", 0, "x"),
            ("x3", 0, "x"),
            ("y1", 0, "y"),
            ("y2", 0, "y"),
            ("hi", 5, "z"),
        ]
        tasks = []
        for name, prio, tenant in specs:
            tasks.append(asyncio.create_task(_queued(adm, order, name, prio, tenant)))
            await asyncio.sleep(0)
        for _ in specs:
            adm.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["hi", "x1", "y1", "x2", "y2", "x3"]

    asyncio.run(main())


def test_a_full_queue_and_a_long_wait_are_refused_and_a_cancelled_wait_gives_up_its_place() -> None:
    async def main() -> None:
        adm = Admission(max_active=1, max_queued=2, timeout_s=0.2)
        adm.try_acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as full:
            await adm.acquire()
        assert full.value.why == "queue_full"
        waiters[0].cancel()  # its client left
        await asyncio.sleep(0)
        assert adm.queued == 1
        with pytest.raises(Refused) as late:
            await waiters[1]
        assert late.value.why == "queue_timeout" and late.value.waited_s >= 0.2
        assert adm.queued == 0 and adm.active == 1
        adm.release()
        assert adm.active == 0

    asyncio.run(main())


def test_through_the_proxy_a_high_priority_request_overtakes_queued_ones(tiny_model: str) -> None:
    """One slot, a queue: requests wait instead of being refused, the one marked x-request-priority: 5 is served
    right after the request holding the slot, and the waits are in /metrics."""
    import threading
    import time

    import httpx
    from support.proxy_harness import mock_backend, running_proxy

    with (
        mock_backend("alpha") as a,
        running_proxy(a, tiny_model, max_concurrency=1, max_queued=8, queue_timeout_s=30) as rp,
    ):
        done: list[str] = []
        lock = threading.Lock()

        def send(name: str, priority: int) -> None:
            body = {
                "model": "alpha",
                "prompt": "hi",
                "max_tokens": 6,
                "stream": True,
                # the first holds the slot for seconds, while the others are queued one after another
                "mock_chunk_delay_s": 1.0 if name == "first" else 0.05,
            }
            headers = {"x-request-priority": str(priority), "authorization": f"Bearer {name[0]}"}
            r = httpx.post(rp.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            with lock:
                done.append(name)

        threads = []
        for name, prio in (("first", 0), ("low1", 0), ("low2", 0), ("high", 5)):
            t = threading.Thread(target=send, args=(name, prio))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 10
            while rp.proxy.active + rp.proxy.admission.queued < len(threads):  # each is in before the next
                assert time.monotonic() < deadline
                time.sleep(0.01)
        for t in threads:
            t.join(30)
        assert done[0] == "first" and done[1] == "high", done
        metrics = httpx.get(rp.url + "/metrics", timeout=10).text
        waits = next(
            ln for ln in metrics.splitlines() if ln.startswith("vllm_disagg_queue_wait_seconds_count")
        )
        assert float(waits.split()[-1]) == 3.0
        bad = httpx.post(
            rp.url + "/v1/completions", json={"prompt": "x"}, headers={"x-request-priority": "hi"}
        )
        assert bad.status_code in (200, 400)  # a free slot skips the queue (and its header); busy: 400 named
