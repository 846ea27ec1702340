"""TransferLedger: every P->D handoff the proxy started, until both legs are over.

The pain point it answers: KV blocks stranded on a prefill instance because decode never pulled or the client went
away. The proxy records each handoff (transfer id, P, D, state, deadline); a client disconnect or a failed leg
closes it and the proxy aborts the other leg; handoffs past their deadline are reclaimed (both legs aborted) and
counted as stranded. Pure bookkeeping; the proxy does the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

State = Literal["dispatched", "prefill_done", "decoding", "done", "failed", "aborted", "reclaimed"]
OPEN_STATES = ("dispatched", "prefill_done", "decoding")


@dataclass
class Handoff:
    transfer_id: str
    request_id: str
    prefill: str
    decode: str
    deadline: float
    state: State = "dispatched"
    opened: float = 0.0
    closed: float = 0.0
    note: str = ""


@dataclass
class TransferLedger:
    deadline_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    open_handoffs: dict[str, Handoff] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def open(self, transfer_id: str, request_id: str, prefill: str, decode: str) -> Handoff:
        now = self.clock()
        h = Handoff(transfer_id, request_id, prefill, decode, deadline=now + self.deadline_s, opened=now)
        self.open_handoffs[transfer_id] = h
        return h

    def mark(self, transfer_id: str, state: State, note: str = "") -> None:
        h = self.open_handoffs.get(transfer_id)
        if h is None:
            return
        if h.state == "decoding" and state in ("dispatched", "prefill_done"):
            return  # a late prefill answer never moves a decoding stream back into reclaimable states
        h.state, h.note = state, note or h.note
        if state not in OPEN_STATES:
            h.closed = self.clock()
            del self.open_handoffs[transfer_id]
            self.counts[state] = self.counts.get(state, 0) + 1

    def expired(self) -> list[Handoff]:
        """Handoffs past their deadline; marked reclaimed (the caller aborts both legs)."""
        now = self.clock()
        # A decoding stream holds no prefill blocks any more (decode had its KV by its first token): never reclaimed.
        out = [h for h in self.open_handoffs.values() if now > h.deadline and h.state != "decoding"]
        for h in out:
            self.mark(h.transfer_id, "reclaimed", f"deadline passed in state {h.state}")
        return out

    def in_flight(self) -> int:
        return len(self.open_handoffs)

    def stranded(self) -> int:
        return self.counts.get("reclaimed", 0)

    def snapshot(self) -> list[dict[str, object]]:
        now = self.clock()
        return [
            {
                "transfer_id": h.transfer_id,
                "request_id": h.request_id,
                "prefill": h.prefill,
                "decode": h.decode,
                "state": h.state,
                "age_s": round(now - h.opened, 3),
            }
            for h in self.open_handoffs.values()
        ]
