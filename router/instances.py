"""The instances behind the proxy: registry, compatibility at registration, health, circuit breaker, load.

Health is active (``/health`` and ``/metrics`` polled every few seconds) and passive (request errors count toward
a circuit breaker that ejects an instance for a while, then lets one probe through). Load combines what the proxy
has in flight on an instance with what vLLM reports (waiting, running, KV usage).

Compatibility: a prefill and a decode can pair only if their KV blocks are byte-compatible. The proxy asks each
instance's side channel for its KV geometry (a ``Describe`` message) when it registers, and refuses pairs that
differ, with the reason in the admin API -- before any traffic, not at the first transfer. It asks again whenever
an instance comes back healthy after being unhealthy: it may have restarted with another layout, or it was still
starting when it registered (its side channel did not answer, which refused it for transfers until then).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.policy.api import InstanceView, StreamLengths
from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.shared_load import SharedLoad
from vllm_disagg.router.upstream import UpstreamError, UpstreamPool
from vllm_disagg.transport.endpoints import for_host, tcp_endpoint
from vllm_disagg.transport.zmq_auth import HANDSHAKE_FAILED, as_client, handshake_failure
from vllm_disagg.transport.zmq_monitor import unwatch, watch
from vllm_disagg.wire import Description, Refuse, WireError, decode, encode, make_describe, make_release

logger = logging.getLogger("vllm_disagg.proxy")

# in the reason a side channel did not describe its instance for the proxy
REFUSED_PROXY = "refused the proxy"
# how often a healthy instance whose side channel did not describe it is asked again
REDESCRIBE_EVERY_S = 15.0


async def _handshake_refusal(monitor: zmq.asyncio.Socket) -> str:
    """Why zmq's handshake with a side channel failed, once ``monitor`` reports it (it waits otherwise)."""
    event = parse_monitor_message(list(await monitor.recv_multipart()))
    return handshake_failure(event["event"], event["value"])


async def _first_of(exchange: Awaitable[list[bytes]], refusal: Awaitable[str]) -> tuple[list[bytes], str]:
    """(the exchange's answer, "") or ([], why the handshake was refused), whichever comes first; the other is
    cancelled, also when the caller's deadline cancels this."""
    answer = asyncio.ensure_future(exchange)
    refused = asyncio.ensure_future(refusal)
    try:
        await asyncio.wait((answer, refused), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, refused):
            if not task.done():
                task.cancel()
    if answer.done() and not answer.cancelled():
        return answer.result(), ""
    return [], refused.result()


@dataclass
class Instance:
    cfg: InstanceConfig
    id: str
    healthy: bool = False
    draining: bool = False
    own_in_flight: int = 0  # this process's requests on it (``in_flight`` adds the other workers')
    own_streaming: int = 0  # of those, the ones whose answer has begun (past their first token)
    # of those, decode legs of transfers still waiting for their KV (no prompt to compute here)
    own_loads: int = 0
    # the output lengths (max_tokens) of those of this process's streams on it whose client set one
    own_lengths: StreamLengths = field(default_factory=StreamLengths)
    waiting: float = 0.0  # as vLLM reported at the last probe of /metrics (``waiting_now`` is the estimate)
    running: float = 0.0
    # other senders' requests on it (other workers, replicas, direct clients) as of that probe: (waiting, running)
    others: tuple[int, int] = (0, 0)
    kv_usage: float = 0.0
    failures: int = 0
    probe_failures: int = 0
    breaker_until: float = 0.0
    last_error: str = ""
    describe_again_at: float = 0.0  # monotonic time to ask its side channel again (0: no need)
    # its API server's process start time, when its /metrics tells it (a change: a restart)
    process_started: float = 0.0
    geometry: KVGeometry | None = None
    incompatible: str = ""  # why it cannot pair (found when described); empty when fine
    # why its side channel refused the proxy (no or another secret): it prefills by the sequential flow only
    side_refused: str = ""
    models: list[str] = field(default_factory=list)  # served model ids: the base model and its LoRA adapters
    model_cards: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models entries, as it gave them
    max_model_len: int | None = None
    registered: bool = False  # described once by add(); later recoveries describe it again
    # Transfers as prefill: "parallel" (side channel known: decode registers while prefill computes), "sequential"
    # (no side channel given: prefill answers first and its kv_transfer_params name the side channel, which is then
    # learned), or why neither works.
    # its prefill answers carried no kv_transfer_params (3 in a row): it cannot be a transfer source
    no_connector: bool = False
    connector_misses: int = 0  # prefill answers in a row without kv_transfer_params
    learn_failed: str = ""  # a side channel learned from its answers could not be described: stay sequential

    shared: SharedLoad | None = None  # the in-flight counts of the proxy's workers; None with one worker
    slot: int = -1

    @property
    def in_flight(self) -> int:
        """Requests the proxy has in flight on it (over all its worker processes)."""
        if self.shared is None:
            return self.own_in_flight
        return self.shared.total(self.slot)

    def acquire(self, load: bool = False) -> None:
        """A request of this process goes to the instance (``load``: a transfer's decode leg, whose prompt is
        computed elsewhere)."""
        self.own_in_flight += 1
        self.own_loads += load
        if self.shared is not None:
            self.shared.add(self.slot, 1)

    def started(self, load: bool = False, tokens: int = 0) -> None:
        """A request acquired here got its first token: it decodes now (``release(streaming=True)`` ends it).
        ``tokens``: its output length, when the client set one (0: unknown)."""
        self.own_streaming += 1
        self.own_loads -= load
        if tokens > 0:
            self.own_lengths.add(tokens)

    def release(self, streaming: bool = False, load: bool = False, tokens: int = 0) -> None:
        """A request ends (``streaming``: it had ``started``; ``load``: acquired as a load that never started;
        ``tokens``: the output length it ``started`` with)."""
        self.own_in_flight -= 1
        self.own_streaming -= streaming
        self.own_loads -= load and not streaming
        if streaming and tokens > 0:
            self.own_lengths.remove(tokens)
        if self.shared is not None:
            self.shared.add(self.slot, -1)

    def report_load(self, waiting: float, running: float, kv_usage: float) -> None:
        """vLLM's own counts, read from its /metrics, and from them ``others``.

        vLLM's report counts this process's requests too, a prompt being computed among the running ones; whatever
        the report holds beyond this process's requests at that moment is someone else's. This process's unanswered
        requests are taken from the report's queue first.
        """
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        pending, streaming = self.own_in_flight - self.own_streaming, self.own_streaming
        w, r = round(waiting), round(running)
        others_waiting = max(0, w - pending)
        others_total = max(0, w + r - pending - streaming)
        self.others = (min(others_waiting, others_total), max(0, others_total - others_waiting))

    @property
    def waiting_now(self) -> int:
        """Prompts the instance has to compute before their answers begin (queued or being computed), now.

        This process's own are counted as they are, not as a probe saw them: the report is up to a probe interval
        old, and at a few requests a second that is several requests, more than the difference a balancer decides
        on. A transfer's prefill leg is one until its KV is handed off; a transfer's decode leg waiting for its KV
        is not (its prompt is computed elsewhere). Other senders' requests are the last report's (``others``).
        """
        return self.own_in_flight - self.own_streaming - self.own_loads + self.others[0]

    @property
    def running_now(self) -> int:
        """Streams on the instance now (requests past their first token): this process's own, and the report's
        others (see ``waiting_now``)."""
        return self.own_streaming + self.others[1]

    def transfer_flow(self) -> str:
        if self.role == "decode":
            return "none (decode only)"
        if self.no_connector:
            return "none: its answers carry no kv_transfer_params (is DisaggConnector configured?)"
        if self.incompatible:
            return f"none: {self.incompatible}"
        if self.side_refused:
            return (
                f"sequential (prefill answers first), as its {self.side_refused}. Give the proxy the instances' "
                "--shared-secret for the parallel flow"
            )
        if self.cfg.side_channel:
            return f"parallel (side channel {self.cfg.side_channel})"
        why = f"; learning failed: {self.learn_failed}" if self.learn_failed else ""
        return "sequential until its side channel is learned from its first prefill answer" + why

    @property
    def role(self) -> str:
        return self.cfg.role

    @property
    def url(self) -> str:
        return self.cfg.url

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.breaker_until

    def view(self, now: float, cached_tokens: int = 0, tier_tokens: int = 0) -> InstanceView:
        role = self.cfg.role
        healthy = self.available(now)
        if self.incompatible and role == "both":
            role = "decode"  # cannot be a transfer source; it still serves requests on its own
        elif self.incompatible and role == "prefill":
            healthy = False  # a prefill instance nobody can receive KV from is of no use
        return InstanceView(
            id=self.id,
            role=role,  # type: ignore[arg-type]
            healthy=healthy,
            in_flight=self.in_flight,
            waiting=self.waiting_now,
            running=self.running_now,
            kv_usage=self.kv_usage,
            cached_tokens=cached_tokens,
            tier_tokens=tier_tokens,
            kv_connector=(self.geometry is not None or bool(self.side_refused)) and not self.incompatible,
            known_streams=self.own_lengths.count,
            shortest_stream=self.own_lengths.shortest,
            stall_sensitivity=self.own_lengths.sensitivity,
        )

    def admin(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "side_channel": self.cfg.side_channel,
            "kv_events": self.cfg.kv_events,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker_open": time.monotonic() < self.breaker_until,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": self.kv_usage,
            "models": self.models,
            "geometry": None if self.geometry is None else _geometry_dict(self.geometry),
            "incompatible": self.incompatible,
            "last_error": self.last_error,
        }


def _geometry_dict(g: KVGeometry) -> dict[str, Any]:
    return {f: getattr(g, f) for f in g.__struct_fields__}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The few vLLM gauges the proxy uses for load (summed over engines/labels)."""
    wanted = {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        # its API server's start (prometheus_client's process collector; absent with several API servers)
        "process_start_time_seconds": "started",
    }
    out = {v: 0.0 for v in wanted.values()}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = wanted.get(name)
        if key is not None:
            with contextlib.suppress(ValueError, IndexError):
                value = float(line.rsplit(" ", 1)[1])
                if math.isfinite(value):  # a NaN would poison the load estimate and the admin API's JSON
                    out[key] += value
    return out


class InstanceRegistry:
    """Holds the instances; the proxy's event loop owns it (no locking needed)."""

    def __init__(
        self,
        probes: UpstreamPool,
        secret: bytes | None = None,
        breaker_failures: int = 3,
        breaker_open_s: float = 10.0,
        describe_timeout_s: float = 3.0,
    ) -> None:
        self.probes = probes  # its own pool: a probe's timeouts are not a request's
        self.secret = secret
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        self.describe_timeout_s = describe_timeout_s
        self.instances: dict[str, Instance] = {}
        # Bumped whenever the instances or the models and context lengths they serve change: what intake reads of
        # them per request is cached against it.
        self.catalog_version = 0
        self.shared: SharedLoad | None = None  # when the proxy runs several workers
        # told of an instance whose cache may be empty now (restarted, or back from unhealthy): the prefix index
        # forgets what it held
        self.on_fresh_cache: Callable[[str], None] | None = None
        self._zctx = zmq.asyncio.Context.instance()

    def get(self, instance_id: str) -> Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise KeyError(
                f"unknown instance {instance_id!r}; known: {', '.join(self.instances) or 'none'}"
            ) from None

    async def add(self, cfg: InstanceConfig) -> Instance:
        inst = Instance(cfg=cfg, id=cfg.instance_id())
        if inst.id in self.instances:
            raise ValueError(f"instance {inst.id!r} is already registered")
        if self.shared is not None:
            inst.shared, inst.slot = self.shared, self.shared.slot(inst.id)
        self.instances[inst.id] = inst
        self.catalog_version += 1
        try:
            await self.probe(inst)
            await self.describe(inst)
        except BaseException:  # a refused add leaves nothing registered
            self.remove(inst.id)
            raise
        self._check_compatibility(inst)
        inst.registered = True
        logger.info(
            "registered %s instance %s at %s (healthy=%s); KV transfers from it: %s",
            inst.role,
            inst.id,
            inst.url,
            inst.healthy,
            inst.transfer_flow(),
        )
        if not inst.healthy:
            logger.warning(
                "instance %s at %s is not healthy (%s): it gets no requests until its /health answers 200; the "
                "proxy probes it every few seconds",
                inst.id,
                inst.url,
                inst.last_error or "no answer yet",
            )
        if inst.role != "decode" and inst.side_refused:
            logger.warning("instance %s: KV transfers from it: %s", inst.id, inst.transfer_flow())
        if inst.role != "decode" and inst.incompatible:
            logger.warning(
                "instance %s will not prefill for KV transfers: %s. The proxy asks again every %.0f s while it "
                "is healthy; until then it serves requests whole (recompute or colocated)",
                inst.id,
                inst.incompatible,
                REDESCRIBE_EVERY_S,
            )
        return inst

    def remove(self, instance_id: str) -> Instance:
        inst = self.get(instance_id)
        del self.instances[instance_id]
        self.catalog_version += 1
        if self.shared is not None:
            self.shared.release(instance_id)
        return inst

    async def describe(self, inst: Instance) -> None:
        """Ask the instance's side channel for its KV geometry (instances without one serve only alone). The answer
        replaces what was known in one step: requests are routed while the question is out."""
        geometry, why = await self._ask_geometry(inst.cfg)
        # Refused for want of the instances' secret: transfers from it take the sequential flow, which needs no
        # secret in the proxy (prefill vouches for its own answer).
        inst.side_refused = why if geometry is None and REFUSED_PROXY in why else ""
        inst.geometry, inst.incompatible = geometry, "" if inst.side_refused else why
        # unanswered (down, slow, another secret): asked again while healthy, not only after it recovers
        retry = geometry is None and bool(why)
        inst.describe_again_at = time.monotonic() + REDESCRIBE_EVERY_S if retry else 0.0

    async def _ask_geometry(self, cfg: InstanceConfig) -> tuple[KVGeometry | None, str]:
        """(geometry, why it cannot pair): (None, "") without a side channel or for an answer of another kind."""
        addr = cfg.side_channel_addr()
        if addr is None:
            return None, ""
        sock = as_client(for_host(self._zctx.socket(zmq.DEALER), addr[0]), self.secret)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = watch(self._zctx, sock, HANDSHAKE_FAILED, "proxy")
        try:
            sock.connect(tcp_endpoint(addr[0], addr[1]))
            # The send is under the deadline too: a port that fails zmq's handshake leaves the socket no peer,
            # and a send then waits for one forever. A refused handshake (another secret) is told at once.
            frames, refused = await asyncio.wait_for(
                _first_of(self._exchange(sock), _handshake_refusal(monitor)), self.describe_timeout_s
            )
            if refused:
                return None, f"side channel {addr[0]}:{addr[1]} {REFUSED_PROXY}'s connection: {refused}"
            msg, _ = decode(frames)
            if isinstance(msg, Description):
                return msg.geometry, ""
            if isinstance(msg, Refuse):
                return None, f"side channel {REFUSED_PROXY}: {msg.reason}"
            return None, ""
        except asyncio.TimeoutError:
            return (
                None,
                f"side channel {addr[0]}:{addr[1]} did not answer within {self.describe_timeout_s:g} s",
            )
        except (WireError, zmq.ZMQError, OSError) as exc:
            return None, f"side channel error: {exc}"
        finally:
            unwatch(sock, monitor)
            sock.close()

    async def _exchange(self, sock: zmq.asyncio.Socket) -> list[bytes]:
        await sock.send_multipart(encode(make_describe(self.secret, "vllm-disagg-proxy")))
        return list(await sock.recv_multipart())

    async def release_transfer(self, inst: Instance, transfer_id: str, reason: str) -> None:
        """Tell a prefill instance (each of its TP ranks' side channels) that the proxy gave up on ``transfer_id``
        before a decode loaded it, so it frees the blocks it holds for it now rather than when the lease runs out.
        Best effort, nothing is awaited back: a rank that misses it still frees them at its lease's end."""
        addr = inst.cfg.side_channel_addr()
        if addr is None:
            return
        host, port = addr
        ranks = inst.geometry.tp_size if inst.geometry is not None else 1
        for rank in range(max(ranks, 1)):
            sock = as_client(for_host(self._zctx.socket(zmq.DEALER), host), self.secret)
            sock.setsockopt(zmq.LINGER, 1000)  # the message leaves after the socket is closed
            try:
                sock.connect(tcp_endpoint(host, port + rank))
                msg = make_release(self.secret, "vllm-disagg-proxy", transfer_id, reason)
                await asyncio.wait_for(sock.send_multipart(encode(msg)), self.describe_timeout_s)
            except (asyncio.TimeoutError, zmq.ZMQError, OSError) as exc:
                logger.warning(
                    "transfer %s: could not tell prefill instance %s (side channel %s:%d) to free its blocks: %s; "
                    "they are freed when its lease runs out",
                    transfer_id,
                    inst.id,
                    host,
                    port + rank,
                    exc or "timed out",
                )
                return
            finally:
                sock.close()

    async def redescribe(self, inst: Instance) -> None:
        """Describe an instance again and re-check it against the others (see the module docstring: when)."""
        before = (inst.incompatible, inst.side_refused)
        await self.describe(inst)
        self._check_compatibility(inst)
        if (inst.incompatible, inst.side_refused) != before:
            logger.warning("instance %s: KV transfers from it: %s", inst.id, inst.transfer_flow())

    def _check_compatibility(self, inst: Instance) -> None:
        """Refuse an instance whose KV geometry differs from the registered ones (first registered wins)."""
        if inst.geometry is None or inst.incompatible:
            return
        for other in self.instances.values():
            if other is inst or other.geometry is None or other.incompatible:
                continue
            diff = _pair_diff(other.geometry, inst.geometry)
            if diff:
                inst.incompatible = f"KV layout differs from {other.id}: {diff}"
                logger.error("instance %s cannot pair for KV transfer: %s", inst.id, inst.incompatible)
                return

    def _fresh_cache(self, instance_id: str, why: str) -> None:
        """Forget what is known of the instance's cache (the prefix index's entries), saying so."""
        logger.info(
            "instance %s %s: its prefix-index entries are forgotten; its cache counts as empty until its KV events "
            "or the requests routed to it say otherwise",
            instance_id,
            why,
        )
        if self.on_fresh_cache is not None:
            self.on_fresh_cache(instance_id)

    async def probe(self, inst: Instance) -> None:
        restarted = False
        try:
            status, _ = await self.probes.get(inst.url, "/health")
            ok = status == 200
            if ok:
                # Every probe: LoRA adapters come and go (vLLM's /v1/load_lora_adapter) and list as models.
                _, body = await self.probes.get(inst.url, "/v1/models")
                listed = json.loads(body)
                data = [
                    d
                    for d in (listed.get("data", []) if isinstance(listed, dict) else [])
                    if isinstance(d, dict) and isinstance(d.get("id"), str)
                ]
                models = [d["id"] for d in data]
                inst.model_cards = data
                base = next((d for d in data if not d.get("parent")), data[0] if data else None)
                max_len = inst.max_model_len
                if base is not None and base.get("max_model_len"):
                    max_len = int(base["max_model_len"])
                if models != inst.models or max_len != inst.max_model_len:
                    inst.models, inst.max_model_len = models, max_len
                    self.catalog_version += 1
            if ok:
                _, body = await self.probes.get(inst.url, "/metrics")
                load = parse_vllm_metrics(body.decode("utf-8", "replace"))
                inst.report_load(load["waiting"], load["running"], load["kv_usage"])
                started, inst.process_started = inst.process_started, load["started"]
                restarted = bool(started) and inst.process_started != started
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            ok = False
            inst.last_error = f"health probe: {exc!r}"
        if ok and restarted and inst.registered:
            # a new process between two probes: its cache is empty, its layout may differ
            inst.no_connector, inst.connector_misses, inst.learn_failed = False, 0, ""
            self._fresh_cache(inst.id, "restarted (its process start time changed)")
            await self.redescribe(inst)
        was = inst.healthy
        # One slow probe under load is not a dead instance: flip to unhealthy after two failures in a row
        # (requests that fail meanwhile still trip the circuit breaker at once).
        inst.probe_failures = 0 if ok else inst.probe_failures + 1
        inst.healthy = ok or (was and inst.probe_failures < 2)
        if inst.healthy and not was:
            inst.failures = 0
            inst.breaker_until = 0.0
            # A recovered (possibly restarted, reconfigured) instance gets another chance at transfers.
            inst.no_connector, inst.connector_misses, inst.learn_failed = False, 0, ""
            logger.info("instance %s is healthy", inst.id)
            if inst.registered:
                # A restart while it was down shows as a new start time (handled above); a cache that outlived a
                # slow or paused spell is kept, since vLLM does not announce again the blocks it still holds.
                if not inst.process_started:
                    self._fresh_cache(inst.id, "recovered and its process start time is unknown (/metrics)")
                await self.redescribe(inst)
        elif was and not inst.healthy:
            logger.warning("instance %s failed its health probe: %s", inst.id, inst.last_error)
        elif inst.healthy and inst.registered and 0 < inst.describe_again_at <= time.monotonic():
            await self.redescribe(inst)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in list(self.instances.values())))

    def report_failure(self, instance_id: str, error: str) -> None:
        """Passive health: a request failed on this instance (connection error, 5xx)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        inst.failures += 1
        inst.last_error = error
        if inst.failures >= self.breaker_failures:
            inst.breaker_until = time.monotonic() + self.breaker_open_s
            inst.failures = 0
            logger.warning(
                "instance %s ejected for %.0f s after repeated errors (last: %s)",
                inst.id,
                self.breaker_open_s,
                error,
            )

    def report_success(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.failures = 0

    def views(self, cached: dict[str, int], tier: dict[str, int] | None = None) -> tuple[InstanceView, ...]:
        now = time.monotonic()
        tier = tier or {}
        return tuple(i.view(now, cached.get(i.id, 0), tier.get(i.id, 0)) for i in self.instances.values())

    def serving(self) -> bool:
        """True while at least one path can serve: a healthy instance that can decode."""
        now = time.monotonic()
        return any(i.available(now) and i.role in ("decode", "both") for i in self.instances.values())


def _pair_diff(a: KVGeometry, b: KVGeometry) -> str:
    """Why two instances cannot pair for KV transfer ("" when they can). TP rank is per worker, not per instance."""
    diff = a.incompatibility(b, ignore=("tp_rank",))
    return "" if diff is None else f"{diff[0]} {diff[1]} vs {diff[2]}"
