"""What the transfer engine reports: finished requests for vLLM's scheduler, and one typed record per transfer.

The I/O thread writes here; the vLLM worker thread reads (``take_results``, ``take_records``), so every access to
the pending reports holds one lock. Records are typed so that the connector's metrics read fields, never the
human-readable ``reason`` (rewording a log line must not change a metric).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec


@dataclass
class TransferResults:
    """What the worker reports to vLLM's scheduler after a step."""

    finished_sending: set[str] = field(default_factory=set)  # P: request ids whose held blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # D: loads finished (ok, failed or cancelled)
    failed_recving: set[str] = field(default_factory=set)  # D: subset of finished_recving that must recompute


class SendOutcome(str, enum.Enum):
    """Why prefill stopped serving a transfer and freed its blocks."""

    LOADED = "loaded"  # decode loaded every block
    DECODE_GAVE_UP = "decode_gave_up"  # decode failed, was aborted, or will not load
    ABORTED = "aborted"  # the prefill request was aborted, or ended before it started
    PREEMPTED = "preempted"  # vLLM preempted the prefill request and freed its blocks
    LEASE_EXPIRED = "lease_expired"  # no word from decode within lease_s
    ABANDONED = "abandoned"  # the proxy gave up on the hand-off before a decode registered (wire.Release)
    MISMATCH = "mismatch"  # decode registered for another prompt
    UNREACHABLE = "unreachable"  # decode disconnected while blocks were being sent
    WRITE_FAILED = "write_failed"  # the data path could not write to decode


class SendRecord(msgspec.Struct, tag_field="side", tag="send", kw_only=True):
    """Prefill side of one finished transfer (times from ``time.monotonic``)."""

    transfer_id: str
    request_id: str
    outcome: SendOutcome
    reason: str  # for humans and logs
    bytes: int
    t_begin: float
    t_first_send: float
    t_last_send: float
    t_forward_end: float  # when the prefill forward pass that produced the last blocks ended (0: unknown)
    layer_offer_times: list[float] = msgspec.field(default_factory=list)
    writes_deferred: int = 0  # writes retried because the data path had no room (TCP: gather ring full)
    preemptions: int = 0  # times vLLM preempted the prefill request mid-send (the send resumed after each)


LoadEnd = Literal["done", "failed", "cancelled"]


class RecvRecord(msgspec.Struct, tag_field="side", tag="recv", kw_only=True):
    """Decode side of one finished load (times from ``time.monotonic``)."""

    transfer_id: str
    request_id: str
    state: LoadEnd
    reason: str  # for humans and logs
    bytes: int
    blocks: int
    first_block: int
    t_start: float
    t_first: float
    t_done: float
    # per layer: when its last block was in place (0: never)
    layer_done_times: list[float] = msgspec.field(default_factory=list)


TransferRecord = SendRecord | RecvRecord

_json = msgspec.json.Encoder()


class Reports:
    """Results, records and counters shared by the sender and the receiver, handed to the worker thread."""

    def __init__(self, trace_path: str | None) -> None:
        self.trace_path = trace_path  # JSON lines, one per finished transfer (tests, benchmarks)
        self.lock = threading.Lock()
        self._results = TransferResults()
        self._records: list[TransferRecord] = []
        # Read by tests and logs; written by the I/O thread only.
        self.stats: dict[str, float] = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "transfers_sent": 0,
            "writes_deferred": 0,  # a data path had no room yet (TCP: gather ring full); retried next turn
            "loads_ok": 0,
            "loads_failed": 0,
            "leases_expired": 0,
            "sends_abandoned": 0,  # transfers a proxy's Release freed before any decode registered
            "handshakes_refused": 0,
            "messages_rejected": 0,
            "io_turns": 0,  # turns of the I/O loop: what waiting costs (a polled data path polls by turning)
        }

    def sent(self, request_id: str) -> None:
        """P: the request's held blocks may be freed."""
        if request_id:
            with self.lock:
                self._results.finished_sending.add(request_id)

    def loaded(self, request_id: str, failed: bool) -> None:
        """D: the request's load finished (``failed``: vLLM recomputes its prompt)."""
        with self.lock:
            self._results.finished_recving.add(request_id)
            if failed:
                self._results.failed_recving.add(request_id)

    def record(self, rec: TransferRecord) -> None:
        with self.lock:
            self._records.append(rec)
        if self.trace_path:
            with contextlib.suppress(OSError), Path(self.trace_path).open("ab") as f:
                f.write(_json.encode(rec) + b"\n")

    def take_results(self) -> TransferResults:
        with self.lock:
            out, self._results = self._results, TransferResults()
        return out

    def take_records(self) -> list[TransferRecord]:
        with self.lock:
            out, self._records = self._records, []
        return out
