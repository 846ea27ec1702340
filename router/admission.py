"""Admission: at most ``max_active`` requests in flight per worker; the rest wait in a bounded queue.

Waiting requests are served by priority (``x-request-priority``: higher first), and within a priority round-robin
over tenants (API keys), so one tenant's burst cannot starve another's requests. A request that waits longer than
``timeout_s``, or finds the queue full, is refused (the proxy answers 429 with ``Retry-After``). Releasing a slot
hands it straight to the next waiter, so a waiter never loses its turn to a request that just arrived.

The common case, a free slot and nobody waiting, costs an integer compare: no future, no allocation.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field


class Refused(Exception):
    """The request was not admitted: ``why`` is "queue_full" or "queue_timeout"."""

    def __init__(self, why: str, waited_s: float) -> None:
        super().__init__(why)
        self.why, self.waited_s = why, waited_s


@dataclass
class _Level:
    """One priority's waiters: a queue per tenant and the order the tenants take turns in."""

    tenants: dict[str, collections.deque[asyncio.Future[bool]]] = field(default_factory=dict)
    turn: collections.deque[str] = field(default_factory=collections.deque)


class Admission:
    def __init__(self, max_active: int, max_queued: int, timeout_s: float) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.active = 0
        self.queued = 0
        self._levels: dict[int, _Level] = {}

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits (the fast path)."""
        if self.active < self.max_active and not self.queued:
            self.active += 1
            return True
        return False

    async def acquire(self, priority: int = 0, tenant: str = "") -> float:
        """Wait for a slot; returns the seconds waited, raises ``Refused``. Cancelling the wait (the client left)
        gives up its place."""
        if self.try_acquire():
            return 0.0
        if self.queued >= self.max_queued:
            raise Refused("queue_full", 0.0)
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()  # True: granted a slot; False: timed out
        level = self._levels.setdefault(priority, _Level())
        q = level.tenants.get(tenant)
        if q is None:
            q = level.tenants[tenant] = collections.deque()
            level.turn.append(tenant)
        q.append(fut)
        self.queued += 1
        timer = loop.call_later(self.timeout_s, self._expire, priority, tenant, fut)
        try:
            granted = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.release()  # granted, but the request is gone: pass the slot on
            else:
                self._forget(priority, tenant, fut)
            raise
        finally:
            timer.cancel()
        if not granted:
            raise Refused("queue_timeout", time.monotonic() - t0)
        return time.monotonic() - t0

    def _expire(self, priority: int, tenant: str, fut: asyncio.Future[bool]) -> None:
        if not fut.done():
            self._forget(priority, tenant, fut)
            fut.set_result(False)

    def release(self) -> None:
        """Free a slot: the next waiter (highest priority, tenants in turn) gets it, else it is free."""
        while self._levels:
            prio = max(self._levels)
            level = self._levels[prio]
            tenant = level.turn[0]
            q = level.tenants[tenant]
            fut = q.popleft()
            level.turn.rotate(-1)
            if not q:
                del level.tenants[tenant]
                level.turn.remove(tenant)
            if not level.tenants:
                del self._levels[prio]
            self.queued -= 1
            if not fut.done():
                fut.set_result(True)  # the slot passes to it: active stays the same
                return
        self.active -= 1

    def _forget(self, priority: int, tenant: str, fut: asyncio.Future[bool]) -> None:
        level = self._levels.get(priority)
        q = level.tenants.get(tenant) if level is not None else None
        if level is None or q is None or fut not in q:
            return
        q.remove(fut)
        self.queued -= 1
        if not q:
            del level.tenants[tenant]
            level.turn.remove(tenant)
        if not level.tenants:
            del self._levels[priority]
