"""The events that may interrupt a request's waits, and the task they interrupt.

A request waits on one thing at a time (the decode leg's head, its first byte, the stream's next chunk), but three
other events must be able to stop that wait: the client disconnecting, the prefill leg failing, and the hand-off
passing its deadline. Rather than a task per event and an ``asyncio.wait`` loop per step, the serving task waits
inline and those events *interrupt* it: they record why and cancel it. An interrupt only lands while the request is
armed for that reason, so a late event (a prefill failing after decode already streams) never cancels anything.

    ix.arm(CLIENT_GONE, PREFILL, DEADLINE)
    try:
        ...await...
    except asyncio.CancelledError:
        why = ix.take()      # None: cancelled from outside (shutdown): re-raise
    finally:
        ix.disarm()
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

CLIENT_GONE = "client_gone"
PREFILL = "prefill_failed"
DEADLINE = "deadline"


class Interrupts:
    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.why: str | None = None
        self.client_gone = False
        self._armed: tuple[str, ...] = ()
        self._watcher: asyncio.Task[None] | None = None

    def watch(self, receive: Callable[[], Awaitable[Any]]) -> None:
        """Under ASGI: notice the client leaving (call once the request body was read: the watcher consumes
        ``receive``). The proxy's own server calls ``client_left`` from the connection instead."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._wait_disconnect(receive))

    async def _wait_disconnect(self, receive: Callable[[], Awaitable[Any]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_left()

    def client_left(self) -> None:
        self.client_gone = True
        self.interrupt(CLIENT_GONE)

    def arm(self, *reasons: str) -> None:
        """Let ``reasons`` interrupt the waits that follow; a client already gone interrupts at once."""
        self._armed = reasons
        if self.client_gone and CLIENT_GONE in reasons:
            self.why = CLIENT_GONE
            raise asyncio.CancelledError

    def disarm(self) -> None:
        self._armed = ()

    def interrupt(self, why: str) -> None:
        if why in self._armed and self.why is None and self.task is not None:
            self.why = why
            self._armed = ()
            self.task.cancel()

    def take(self) -> str | None:
        """In an ``except CancelledError``: the interrupt's reason (and the cancellation consumed), or None when the
        task was cancelled by someone else."""
        why, self.why = self.why, None
        self._armed = ()
        if why is not None and self.task is not None:
            self.task.uncancel()
        return why

    def on_prefill_done(self, task: asyncio.Task[Any]) -> None:
        """Done-callback of a prefill leg: a failed or cancelled one interrupts a decode still waiting for KV."""
        if task.cancelled() or task.exception() is not None:
            self.interrupt(PREFILL)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class DeadlineHook:
    """What the ledger's reaper cancels for a hand-off past its deadline: interrupts the request waiting on it."""

    def __init__(self, interrupts: Interrupts) -> None:
        self.interrupts = interrupts

    def cancel(self) -> None:
        self.interrupts.interrupt(DEADLINE)
