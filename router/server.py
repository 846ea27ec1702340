"""`vllm-disagg proxy`: build the proxy from flags / a config file and serve it on the proxy's own HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import ssl
import sys
import typing
from collections.abc import Callable
from typing import Any

from vllm_disagg import native
from vllm_disagg.router.config import InstanceConfig, ProxySettings, one_line


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "proxy",
        help="run the prefix-aware P/D proxy in front of vLLM instances",
        description=(
            "Instances: URL[;side=HOST:PORT][;events=tcp://HOST:PORT][;replay=tcp://HOST:PORT][;id=NAME]. "
            "side = the instance's DisaggConnector side channel (needed to prefill for transfers); "
            "events = its --kv-events-config endpoint (precise prefix index). Every other option is a ProxySettings "
            "field, also settable in --config or as VLLM_DISAGG_PROXY_<NAME>."
        ),
    )
    p.add_argument(
        "--config", help="YAML/JSON settings file (keys as ProxySettings; env VLLM_DISAGG_PROXY_* overrides)"
    )
    p.add_argument("--prefill", action="append", default=[], metavar="SPEC")
    p.add_argument("--decode", action="append", default=[], metavar="SPEC")
    p.add_argument("--both", action="append", default=[], metavar="SPEC")
    for name, field in setting_flags().items():
        kind = _scalar_type(field.annotation)
        default = field.default if field.default is not None else "unset"
        how: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{field.description} (default: {default})",
            **how,
        )
    p.set_defaults(func=run_proxy)


def setting_flags() -> dict[str, Any]:
    """The ProxySettings fields that are flags: every scalar one (the instances list has --prefill/--decode/--both)."""
    return {n: f for n, f in ProxySettings.model_fields.items() if _scalar_type(f.annotation) is not None}


def _scalar_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = args[0] if len(args) == 1 else None
    return kind if kind in (str, int, float, bool) else None


def settings_from_args(ns: argparse.Namespace) -> ProxySettings:
    instances = [InstanceConfig.parse(s, "prefill") for s in ns.prefill]
    instances += [InstanceConfig.parse(s, "decode") for s in ns.decode]
    instances += [InstanceConfig.parse(s, "both") for s in ns.both]
    overrides = {name: getattr(ns, name, None) for name in setting_flags()}
    settings = ProxySettings.load(ns.config, **overrides)
    if instances:
        settings = settings.model_copy(update={"instances": [*settings.instances, *instances]})
    return settings


def build_proxy(settings: ProxySettings) -> Any:
    from vllm_disagg.router.app import Proxy
    from vllm_disagg.router.prefix_index import PrefixIndex

    policy = policy_factory(settings)()
    return Proxy(
        settings, policy, PrefixIndex(settings.block_size, pending_ttl_s=settings.prefix_pending_ttl_s)
    )


def policy_factory(settings: ProxySettings) -> Any:
    """What builds the proxy's policy (``--policy``, ``--policy-args``), checked once: the default cost model and a
    user's subclass of it aim at the proxy's SLOs and link settings."""
    from vllm_disagg.policy.cost_model import CostModelConfig
    from vllm_disagg.policy.loader import parse_policy_args, policy_builder

    cost = CostModelConfig(
        ttft_slo_s=settings.ttft_slo_s,
        tpot_slo_s=settings.tpot_slo_s,
        link_bytes_per_s=settings.link_bytes_per_s,
        tier_bytes_per_s=settings.tier_bytes_per_s,
        split_ttft_gate=settings.split_ttft_gate,
        min_offered_share=settings.split_min_offered_share,
        split_tpot_share=settings.split_tpot_share,
        split_settle_hold_s=settings.split_settle_hold_s,
        length_weighted_stall=settings.length_weighted_stall,
    )
    return policy_builder(settings.policy, parse_policy_args(settings.policy_args), cost)


async def serve(
    proxy: Any,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
    grace_s: float | None = None,
) -> None:
    """Start the proxy, serve until ``stop`` is set (or SIGINT/SIGTERM), then drain: /health answers 503, new
    connections are refused after ``drain_delay_s``, and answers under way get up to ``grace_s`` (default: the
    settings' ``shutdown_grace_s``) to finish. ``on_ready`` gets the port once the server listens."""
    from vllm_disagg.router.http_server import HttpServer, shutdown_cut_event

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
    settings = proxy.settings
    server = HttpServer(
        proxy.hot_routes,
        proxy.admin_app,
        max_body_bytes=settings.max_body_bytes,
        keepalive_s=5.0,
        get_routes=proxy.get_routes,
        write_stall_s=settings.request_timeout_s,
        max_connections=settings.max_connections,
    )
    try:
        await server.listen(host, port, sock=sock, ssl_context=ssl_context(settings))
        bound = server.port()
        log = logging.getLogger("vllm_disagg.proxy")
        log.info("proxy listening on %s:%d; request path %s", host, bound, native.describe())
        if not native.compiled() and not native.forced_source():
            log.warning(
                "the request path runs from its Python source (%s), at ~1.6x the CPU a request of the compiled "
                "one: run `make native` (scripts/build_native.py; needs a C compiler)",
                native.describe(),
            )
        if on_ready is not None:
            on_ready(bound)
        await stop.wait()
        proxy.draining = True  # /health says 503 from now on
        grace = grace_s if grace_s is not None else settings.shutdown_grace_s
        log.info(
            "proxy stopping: /health answers 503; new connections are taken for %g s (--drain-delay-s), then "
            "the %d requests under way get up to %g s to finish (--shutdown-grace-s)",
            settings.drain_delay_s,
            proxy.active,
            grace,
        )
        if settings.drain_delay_s:
            await asyncio.sleep(settings.drain_delay_s)
        log.info("proxy draining: no new connections; %d requests under way", proxy.active)
        cut = await server.shutdown(grace, shutdown_cut_event(grace))
        if cut:
            log.warning(
                "proxy stopped: %d answers were still under way at the end of --shutdown-grace-s=%g and were cut "
                "(streams got an error event where one could go between the instance's, then the connection "
                "closed); a longer grace lets long streams finish",
                cut,
                grace,
            )
        else:
            log.info("proxy stopped: every answer under way finished")
    finally:
        await proxy.stop()


def ssl_context(settings: ProxySettings) -> ssl.SSLContext | None:
    """HTTPS when a certificate is given (its key in the same file or in ``ssl_keyfile``)."""
    if not settings.ssl_certfile:
        if settings.ssl_keyfile:
            raise SystemExit("--ssl-keyfile needs --ssl-certfile")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(
            f"error: cannot load --ssl-certfile {settings.ssl_certfile}"
            + (f" / --ssl-keyfile {settings.ssl_keyfile}" if settings.ssl_keyfile else "")
            + f": {exc}"
        ) from None
    return ctx


def run_proxy(ns: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(ns)
        _configure_logging(settings)
    except ValidationError as exc:
        raise SystemExit(f"error: {one_line(exc, 'settings')}") from None
    except (ValueError, OSError) as exc:  # an instance spec, a log level, a config file that is not there
        raise SystemExit(f"error: {exc}") from None
    if not settings.instances and not settings.instances_file and not settings.k8s_namespace:
        raise SystemExit(
            "no instances: pass --prefill/--decode/--both, --instances-file, --k8s-namespace or --config"
        )
    if settings.tokenizer:
        from vllm_disagg.tokenizer_files import local_tokenizer

        try:  # resolved once here: every worker gets the directory
            settings = settings.model_copy(update={"tokenizer": local_tokenizer(settings.tokenizer)})
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    from vllm_disagg.policy.loader import PolicyLoadError

    try:  # once here, before any worker starts: a policy that does not load is one clear line, not a restart loop
        policy_factory(settings)
    except PolicyLoadError as exc:
        raise SystemExit(f"error: {exc}") from None
    if settings.workers > 1:
        from vllm_disagg.router.workers import supervise

        return supervise(settings)
    run_worker(settings)
    return 0


def _configure_logging(settings: ProxySettings) -> None:
    from vllm_disagg.router.logs import configure

    configure(settings.log_level, settings.log_format)


def run_worker(
    settings: ProxySettings,
    worker: int = 0,
    shared: Any = None,
    sock: socket.socket | None = None,
    journal_dir: str | None = None,
) -> None:
    """One proxy process on uvloop: the whole proxy, or worker ``worker`` of several (``shared``: their load;
    ``journal_dir``: where their admin journal is)."""
    import uvloop

    from vllm_disagg.router.admin_journal import AdminJournal

    proxy = build_proxy(settings)
    journal = AdminJournal(journal_dir, worker, settings.workers) if journal_dir else None
    proxy.set_worker(worker, settings.workers, shared, journal)
    # Threads that share the GIL with the event loop (tokenization's hand-back, KV-event subscribers) hold it for
    # at most this long before the loop gets it back (Python's default is 5 ms, longer than a streamed chunk's gap).
    sys.setswitchinterval(0.0005)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(serve(proxy, settings.host, settings.port, sock=sock))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise
            raise SystemExit(
                f"error: cannot listen on {settings.host}:{settings.port} ({exc.strerror}); stop what holds it or "
                "choose another --port / --host"
            ) from None
