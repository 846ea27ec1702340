"""Kubernetes discovery for the proxy: list, then watch, pods by label selector; Ready pods become instances.

Why the raw REST API and not the ``kubernetes`` client package: the proxy stays small (httpx only, async, no
vLLM/torch) and the protocol is small too: ``GET /api/v1/namespaces/NS/pods?labelSelector=S`` returns a PodList
and its ``resourceVersion``; ``...&watch=1&resourceVersion=RV`` then streams newline-delimited JSON events
(ADDED, MODIFIED, DELETED, BOOKMARK, ERROR). A watch whose resourceVersion the API server no longer keeps ends with
410 Gone (an HTTP status or an ERROR event); the only correct answer is to list again and diff.

A pod maps to an :class:`InstanceConfig` (see :func:`instance_from_pod`):

* role: the label ``vllm-disagg/role`` (``prefill``, ``decode`` or ``both``);
* id: the pod name (stable for the pod's life; metrics and admin calls show it);
* url: ``http://POD_IP:PORT``, PORT from the annotation ``vllm-disagg/http-port``, else the container port named
  ``http``, else 8000;
* side channel: annotation ``vllm-disagg/side-channel`` (``PORT`` or ``HOST:PORT``), else the port named
  ``side-channel``;
* KV events / replay: annotations ``vllm-disagg/kv-events`` / ``vllm-disagg/kv-events-replay`` (``PORT`` or a ZMQ
  endpoint; ``tcp://*:PORT``, vLLM's bind form, means the pod IP), else the ports named ``kv-events`` /
  ``kv-replay``.

Only Running pods with the Ready condition, a pod IP and no deletionTimestamp count: a terminating pod is removed
as soon as deletion starts, so the proxy drains it before vLLM gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.transport.endpoints import bracketed, tcp_endpoint

log = logging.getLogger(__name__)

ROLE_LABEL = "vllm-disagg/role"
ANN_HTTP_PORT = "vllm-disagg/http-port"
ANN_SIDE_CHANNEL = "vllm-disagg/side-channel"
ANN_KV_EVENTS = "vllm-disagg/kv-events"
ANN_KV_REPLAY = "vllm-disagg/kv-events-replay"
PORT_HTTP = "http"
PORT_SIDE_CHANNEL = "side-channel"
PORT_KV_EVENTS = "kv-events"
PORT_KV_REPLAY = "kv-replay"
DEFAULT_HTTP_PORT = 8000
ROLES = ("prefill", "decode", "both")
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

OnAdd = Callable[[InstanceConfig], Awaitable[None]]
OnRemove = Callable[[str], Awaitable[None]]


class PodConfigError(ValueError):
    """A selected pod whose labels or annotations cannot describe an instance (it is skipped and logged)."""


# -- pure mapping: pod JSON -> InstanceConfig ----------------------------------------------------------------


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, has an IP, and is not being deleted: only then may the proxy send it traffic."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _named_ports(pod: Mapping[str, Any]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") and port.get("containerPort"):
                ports.setdefault(str(port["name"]), int(port["containerPort"]))
    return ports


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise PodConfigError(f"{what}: {text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise PodConfigError(f"{what}: port {port} out of range")
    return port


def _zmq_endpoint(value: str | None, named: int | None, ip: str, what: str) -> str | None:
    if value:
        if "://" not in value:
            return tcp_endpoint(ip, _port(value, what))
        scheme, _, rest = value.partition("://")
        host, _, port = rest.rpartition(":")
        _port(port, what)
        if host in ("*", "0.0.0.0", "[::]", ""):
            host = bracketed(ip)
        return f"{scheme}://{host}:{port}"
    return tcp_endpoint(ip, named) if named else None


def instance_from_pod(pod: Mapping[str, Any]) -> InstanceConfig | None:
    """The instance a pod serves as, or None while it is not Ready; PodConfigError if it is misconfigured."""
    if not pod_is_ready(pod):
        return None
    meta = pod.get("metadata") or {}
    name = str(meta.get("name") or "")
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    role = labels.get(ROLE_LABEL)
    if role not in ROLES:
        raise PodConfigError(f"pod {name}: label {ROLE_LABEL}={role!r}; expected one of {', '.join(ROLES)}")
    ip = str(pod["status"]["podIP"])
    ports = _named_ports(pod)

    http_port = (
        _port(ann[ANN_HTTP_PORT], f"pod {name}: {ANN_HTTP_PORT}")
        if ANN_HTTP_PORT in ann
        else ports.get(PORT_HTTP, DEFAULT_HTTP_PORT)
    )
    side: str | None = None
    if ann.get(ANN_SIDE_CHANNEL):
        host, _, port = str(ann[ANN_SIDE_CHANNEL]).rpartition(":")
        # Unbracketed host:port: InstanceConfig splits on the last colon, which also works for IPv6.
        side = f"{host.strip('[]') or ip}:{_port(port, f'pod {name}: {ANN_SIDE_CHANNEL}')}"
    elif PORT_SIDE_CHANNEL in ports:
        side = f"{ip}:{ports[PORT_SIDE_CHANNEL]}"
    try:
        return InstanceConfig(
            url=f"http://{bracketed(ip)}:{http_port}",
            role=role,
            id=name,
            side_channel=side,
            kv_events=_zmq_endpoint(
                ann.get(ANN_KV_EVENTS), ports.get(PORT_KV_EVENTS), ip, f"pod {name}: {ANN_KV_EVENTS}"
            ),
            kv_events_replay=_zmq_endpoint(
                ann.get(ANN_KV_REPLAY), ports.get(PORT_KV_REPLAY), ip, f"pod {name}: {ANN_KV_REPLAY}"
            ),
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise PodConfigError(f"pod {name}: {exc}") from None


# -- pure state: which instances the proxy has been told about -------------------------------------------------


@dataclass(frozen=True)
class Change:
    op: Literal["add", "remove"]
    pod: str
    instance: InstanceConfig | None = None  # set for "add"
    instance_id: str = ""  # set for "remove"


class PodTracker:
    """Pod name -> the instance announced for it; turns events and re-lists into add/remove changes.

    A pod whose instance changes (new IP after a restart under the same name, new ports) is removed and added
    again, so the proxy never keeps a stale address under a live id.
    """

    def __init__(self) -> None:
        self.known: dict[str, InstanceConfig] = {}

    def _set(self, name: str, cfg: InstanceConfig | None) -> list[Change]:
        old = self.known.get(name)
        if old == cfg:
            return []
        changes: list[Change] = []
        if old is not None:
            del self.known[name]
            changes.append(Change("remove", name, instance_id=old.instance_id()))
        if cfg is not None:
            self.known[name] = cfg
            changes.append(Change("add", name, instance=cfg))
        return changes

    def _desired(self, pod: Mapping[str, Any]) -> InstanceConfig | None:
        try:
            return instance_from_pod(pod)
        except PodConfigError as exc:
            log.warning("k8s discovery: skipping %s", exc)
            return None

    def event(self, kind: str, pod: Mapping[str, Any]) -> list[Change]:
        name = str((pod.get("metadata") or {}).get("name") or "")
        if not name:
            return []
        return self._set(name, None if kind == "DELETED" else self._desired(pod))

    def resync(self, pods: Iterable[Mapping[str, Any]]) -> list[Change]:
        """A full list: pods missing from it are gone (their DELETED events may have been lost)."""
        listed = {str(p["metadata"]["name"]): p for p in pods if (p.get("metadata") or {}).get("name")}
        changes: list[Change] = []
        for name in [n for n in self.known if n not in listed]:
            changes += self._set(name, None)
        for name, pod in listed.items():
            changes += self._set(name, self._desired(pod))
        return changes

    def forget(self, name: str) -> None:
        """An add the proxy refused: forget it so the next event or re-list tries again."""
        self.known.pop(name, None)


# -- I/O -------------------------------------------------------------------------------------------------------


class _Expired(Exception):
    """410 Gone: the resourceVersion (or list continue token) is too old; list again."""


class _ApiError(Exception):
    pass


def in_cluster_config(
    env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> tuple[str, Path, Path]:
    """(API base URL, token file, CA file) from the pod's environment and mounted service account."""
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): pass api_url")
    return f"https://{bracketed(host)}:{port}", sa_dir / "token", sa_dir / "ca.crt"


class KubernetesDiscovery:
    """Keeps the proxy's instance set equal to the Ready pods matching ``selector`` in ``namespace``.

    ``on_add(InstanceConfig)`` / ``on_remove(instance_id)`` are awaited in event order. ``run()`` lists, then
    watches, until cancelled or ``stop()``; API errors are logged and retried with backoff, never raised.
    """

    watch_timeout_s = 300  # the API server ends each watch after this; we re-watch from the last version
    min_backoff_s = 0.5
    max_backoff_s = 30.0
    page_size = 500

    def __init__(
        self,
        namespace: str,
        selector: str,
        on_add: OnAdd,
        on_remove: OnRemove,
        *,
        api_url: str | None = None,
        token: str | None = None,
        verify: bool | str = True,
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self.on_add = on_add
        self.on_remove = on_remove
        self.tracker = PodTracker()
        self.synced = asyncio.Event()  # set after the first complete list has been applied
        self.resource_version: str | None = None
        self._token = token
        self._token_file: Path | None = None
        self._verify: bool | str = verify
        if api_url is None:
            api_url, token_file, ca_file = in_cluster_config()
            if token is None:
                self._token_file = token_file
            if verify is True and ca_file.exists():
                self._verify = str(ca_file)
        self.api_url = api_url.rstrip("/")
        self._stopped = False
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def instances(self) -> dict[str, InstanceConfig]:
        return dict(self.tracker.known)

    def stop(self) -> None:
        """Make ``run()`` return; safe from any thread, before or during ``run()``."""
        self._stopped = True
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stopped:
            return
        async with self._client() as client:
            worker = asyncio.create_task(self._list_and_watch(client))
            stopper = asyncio.create_task(self._stop_event.wait())
            try:
                await asyncio.wait({worker, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (worker, stopper):
                    task.cancel()
                await asyncio.gather(worker, stopper, return_exceptions=True)
            error = None if worker.cancelled() else worker.exception()
            if error is not None:
                raise error

    # -- HTTP ------------------------------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        verify: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=self._verify) if isinstance(self._verify, str) else self._verify
        )
        timeout = httpx.Timeout(10.0, read=self.watch_timeout_s + 30.0)
        return httpx.AsyncClient(base_url=self.api_url, verify=verify, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._token
        if self._token_file is not None:
            # Bound service-account tokens rotate; the kubelet rewrites the file, so read it per request.
            with contextlib.suppress(OSError):
                token = self._token_file.read_text().strip()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    @staticmethod
    def _check(resp: httpx.Response, body: bytes) -> None:
        if resp.status_code == 410:
            raise _Expired(body[:200].decode(errors="replace"))
        if resp.status_code >= 400:
            hint = (
                " (may the proxy's ServiceAccount list and watch pods? see its Role)"
                if resp.status_code == 403
                else ""
            )
            raise _ApiError(f"HTTP {resp.status_code}{hint}: {body[:300].decode(errors='replace')}")

    async def _list(self, client: httpx.AsyncClient) -> str:
        pods: list[dict[str, Any]] = []
        params: dict[str, str | int] = {"labelSelector": self.selector, "limit": self.page_size}
        while True:
            resp = await client.get(self._path, params=params, headers=self._headers())
            self._check(resp, resp.content)
            page = resp.json()
            pods += page.get("items") or []
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        version = str(meta.get("resourceVersion") or "")
        log.info(
            "k8s discovery: %d pods match %r in %s (version %s)",
            len(pods),
            self.selector,
            self.namespace,
            version,
        )
        await self._apply(self.tracker.resync(pods))
        self.synced.set()
        return version

    async def _watch(self, client: httpx.AsyncClient) -> None:
        params: dict[str, str | int] = {
            "labelSelector": self.selector,
            "watch": 1,
            "resourceVersion": self.resource_version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": self.watch_timeout_s,
        }
        async with client.stream("GET", self._path, params=params, headers=self._headers()) as resp:
            if resp.status_code >= 400:
                self._check(resp, await resp.aread())
            async for line in resp.aiter_lines():
                if line.strip():
                    await self._event(json.loads(line))

    async def _event(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("type"))
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired(str(obj.get("message")))
            raise _ApiError(f"watch error: {obj.get('code')} {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            await self._apply(self.tracker.event(kind, obj))
        if version:
            self.resource_version = str(version)

    async def _apply(self, changes: list[Change]) -> None:
        for change in changes:
            try:
                if change.op == "add" and change.instance is not None:
                    log.info(
                        "k8s discovery: add %s (%s) %s", change.pod, change.instance.role, change.instance.url
                    )
                    await self.on_add(change.instance)
                else:
                    log.info("k8s discovery: remove %s", change.instance_id)
                    await self.on_remove(change.instance_id)
            except Exception:
                log.exception("k8s discovery: %s callback failed for pod %s", change.op, change.pod)
                if change.op == "add":
                    self.tracker.forget(change.pod)

    async def _list_and_watch(self, client: httpx.AsyncClient) -> None:
        backoff = self.min_backoff_s
        loop = asyncio.get_running_loop()
        while not self._stopped:
            try:
                if self.resource_version is None:
                    self.resource_version = await self._list(client)
                started = loop.time()
                await self._watch(client)
                # A watch that ends cleanly (the server's timeoutSeconds) is re-opened at once; one that ends
                # as soon as it starts (a proxy in the way?) must not spin.
                backoff = self.min_backoff_s
                if loop.time() - started < 1.0:
                    await asyncio.sleep(self.min_backoff_s)
            except _Expired as exc:
                log.info("k8s discovery: version %s expired (%s); listing again", self.resource_version, exc)
                self.resource_version = None
            except (httpx.HTTPError, _ApiError, ValueError) as exc:
                log.warning("k8s discovery: %s; retrying in %.1f s", exc or type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
