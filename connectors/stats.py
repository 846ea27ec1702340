"""DisaggConnector's transfer statistics, through vLLM's connector stats and Prometheus hooks.

Workers report finished transfers (bytes, duration, how much of the send overlapped the prefill forward pass);
vLLM ships the stats to its logger process, aggregates them, and calls our Prometheus metrics' ``observe``. The
metrics appear on each instance's own ``/metrics`` as ``vllm:disagg_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_disagg.transport.records import SendOutcome, SendRecord, TransferRecord

_SERIES = (
    "send_bytes",
    "send_seconds",
    "send_overlap_ratio",
    "send_tail_seconds",
    "recv_bytes",
    "recv_seconds",
)
_COUNTS = (
    "loads_failed",
    "loads_cancelled",
    "leases_expired",
    "sends_abandoned",
    "writes_deferred",
    "sends_preempted",
    "handshakes_refused",
)


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in _SERIES}, **{k: 0 for k in _COUNTS}}


@dataclass
class DisaggStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def record(self, rec: TransferRecord) -> None:
        """Add one finished transfer as recorded by the transfer engine (typed fields only, never its reason)."""
        d = self.data
        for k, v in _empty().items():
            d.setdefault(k, v)
        if isinstance(rec, SendRecord):
            if rec.outcome is SendOutcome.LEASE_EXPIRED:
                d["leases_expired"] += 1
            elif rec.outcome is SendOutcome.ABANDONED:
                d["sends_abandoned"] += 1
            d["writes_deferred"] += rec.writes_deferred
            d["sends_preempted"] += rec.preemptions
            if not rec.bytes:
                return
            t0, t1, tf = rec.t_first_send, rec.t_last_send, rec.t_forward_end
            d["send_bytes"].append(rec.bytes)
            d["send_seconds"].append(max(0.0, t1 - rec.t_begin))
            window = t1 - t0
            if tf and window > 0:
                d["send_overlap_ratio"].append(min(1.0, max(0.0, (min(t1, tf) - t0) / window)))
            d["send_tail_seconds"].append(max(0.0, t1 - tf) if tf else 0.0)
        elif rec.state == "done":
            d["recv_bytes"].append(rec.bytes)
            d["recv_seconds"].append(max(0.0, rec.t_done - rec.t_start))
        elif rec.state == "cancelled":
            d["loads_cancelled"] += 1
        else:
            d["loads_failed"] += 1

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        sent, recv = d.get("send_bytes", []), d.get("recv_bytes", [])
        overlap = d.get("send_overlap_ratio", [])
        return {
            "transfers_sent": len(sent),
            "bytes_sent": sum(sent),
            "transfers_received": len(recv),
            "bytes_received": sum(recv),
            "mean_send_overlap": sum(overlap) / len(overlap) if overlap else 0.0,
            **{k: d.get(k, 0) for k in _COUNTS},
        }

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in (*_SERIES, *_COUNTS))


_BYTES = [2.0**i for i in range(12, 36, 2)]  # 4 KiB .. 16 GiB
_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class DisaggPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]

        def hist(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            m = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)  # type: ignore[call-arg]
            return create_metric_per_engine(m, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            m = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        self.h = {
            "send_bytes": hist(
                "vllm:disagg_send_bytes", "KV bytes pushed per transfer (prefill side).", _BYTES
            ),
            "send_seconds": hist(
                "vllm:disagg_send_seconds", "From the request's first step to its last block sent.", _SECONDS
            ),
            "send_overlap_ratio": hist(
                "vllm:disagg_send_overlap_ratio",
                "Share of a transfer's send window that overlapped the prefill forward pass (layer-wise push).",
                [0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0],
            ),
            "send_tail_seconds": hist(
                "vllm:disagg_send_tail_seconds",
                "Send time left after the prefill forward pass ended.",
                _SECONDS,
            ),
            "recv_bytes": hist(
                "vllm:disagg_recv_bytes", "KV bytes received per completed load (decode).", _BYTES
            ),
            "recv_seconds": hist(
                "vllm:disagg_recv_seconds", "From registration to the last block arriving (decode).", _SECONDS
            ),
        }
        self.c = {
            "loads_failed": counter("vllm:disagg_loads_failed", "KV loads that failed and were recomputed."),
            "loads_cancelled": counter(
                "vllm:disagg_loads_cancelled", "KV loads cancelled by an abort on decode."
            ),
            "leases_expired": counter(
                "vllm:disagg_leases_expired", "Held prefill blocks freed by lease expiry."
            ),
            "sends_abandoned": counter(
                "vllm:disagg_sends_abandoned",
                "Held prefill blocks freed at once because the proxy gave up on the hand-off before a decode "
                "registered (decode failed, the client left, a deadline passed), instead of at lease expiry.",
            ),
            "writes_deferred": counter(
                "vllm:disagg_writes_deferred",
                "Layer writes prefill retried because its TCP gather ring was full of unsent bytes; steady "
                "growth means the link, not prefill, sets the transfer's pace.",
            ),
            "handshakes_refused": counter(
                "vllm:disagg_handshakes_refused",
                "Side-channel peers refused: connections without the shared secret's credentials, messages with "
                "a wrong proof, incompatible KV layouts (each side counts its own). Growth means a misconfigured "
                "instance or proxy, or something probing the port: the instance's log names the address.",
            ),
            "sends_preempted": counter(
                "vllm:disagg_sends_preempted",
                "Times a prefill request was preempted mid-send (KV pressure on prefill), each TP worker counting "
                "its own shard: its transfer paused and went on from the resumed request's blocks (unless a data "
                "path held the freed blocks past 5 s: then decode recomputed).",
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.h.items():
            for v in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(v)
        for key, metric in self.c.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                metric[engine_idx].inc(n)
