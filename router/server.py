"""`vllm-disagg proxy`: build the proxy from flags / a config file and serve it on the proxy's own HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from vllm_disagg.router.config import InstanceConfig, ProxySettings


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "proxy",
        help="run the prefix-aware P/D proxy in front of vLLM instances",
        description=(
            "Instances: URL[;side=HOST:PORT][;events=tcp://HOST:PORT][;replay=tcp://HOST:PORT][;id=NAME]. "
            "side = the instance's DisaggConnector side channel (needed to prefill for transfers); "
            "events = its --kv-events-config endpoint (precise prefix index)."
        ),
    )
    p.add_argument(
        "--config", help="YAML/JSON settings file (keys as ProxySettings; env VLLM_DISAGG_PROXY_* overrides)"
    )
    p.add_argument("--prefill", action="append", default=[], metavar="SPEC")
    p.add_argument("--decode", action="append", default=[], metavar="SPEC")
    p.add_argument("--both", action="append", default=[], metavar="SPEC")
    p.add_argument("--instances-file", help="YAML/JSON list of instances, watched for changes")
    p.add_argument(
        "--k8s-namespace", help="discover instances from Ready pods in this namespace (in-cluster API)"
    )
    p.add_argument(
        "--k8s-selector", help="label selector for discovered pods (role from label vllm-disagg/role)"
    )
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--policy", help="cost | round-robin | least-loaded | always-transfer | module:Class | file.py:Class"
    )
    p.add_argument("--tokenizer", help="local tokenizer dir (default: use an instance's /tokenize)")
    p.add_argument(
        "--tokenize-max-chars",
        type=int,
        help="tokenize at most this many characters of a prompt (default 65536): the prefix the index matches",
    )
    p.add_argument("--admin-key")
    p.add_argument("--shared-secret", help="side-channel secret (to read instances' KV geometry)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-concurrency", type=int, help="requests in flight per worker before 429")
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes sharing the port (default 1); each routes with the whole proxy's load",
    )
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--kv-bytes-per-token", type=int)
    p.add_argument(
        "--tier-bytes-per-s",
        type=float,
        help="load bandwidth from the KV tier (LMCache) beneath each instance, for pricing tier hits",
    )
    p.add_argument("--ttft-slo-s", type=float)
    p.add_argument("--tpot-slo-s", type=float)
    p.add_argument("--log-level")
    p.set_defaults(func=run_proxy)


def settings_from_args(ns: argparse.Namespace) -> ProxySettings:
    instances = [InstanceConfig.parse(s, "prefill") for s in ns.prefill]
    instances += [InstanceConfig.parse(s, "decode") for s in ns.decode]
    instances += [InstanceConfig.parse(s, "both") for s in ns.both]
    overrides: dict[str, Any] = {
        "host": ns.host,
        "port": ns.port,
        "policy": ns.policy,
        "tokenizer": ns.tokenizer,
        "tokenize_max_chars": ns.tokenize_max_chars,
        "admin_key": ns.admin_key,
        "shared_secret": ns.shared_secret,
        "block_size": ns.block_size,
        "max_concurrency": ns.max_concurrency,
        "workers": ns.workers,
        "max_body_bytes": ns.max_body_bytes,
        "kv_bytes_per_token": ns.kv_bytes_per_token,
        "tier_bytes_per_s": ns.tier_bytes_per_s,
        "ttft_slo_s": ns.ttft_slo_s,
        "tpot_slo_s": ns.tpot_slo_s,
        "instances_file": ns.instances_file,
        "k8s_namespace": ns.k8s_namespace,
        "k8s_selector": ns.k8s_selector,
        "log_level": ns.log_level,
    }
    settings = ProxySettings.load(ns.config, **overrides)
    if instances:
        settings = settings.model_copy(update={"instances": [*settings.instances, *instances]})
    return settings


def build_proxy(settings: ProxySettings) -> Any:
    from vllm_disagg.policy.cost_model import CostModel, CostModelConfig
    from vllm_disagg.policy.loader import load_policy
    from vllm_disagg.router.app import Proxy
    from vllm_disagg.router.prefix_index import PrefixIndex

    if settings.policy == "cost":
        policy: Any = CostModel(
            CostModelConfig(
                ttft_slo_s=settings.ttft_slo_s,
                tpot_slo_s=settings.tpot_slo_s,
                link_bytes_per_s=settings.link_bytes_per_s,
                tier_bytes_per_s=settings.tier_bytes_per_s,
            )
        )
    else:
        policy = load_policy(settings.policy)
    return Proxy(settings, policy, PrefixIndex(settings.block_size))


async def serve(
    proxy: Any,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
    grace_s: float = 30.0,
) -> None:
    """Start the proxy, serve until ``stop`` is set (or SIGINT/SIGTERM), then let answers under way finish for up
    to ``grace_s`` before closing. ``on_ready`` gets the port once the server listens."""
    from vllm_disagg.router.http_server import HttpServer

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    with contextlib.suppress(
        NotImplementedError, RuntimeError, ValueError
    ):  # not the main thread: no signals
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    # Everything built so far (modules, tokenizer, instances) lives as long as the process: out of the collector's
    # way, a full collection scans what requests leave behind instead of ~50k start-up objects (18 ms on the loop).
    gc.collect()
    gc.freeze()
    server = HttpServer(
        proxy.hot_routes, proxy.admin_app, max_body_bytes=proxy.settings.max_body_bytes, keepalive_s=5.0
    )
    try:
        await server.listen(host, port, sock=sock)
        bound = server.port()
        logging.getLogger("vllm_disagg.proxy").info("proxy listening on %s:%d", host, bound)
        if on_ready is not None:
            on_ready(bound)
        await stop.wait()
        await server.shutdown(grace_s)
    finally:
        await proxy.stop()


def run_proxy(ns: argparse.Namespace) -> int:
    settings = settings_from_args(ns)
    _configure_logging(settings)
    if not settings.instances and not settings.instances_file and not settings.k8s_namespace:
        raise SystemExit(
            "no instances: pass --prefill/--decode/--both, --instances-file, --k8s-namespace or --config"
        )
    if settings.workers > 1:
        from vllm_disagg.router.workers import supervise

        return supervise(settings)
    run_worker(settings)
    return 0


def _configure_logging(settings: ProxySettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run_worker(
    settings: ProxySettings,
    worker: int = 0,
    shared: Any = None,
    sock: socket.socket | None = None,
) -> None:
    """One proxy process on uvloop: the whole proxy, or worker ``worker`` of several (``shared``: their load)."""
    import uvloop

    proxy = build_proxy(settings)
    proxy.set_worker(worker, settings.workers, shared)
    # Threads that share the GIL with the event loop (tokenization's hand-back, KV-event subscribers) hold it for
    # at most this long before the loop gets it back (Python's default is 5 ms, longer than a streamed chunk's gap).
    sys.setswitchinterval(0.0005)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(proxy, settings.host, settings.port, sock=sock))
