"""The proxy's Prometheus metrics (one registry per proxy, so tests and embedded proxies do not collide)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Container
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from vllm_disagg import native

# The event-loop lag histogram's bounds (seconds): the 1 ms selector floor (router.loop_lag), the 2 ms the proxy
# aims for, and stalls up to 1 s.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Bounds at the usual targets (TTFT 1-2 s, ITL 150 ms), so a quantile near a target is read, not interpolated.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0, 2.0)


# The longest a /metrics render holds the event loop before it lets other callbacks run (seconds).
RENDER_SLICE_S = 0.0005


# Distinct ``Plan.reason`` labels the decisions counter keeps; later ones count as "other" (``ProxyMetrics.decision``).
MAX_DECISION_REASONS = 64


class _Families:
    """A registry stand-in holding metric families already collected, so ``generate_latest`` renders a few."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


async def render(registry: CollectorRegistry, live: Container[str] | None = None) -> bytes:
    """The exposition of ``registry``, or of every worker's metrics when the proxy runs several workers.

    ``live``: the instances the proxy has now. With several workers a gauge's series cannot be removed (each
    worker's file keeps its last value), so the per-instance gauges of instances not in ``live`` are left out here.

    Rendered a few metric families at a time, yielding to the event loop every ``RENDER_SLICE_S``: the whole
    exposition costs the proxy ~2-3 ms of CPU here, a stall for every stream if done at once, once per scrape.
    A scrape may so see counters a few callbacks apart, as with any exposition that runs beside updates. With
    ``--workers`` the multiprocess collector merges every worker's files in one step, which is not sliced."""
    merged_mode = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    if merged_mode:
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        registry = merged
    parts: list[bytes] = []
    start = time.perf_counter()
    for family in registry.collect():  # each collector runs when this generator reaches it
        if merged_mode and live is not None and family.type == "gauge":
            family.samples = [
                s
                for s in family.samples
                if s.labels.get("instance", "") in live or "instance" not in s.labels
            ]
        parts.append(generate_latest(_Families([family])))  # type: ignore[arg-type]
        if time.perf_counter() - start >= RENDER_SLICE_S:
            await asyncio.sleep(0)
            start = time.perf_counter()
    return b"".join(parts)


class BucketCounts:
    """Observations bucketed locally, added to a Histogram child at once by ``flush``.

    A streamed answer observes one inter-chunk gap per chunk; counting them here costs a few compares instead of
    prometheus_client's two locked increments per observation, and ``flush`` adds one increment per non-empty
    bucket (the child's bucket values are prometheus_client's own, so exposition and multiprocess mode are
    unchanged)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        """``bounds``: the histogram's upper bounds, ``+Inf`` last (``ProxyMetrics.itl_buckets``)."""
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        # A forward scan (bisect_left's index): gaps fall in the first few buckets, and compiled it is a few float
        # compares where bisect is a call into the C module.
        bounds = self.bounds
        i, last = 0, len(bounds) - 1  # the last bound is +Inf: everything left lands there
        while i < last and amount > bounds[i]:
            i += 1
        self.counts[i] += 1
        self.total += amount

    def add(self, other: BucketCounts) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.total += other.total

    def flush(self, child: Any) -> None:
        """Add the counts to ``child`` (a labelled Histogram with the same buckets) and reset."""
        if not any(self.counts):
            return
        for i, n in enumerate(self.counts):
            if n:
                child._buckets[i].inc(n)
        child._sum.inc(self.total)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0


class Tally:
    """The request path's counter increments and histogram observations, kept in plain Python and added to the
    Prometheus children at once by ``flush`` (when /metrics is read, and every second).

    prometheus_client takes a lock and checks the metric per update (~1 µs, ~2 for a histogram); a request makes
    about ten. Here each is a dict update. Children are the keys, so exposition, labels and the multiprocess files
    are prometheus_client's own."""

    __slots__ = ("counts", "hists")

    def __init__(self) -> None:
        self.counts: dict[Any, float] = {}
        self.hists: dict[Any, BucketCounts] = {}

    def inc(self, child: Any, amount: float = 1.0) -> None:
        counts = self.counts
        counts[child] = counts.get(child, 0.0) + amount

    def observe(self, child: Any, value: float) -> None:
        b = self.hists.get(child)
        if b is None:
            b = self.hists[child] = BucketCounts(tuple(child._upper_bounds))
        b.observe(value)

    def merge(self, child: Any, counts: BucketCounts) -> None:
        """Add a stream's bucketed observations (same bounds as ``child``)."""
        b = self.hists.get(child)
        if b is None:
            b = self.hists[child] = BucketCounts(counts.bounds)
        b.add(counts)

    def flush(self) -> None:
        counts, self.counts = self.counts, {}
        for child, n in counts.items():
            child.inc(n)
        for child, b in self.hists.items():
            b.flush(child)


class ModeMetrics(NamedTuple):
    """The labelled children a served request of one mode updates."""

    ok: Any  # vllm_disagg_requests_total{mode, status="2xx"}
    ttft: Any
    e2e: Any
    itl: Any


class ProxyMetrics:
    """With several worker processes (``--workers``), prometheus_client's multiprocess mode adds up counters and
    histograms over the workers; gauges say how: the same reading in every worker (``mostrecent``) or each worker's
    part (``livesum``). ``worker_requests`` shows each worker's share."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._reasons: set[str] = set()  # the decisions counter's reason labels so far
        self._modes: dict[str, ModeMetrics] = {}
        self.tally = Tally()
        r = self.registry = CollectorRegistry()
        self.worker_requests = Counter(
            "vllm_disagg_worker_requests",
            "Inference requests taken by each worker process of the proxy",
            ["worker"],
            registry=r,
        )
        # 1 for how this process runs its request path: "compiled" (mypyc, scripts/build_native.py) or "source"
        # (no C compiler, a stale build, VLLM_DISAGG_PURE_PYTHON): the source costs ~1.6x the CPU a request
        self.build_info = Gauge(
            "vllm_disagg_proxy_build_info",
            "How the proxy's request path runs: compiled (mypyc) or Python source",
            ["request_path"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.build_info.labels("compiled" if native.compiled() else "source").set(1)
        self.requests = Counter(
            "vllm_disagg_requests",
            "Requests answered, by path and HTTP status class",
            ["mode", "status"],
            registry=r,
        )
        self.client_kv_params = Counter(
            "vllm_disagg_client_kv_transfer_params",
            "Requests whose client-sent kv_transfer_params or ec_transfer_params the proxy removed (only the proxy sets them)",
            registry=r,
        )
        self.decisions = Counter(
            "vllm_disagg_decisions",
            "Routing decisions and fallbacks, by mode and reason",
            ["mode", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm_disagg_ttft_seconds",
            "Time to the first streamed token seen by the client (streamed requests only: a non-streamed answer "
            "arrives whole and counts in vllm_disagg_e2e_seconds)",
            ["mode"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl_buckets = (*_ITL, float("inf"))
        self.itl = Histogram(
            "vllm_disagg_itl_seconds", "Gaps between streamed chunks", ["mode"], buckets=_ITL, registry=r
        )
        self.loop_lag = Histogram(
            "vllm_disagg_event_loop_lag_seconds",
            "How late the proxy's event loop ran a timer: the longest any request waited for the loop "
            "(lags under ~1 ms are the selector's granularity)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm_disagg_e2e_seconds", "End-to-end request latency", ["mode"], buckets=_LATENCY, registry=r
        )
        self.prefill_leg = Histogram(
            "vllm_disagg_prefill_leg_seconds",
            "Duration of the prefill leg of a transfer (prefill plus KV push)",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_depth = Gauge(
            "vllm_disagg_queue_depth",
            "Requests waiting for admission (over max_concurrency)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.queue_wait = Histogram(
            "vllm_disagg_queue_wait_seconds",
            "Time requests that found every slot taken waited for one (refused ones included)",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm_disagg_prompt_tokens", "Prompt tokens routed", registry=r)
        self.cached_prompt_tokens = Counter(
            "vllm_disagg_prefix_cached_tokens",
            "Prompt tokens already cached on the instance that prefilled them (prefix hits)",
            registry=r,
        )
        self.tier_prompt_tokens = Counter(
            "vllm_disagg_tier_hit_tokens",
            "Prompt tokens the instance that prefilled them was expected to load from the KV tier beneath it "
            "(LMCache CPU/disk) instead of computing",
            registry=r,
        )
        self.index_blocks = Gauge(
            "vllm_disagg_prefix_index_blocks",
            "Blocks the prefix index knows an instance holds, by medium (device: its own cache; CPU/DISK: a tier "
            "beneath it)",
            ["instance", "medium"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.index_resets = Counter(
            "vllm_disagg_prefix_index_resets",
            "Times the prefix index forgot what it knew of an instance's cache (a restart, a recovery whose process "
            "start time is unknown, KV events it could not replay): routing treats that cache as empty until its "
            "events or routed requests say otherwise",
            ["instance"],
            registry=r,
        )
        self.token_cache_lookups = Counter(
            "vllm_disagg_token_cache_lookups",
            "Lookups of a prompt's beginning in the prefix token cache (hit: it was tokenized only past a recent "
            "prompt's prefix)",
            ["result"],
            registry=r,
        )
        self.token_cache_bytes = Gauge(
            "vllm_disagg_token_cache_bytes",
            "Bytes of token ids the prefix token cache holds",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.transfers_in_flight = Gauge(
            "vllm_disagg_transfers_in_flight",
            "KV handoffs open in the ledger",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.transfers_stranded = Counter(
            "vllm_disagg_transfers_stranded",
            "Handoffs reclaimed after their deadline (both legs aborted)",
            registry=r,
        )
        self.prefill_legs_abandoned = Counter(
            "vllm_disagg_prefill_legs_abandoned",
            "Prefill legs aborted because decode was streaming without them (decode recomputed), by prefill "
            "instance: that prefill queues longer than decode's load_timeout_s",
            ["instance"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "vllm_disagg_client_disconnects",
            "Requests whose client went away (both legs aborted)",
            registry=r,
        )
        self.rejected = Counter(
            "vllm_disagg_rejected", "Requests refused before routing, by reason", ["reason"], registry=r
        )
        self.instance_in_flight = Gauge(
            "vllm_disagg_instance_in_flight",
            "Requests in flight per instance",
            ["instance", "role"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.instance_healthy = Gauge(
            "vllm_disagg_instance_healthy",
            "1 when the instance takes traffic",
            ["instance", "role"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.instance_waiting = Gauge(
            "vllm_disagg_instance_waiting",
            "vLLM's waiting requests per instance",
            ["instance", "role"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.instance_running = Gauge(
            "vllm_disagg_instance_running",
            "vLLM's running requests per instance",
            ["instance", "role"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.instance_kv_usage = Gauge(
            "vllm_disagg_instance_kv_usage_ratio",
            "vLLM's KV-cache usage per instance (0..1)",
            ["instance", "role"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        # Autoscaling signals: prefill pools scale on queued prefill work, decode pools on running streams.
        self.pool_queued_prefill_tokens = Gauge(
            "vllm_disagg_pool_queued_prefill_tokens",
            "Uncached prompt tokens dispatched to a pool and not yet prefilled",
            ["pool"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.pool_running_streams = Gauge(
            "vllm_disagg_pool_running_streams",
            "Streams being decoded by a pool",
            ["pool"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.pool_queued_prefill_tokens.labels("prefill").set(
            0
        )  # present from the start: autoscalers read it

    def forget_instance(self, instance: str, role: str) -> None:
        """Drop a removed instance's series: a deleted pod's last KV usage would otherwise stay in averages that
        autoscalers read, and every rollout would add series. (With several workers a gauge's last value stays in
        its worker's file: ``render`` leaves it out.)"""
        for gauge in (
            self.instance_in_flight,
            self.instance_healthy,
            self.instance_waiting,
            self.instance_running,
            self.instance_kv_usage,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(instance, role)
        for by_instance in (self.index_resets, self.prefill_legs_abandoned):
            with contextlib.suppress(KeyError):
                by_instance.remove(instance)

    def of_mode(self, mode: str) -> ModeMetrics:
        """The children a finished request of ``mode`` updates, looked up once per mode."""
        m = self._modes.get(mode)
        if m is None:
            m = self._modes[mode] = ModeMetrics(
                self.child(self.requests, mode, "2xx"),
                self.child(self.ttft, mode),
                self.child(self.e2e, mode),
                self.child(self.itl, mode),
            )
        return m

    def decision(self, mode: str, reason: str, capped: bool = True) -> Any:
        """The decisions counter's child for a plan. ``Plan.reason`` is a policy's free text: past the first
        ``MAX_DECISION_REASONS`` distinct ones a reason counts as "other" (the full text stays in the
        ``x-disagg-path`` header and /admin/decisions), so a policy that puts per-request detail there cannot grow
        the series without bound. The proxy's own reasons (``capped`` False) always keep their label."""
        if capped and reason not in self._reasons:
            if len(self._reasons) >= MAX_DECISION_REASONS:
                reason = "other"
            else:
                self._reasons.add(reason)
        return self.child(self.decisions, mode, reason)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the request path asks for the same few children every time."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c
