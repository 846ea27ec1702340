"""Fault injection for the transfer engine (tests and benchmarks only).

Rules live in a JSON file named by the env var ``VLLM_DISAGG_FAULTS_FILE`` and are re-read when the file changes, so
one running vLLM instance can go through a whole fault matrix. With the variable unset, nothing is injected and the
engine pays one attribute check per message.

    [{"on": "layer", "action": "drop", "every": 1},
     {"on": "register", "action": "delay", "delay_s": 2.0}]

``on``: layer (prefill -> decode data), register / heartbeat / done (decode -> prefill control), step (every
forward pass of the connector's worker; delay only: slows generation so a test can act mid-stream on any machine).
``action``: drop, delay, truncate (layer only: cut the last block frame), corrupt (layer only: flip bytes).
``every``: apply to every n-th matching message (1 = all).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm_disagg.faults")

ENV = "VLLM_DISAGG_FAULTS_FILE"


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
