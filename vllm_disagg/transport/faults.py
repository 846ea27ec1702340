"""Fault injection for the transfer engine (tests and benchmarks only), as wrappers around production objects.

Rules live in a JSON file named by the env var ``VLLM_DISAGG_FAULTS_FILE`` and are re-read when the file changes, so
one running vLLM instance can go through a whole fault matrix. The connector reads the variable once, when it
starts: if set, it wraps the engine's side channel in :class:`FaultySideChannel` and its per-step hook with
:meth:`FaultInjector.slow_steps`. With the variable unset nothing is wrapped, and no production class checks for
faults.

    [{"on": "layer", "action": "drop", "every": 1},
     {"on": "register", "action": "delay", "delay_s": 2.0}]

``on``: layer (prefill -> decode data frames of the TCP path), register / heartbeat / done (decode -> prefill
control), step (every forward pass of the connector's worker; delay only: slows generation so a test can act
mid-stream on any machine).
``action``: drop, delay, truncate (layer only: cut the last block frame), corrupt (layer only: flip bytes); other
actions on control messages drop them.
``every``: apply to every n-th matching message (1 = all).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import zmq

from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.wire import Done, Heartbeat, Message, Register

logger = logging.getLogger("vllm_disagg.faults")

ENV = "VLLM_DISAGG_FAULTS_FILE"

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class FaultRule:
    on: str
    action: str
    delay_s: float = 0.0
    every: int = 1


class FaultInjector:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rules: list[FaultRule] = []
        self._mtime = -1.0
        self._checked = 0.0
        self._counts: dict[str, int] = {}

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def _reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < 0.1:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self.rules, self._mtime = [], -1.0
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            raw: list[dict[str, Any]] = json.loads(Path(self.path).read_text() or "[]")
            self.rules = [FaultRule(**r) for r in raw]
            self._counts = {}
            logger.warning("fault injection rules now: %s", self.rules)
        except (ValueError, TypeError) as exc:
            logger.error("bad fault rules in %s: %s", self.path, exc)
            self.rules = []

    def decide(self, on: str) -> FaultRule | None:
        """The rule to apply to this message, if any (counts messages per kind for ``every``)."""
        self._reload()
        for rule in self.rules:
            if rule.on == on:
                n = self._counts.get(on, 0) + 1
                self._counts[on] = n
                if n % max(1, rule.every) == 0:
                    return rule
        return None

    def slow_steps(self, step: Callable[_P, _R]) -> Callable[_P, _R]:
        """``step`` (called once per forward pass) preceded by the sleep a "step" delay rule asks for."""

        @functools.wraps(step)
        def slowed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            rule = self.decide("step")
            if rule is not None and rule.action == "delay":
                time.sleep(rule.delay_s)
            return step(*args, **kwargs)

        return slowed


_CONTROL: dict[type, str] = {Register: "register", Heartbeat: "heartbeat", Done: "done"}


class FaultySideChannel(SideChannel):
    """A side channel that drops, delays or damages what the rules name, then sends through the real one."""

    def __init__(self, inner: SideChannel, faults: FaultInjector) -> None:
        self._inner = inner
        self._faults = faults
        self._delayed: list[tuple[float, Callable[[], object]]] = []

    @classmethod
    def wrapper(cls, faults: FaultInjector) -> Callable[[SideChannel], SideChannel]:
        """For ``TransferEngine(wrap_channel=...)``."""
        return lambda inner: cls(inner, faults)

    def _rule(self, on: str, what: str) -> FaultRule | None:
        rule = self._faults.decide(on)
        if rule is not None:
            logger.warning("FAULT: %s %s", rule.action, what)
        return rule

    def _later(self, delay_s: float, send: Callable[[], object]) -> None:
        self._delayed.append((time.monotonic() + delay_s, send))

    def reply(self, identity: bytes, msg: Message) -> None:
        self._inner.reply(identity, msg)

    def send_layer(self, identity: bytes, frames: list[Any]) -> zmq.MessageTracker | None:
        rule = self._rule("layer", "layer message")
        if rule is None:
            return self._inner.send_layer(identity, frames)
        if rule.action == "drop":
            return None
        if rule.action == "delay":
            copied = [bytes(f) for f in frames]  # the blocks may be freed before the delayed send
            self._later(rule.delay_s, lambda: self._inner.send_layer(identity, copied))
            return None
        last = bytes(frames[-1])
        if rule.action == "truncate":
            frames = [*frames[:-1], last[:-8]]
        elif rule.action == "corrupt":
            damaged = bytearray(last)
            damaged[len(damaged) // 2] ^= 0xFF
            frames = [*frames[:-1], bytes(damaged)]
        return self._inner.send_layer(identity, frames)

    def tell(self, sock: zmq.Socket[Any], msg: Message) -> bool:
        kind = _CONTROL.get(type(msg))
        rule = self._rule(kind, f"{kind} message") if kind is not None else None
        if rule is None:
            return self._inner.tell(sock, msg)
        if rule.action == "delay":
            self._later(rule.delay_s, lambda: self._inner.tell(sock, msg))
        return True  # dropped or delayed on purpose: the engine believes it sent

    def poll(self, now: float) -> None:
        self._inner.poll(now)
        if not self._delayed:
            return
        due = [send for t, send in self._delayed if t <= now]
        self._delayed = [(t, send) for t, send in self._delayed if t > now]
        for send in due:
            with contextlib.suppress(zmq.ZMQError):  # the peer went away meanwhile
                send()
