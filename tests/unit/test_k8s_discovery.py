"""KubernetesDiscovery against a local fake API server that speaks the real pods list/watch protocol.

The fake (an asyncio HTTP/1.1 server on 127.0.0.1) keeps pods with resourceVersions and an event log, serves
``GET /api/v1/namespaces/NS/pods`` as a paginated PodList and ``?watch=1&resourceVersion=RV`` as a chunked
newline-delimited JSON stream, checks the bearer token and the label selector, and expires old versions with
410 Gone, either as an ERROR event in the stream (what the API server does for watches) or as an HTTP 410.
Pod IPs are loopback addresses: discovery only reports them, nothing dials them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.k8s_discovery import (
    KubernetesDiscovery,
    PodConfigError,
    PodTracker,
    in_cluster_config,
    instance_from_pod,
)

NS = "serving"
TOKEN = "test-token"
SELECTOR = "app.kubernetes.io/part-of=vllm-disagg,vllm-disagg/role in (prefill,decode,both)"


# -- label selectors (the fake server filters like the API server) ---------------------------------------------


def _split_selector(selector: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for req in _split_selector(selector):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", req):
            values = {v.strip() for v in m.group(3).split(",")}
            if (labels.get(m.group(1)) in values) != (m.group(2) == "in"):
                return False
        elif "!=" in req:
            k, v = (s.strip() for s in req.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in req:
            k, v = (s.strip() for s in req.split("=", 1))
            if labels.get(k.rstrip("=")) != v.lstrip("="):
                return False
        elif req.startswith("!"):
            if req[1:] in labels:
                return False
        elif req not in labels:
            return False
    return True


def test_selector_matcher() -> None:
    labels = {"app.kubernetes.io/part-of": "vllm-disagg", "vllm-disagg/role": "decode"}
    assert selector_matches(SELECTOR, labels)
    assert not selector_matches(SELECTOR, {**labels, "vllm-disagg/role": "proxy"})
    assert selector_matches("vllm-disagg/role,!other", labels)
    assert not selector_matches("vllm-disagg/role!=decode", labels)


# -- pods --------------------------------------------------------------------------------------------------------


def make_pod(
    name: str,
    role: str | None,
    ip: str,
    *,
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    ports: dict[str, int] | None = None,
) -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": "vllm-disagg"}
    if role is not None:
        labels["vllm-disagg/role"] = role
    if ports is None:
        ports = {"http": 8000, "side-channel": 5700, "kv-events": 5557, "kv-replay": 5558}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels, "annotations": annotations or {}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "x",
                    "ports": [{"name": k, "containerPort": v} for k, v in ports.items()],
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_instance_from_named_ports() -> None:
    cfg = instance_from_pod(make_pod("p-1", "prefill", "127.0.1.1"))
    assert cfg == InstanceConfig(
        url="http://127.0.1.1:8000",
        role="prefill",
        id="p-1",
        side_channel="127.0.1.1:5700",
        kv_events="tcp://127.0.1.1:5557",
        kv_events_replay="tcp://127.0.1.1:5558",
    )
    assert cfg.side_channel_addr() == ("127.0.1.1", 5700)


def test_instance_from_annotations_override_ports() -> None:
    pod = make_pod(
        "d-1",
        "decode",
        "fd00::7",
        ports={"http": 8000},
        annotations={
            "vllm-disagg/http-port": "9000",
            "vllm-disagg/side-channel": "5800",
            "vllm-disagg/kv-events": "tcp://*:6557",
            "vllm-disagg/kv-events-replay": "6558",
        },
    )
    cfg = instance_from_pod(pod)
    assert cfg is not None
    assert cfg.url == "http://[fd00::7]:9000"
    assert cfg.side_channel_addr() == ("fd00::7", 5800)
    assert cfg.kv_events == "tcp://[fd00::7]:6557"
    assert cfg.kv_events_replay == "tcp://[fd00::7]:6558"


def test_instance_defaults_and_not_ready() -> None:
    cfg = instance_from_pod(make_pod("b", "both", "127.0.1.9", ports={}))
    assert cfg is not None and cfg.url == "http://127.0.1.9:8000" and cfg.side_channel is None
    assert cfg.kv_events is None
    assert instance_from_pod(make_pod("b", "both", "127.0.1.9", ready=False)) is None
    terminating = make_pod("b", "both", "127.0.1.9")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert instance_from_pod(terminating) is None
    pending = make_pod("b", "both", "127.0.1.9")
    pending["status"] = {"phase": "Pending"}
    assert instance_from_pod(pending) is None


def test_misconfigured_pods_are_errors() -> None:
    with pytest.raises(PodConfigError, match="vllm-disagg/role"):
        instance_from_pod(make_pod("x", "proxy", "127.0.1.1"))
    with pytest.raises(PodConfigError, match="side-channel"):
        instance_from_pod(
            make_pod("x", "decode", "127.0.1.1", annotations={"vllm-disagg/side-channel": "abc"})
        )


def test_tracker_diffs() -> None:
    t = PodTracker()
    a = make_pod("a", "prefill", "127.0.1.1")
    assert [c.op for c in t.event("ADDED", a)] == ["add"]
    assert t.event("MODIFIED", a) == []  # same instance: nothing to tell
    moved = make_pod("a", "prefill", "127.0.1.2")
    assert [(c.op, c.instance_id or c.pod) for c in t.event("MODIFIED", moved)] == [
        ("remove", "a"),
        ("add", "a"),
    ]
    b = make_pod("b", "decode", "127.0.1.3")
    t.event("ADDED", b)
    # A re-list that no longer has "a" (its DELETED event was lost) removes it; "b" is unchanged.
    assert [(c.op, c.pod) for c in t.resync([b])] == [("remove", "a")]
    assert [c.op for c in t.event("DELETED", b)] == ["remove"]
    assert t.known == {}


def test_in_cluster_config(tmp_path: Path) -> None:
    url, token, ca = in_cluster_config(
        {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}, tmp_path
    )
    assert (url, token, ca) == ("https://[fd00::1]:6443", tmp_path / "token", tmp_path / "ca.crt")
    with pytest.raises(RuntimeError, match="api_url"):
        in_cluster_config({}, tmp_path)


def test_in_cluster_token_is_reread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_disagg.router.k8s_discovery as mod

    monkeypatch.setattr(mod, "SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(mod, "in_cluster_config", lambda: in_cluster_config(sa_dir=tmp_path))
    (tmp_path / "token").write_text("one\n")
    (tmp_path / "ca.crt").write_text("not used here")

    async def noop(_: Any) -> None:
        return None

    disc = KubernetesDiscovery(NS, SELECTOR, noop, noop)
    assert disc.api_url == "https://10.96.0.1:443"
    assert disc._verify == str(tmp_path / "ca.crt")
    assert disc._headers()["Authorization"] == "Bearer one"
    (tmp_path / "token").write_text("two\n")  # the kubelet rotated it
    assert disc._headers()["Authorization"] == "Bearer two"


# -- the fake API server ----------------------------------------------------------------------------------------


class FakeKubeAPI:
    """Pods in one namespace with list (paginated) and watch (chunked NDJSON), resourceVersions and 410 Gone."""

    def __init__(self, page_size: int = 2) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 1000
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_rv = 0  # a watch from below this version is answered with 410 Gone
        self.gone_as_http = False  # 410 as an HTTP status instead of an ERROR event
        self.page_size = page_size
        self.changed = asyncio.Condition()
        self.generation = 0  # bumped to end every open watch
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            async with self.changed:
                self.generation += 1
                self.changed.notify_all()

    # mutations (each is one event, like the API server's watch cache)
    async def _record(self, kind: str, pod: dict[str, Any], *, event: bool = True) -> None:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        if event:
            self.log.append((self.rv, kind, pod))
        async with self.changed:
            self.changed.notify_all()

    async def put(self, pod: dict[str, Any]) -> None:
        await self._record("MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED", pod)

    async def set_ready(self, name: str, ready: bool = True) -> None:
        pod = copy.deepcopy(self.pods[name])
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        await self.put(pod)

    async def start_deletion(self, name: str) -> None:
        pod = copy.deepcopy(self.pods[name])
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        await self.put(pod)

    async def delete(self, name: str, *, event: bool = True) -> None:
        await self._record("DELETED", self.pods[name], event=event)

    async def bookmark(self) -> None:
        self.log.append(
            (
                self.rv,
                "BOOKMARK",
                {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}},
            )
        )
        async with self.changed:
            self.changed.notify_all()

    async def compact(self) -> None:
        """Forget history: open watches get 410 and re-watching from any older version does too."""
        self.oldest_rv = self.rv + 1
        async with self.changed:
            self.changed.notify_all()

    async def end_watches(self) -> None:
        """End open watch streams cleanly, as the API server does at timeoutSeconds."""
        async with self.changed:
            self.generation += 1
            self.changed.notify_all()

    # HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode()
            if not request_line.strip():
                return  # a connection opened and closed without a request
            headers: dict[str, str] = {}
            while (line := (await reader.readline()).decode()) not in ("\r\n", "\n", ""):
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            method, target, _ = request_line.split(" ", 2)
            parts = urlsplit(target)
            query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            self.requests.append((parts.path, query))
            if headers.get("authorization") != f"Bearer {TOKEN}":
                await self._send(writer, 401, self._status(401, "Unauthorized", "Unauthorized"))
            elif method != "GET" or parts.path != f"/api/v1/namespaces/{NS}/pods":
                await self._send(writer, 404, self._status(404, "NotFound", "not found"))
            elif query.get("watch") in ("1", "true"):
                await self._watch(writer, query)
            else:
                await self._list(writer, query)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        head = f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + data)
        await writer.drain()

    def _selected(self, pod: dict[str, Any], query: dict[str, str]) -> bool:
        return selector_matches(query.get("labelSelector", ""), pod["metadata"].get("labels") or {})

    async def _list(self, writer: asyncio.StreamWriter, query: dict[str, str]) -> None:
        names = sorted(n for n, p in self.pods.items() if self._selected(p, query))
        start = int(query.get("continue") or 0)
        limit = min(int(query.get("limit") or 10**9), self.page_size)
        page = names[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if start + limit < len(names):
            meta["continue"] = str(start + limit)
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": meta,
            "items": [self.pods[n] for n in page],
        }
        await self._send(writer, 200, body)

    async def _watch(self, writer: asyncio.StreamWriter, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or self.rv)
        gone = self._status(410, "Expired", f"too old resource version: {since} ({self.oldest_rv})")
        if since < self.oldest_rv and self.gone_as_http:
            await self._send(writer, 410, gone)
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )

        def chunk(obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode() + b"\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        generation = self.generation
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds") or 60)
        while True:
            if since < self.oldest_rv:
                if not self.gone_as_http:  # else: end the stream; the re-watch gets HTTP 410
                    chunk({"type": "ERROR", "object": gone})
                break
            for rv, kind, obj in self.log:
                if rv > since or (
                    kind == "BOOKMARK" and rv == since and query.get("allowWatchBookmarks") == "true"
                ):
                    if kind == "BOOKMARK" or self._selected(obj, query):
                        chunk({"type": kind, "object": obj})
                    since = max(since, rv)
            self.log = [e for e in self.log if e[1] != "BOOKMARK"]
            await writer.drain()
            if self.generation != generation or loop.time() > deadline:
                break
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), 0.5)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


# -- discovery against the fake ----------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.changed = asyncio.Event()
        self.fail_adds = 0

    async def on_add(self, cfg: InstanceConfig) -> None:
        if self.fail_adds:
            self.fail_adds -= 1
            raise RuntimeError("proxy refused the instance")
        self.events.append(("add", cfg))
        self.changed.set()

    async def on_remove(self, instance_id: str) -> None:
        self.events.append(("remove", instance_id))
        self.changed.set()

    async def wait_for(self, pred: Callable[[list[tuple[str, Any]]], bool], timeout: float = 5.0) -> None:
        async def loop() -> None:
            while not pred(self.events):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)

    def summary(self) -> list[tuple[str, str]]:
        return [(op, x.id if isinstance(x, InstanceConfig) else x) for op, x in self.events]


def with_discovery(
    body: Callable[[FakeKubeAPI, KubernetesDiscovery, Recorder], Awaitable[None]],
    setup: Callable[[FakeKubeAPI], Awaitable[None]] | None = None,
    token: str = TOKEN,
) -> None:
    async def main() -> None:
        fake = FakeKubeAPI()
        url = await fake.start()
        if setup is not None:
            await setup(fake)
        rec = Recorder()
        disc = KubernetesDiscovery(
            NS, SELECTOR, rec.on_add, rec.on_remove, api_url=url, token=token, verify=False
        )
        disc.min_backoff_s = 0.05
        disc.max_backoff_s = 0.2
        task = asyncio.create_task(disc.run())
        try:
            await body(fake, disc, rec)
        finally:
            disc.stop()
            await asyncio.wait_for(task, 5)
            await fake.close()

    asyncio.run(main())


async def _initial(fake: FakeKubeAPI) -> None:
    await fake.put(make_pod("prefill-0", "prefill", "127.0.1.1"))
    await fake.put(make_pod("prefill-1", "prefill", "127.0.1.2"))
    await fake.put(make_pod("decode-0", "decode", "127.0.1.3", ready=False))
    await fake.put(make_pod("proxy-0", None, "127.0.1.4"))  # no role label: not selected
    await fake.put(make_pod("odd-0", "both", "127.0.1.5", annotations={"vllm-disagg/http-port": "x"}))


def test_pods_appear_become_ready_and_go() -> None:
    async def body(fake: FakeKubeAPI, disc: KubernetesDiscovery, rec: Recorder) -> None:
        await asyncio.wait_for(disc.synced.wait(), 5)
        # The list came in pages (page size 2) and only the two Ready prefill pods were announced.
        assert sorted(rec.summary()) == [("add", "prefill-0"), ("add", "prefill-1")]
        assert sum(1 for p, q in fake.requests if "continue" in q) == 1  # 4 selected pods, pages of 2
        first = next(cfg for op, cfg in rec.events if op == "add" and cfg.id == "prefill-0")
        assert first.url == "http://127.0.1.1:8000" and first.role == "prefill"
        assert first.side_channel == "127.0.1.1:5700" and first.kv_events == "tcp://127.0.1.1:5557"

        await fake.set_ready("decode-0")
        await rec.wait_for(lambda ev: ("add", "decode-0") in [(o, getattr(x, "id", x)) for o, x in ev])
        dec = rec.events[-1][1]
        assert dec.role == "decode" and dec.url == "http://127.0.1.3:8000"

        await fake.put(make_pod("decode-1", "decode", "127.0.1.6"))  # created Ready
        await rec.wait_for(lambda ev: len(ev) == 4)
        assert rec.summary()[-1] == ("add", "decode-1")

        await fake.start_deletion("decode-0")  # terminating: removed before the pod is gone
        await rec.wait_for(lambda ev: len(ev) == 5)
        assert rec.summary()[-1] == ("remove", "decode-0")
        await fake.delete("decode-0")
        await fake.set_ready("prefill-1", False)  # readiness lost: removed
        await rec.wait_for(lambda ev: len(ev) == 6)
        assert rec.summary()[-1] == ("remove", "prefill-1")
        await fake.delete("prefill-0")
        await rec.wait_for(lambda ev: len(ev) == 7)
        assert rec.summary()[-1] == ("remove", "prefill-0")

        # The same name back with a new IP (a StatefulSet-style restart): remove + add, never a stale address.
        await fake.put(make_pod("decode-1", "decode", "127.0.1.7"))
        await rec.wait_for(lambda ev: len(ev) == 9)
        assert rec.summary()[-2:] == [("remove", "decode-1"), ("add", "decode-1")]
        assert rec.events[-1][1].url == "http://127.0.1.7:8000"
        assert set(disc.instances) == {"decode-1"}
        # Watches carried the selector and resumed from the versions they had seen.
        watches = [q for p, q in fake.requests if q.get("watch")]
        assert watches and all(q["labelSelector"] == SELECTOR and q["resourceVersion"] for q in watches)

    with_discovery(body, _initial)


def test_watch_reopens_from_last_version_without_relisting() -> None:
    async def body(fake: FakeKubeAPI, disc: KubernetesDiscovery, rec: Recorder) -> None:
        await asyncio.wait_for(disc.synced.wait(), 5)
        lists = sum(1 for _, q in fake.requests if not q.get("watch") and "continue" not in q)
        await fake.bookmark()
        await fake.end_watches()  # like timeoutSeconds
        await fake.put(make_pod("decode-9", "decode", "127.0.1.9"))
        await rec.wait_for(lambda ev: ("add", "decode-9") in [(o, getattr(x, "id", x)) for o, x in ev])
        assert sum(1 for _, q in fake.requests if not q.get("watch") and "continue" not in q) == lists

    with_discovery(body, _initial)


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
def test_gone_relists_and_catches_lost_deletes(as_http: bool) -> None:
    async def body(fake: FakeKubeAPI, disc: KubernetesDiscovery, rec: Recorder) -> None:
        await asyncio.wait_for(disc.synced.wait(), 5)
        fake.gone_as_http = as_http
        # History the watch never sees: prefill-1 vanishes and decode-0 becomes Ready, then it is compacted.
        await fake.delete("prefill-1", event=False)
        pod = copy.deepcopy(fake.pods["decode-0"])
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        fake.pods["decode-0"] = pod
        fake.rv += 1
        await fake.compact()
        await rec.wait_for(lambda ev: len(ev) == 4)
        assert sorted(rec.summary()[2:]) == [("add", "decode-0"), ("remove", "prefill-1")]
        assert disc.resource_version is not None and int(disc.resource_version) >= fake.oldest_rv - 1
        assert set(disc.instances) == {"prefill-0", "decode-0"}

    with_discovery(body, _initial)


def test_failed_add_is_retried_on_next_event() -> None:
    async def body(fake: FakeKubeAPI, disc: KubernetesDiscovery, rec: Recorder) -> None:
        await asyncio.wait_for(disc.synced.wait(), 5)
        rec.fail_adds = 1
        await fake.set_ready("decode-0")
        await asyncio.sleep(0.2)
        assert "decode-0" not in disc.instances
        await fake.put(fake.pods["decode-0"])  # any later event (here a status update) retries
        await rec.wait_for(lambda ev: ("add", "decode-0") in [(o, getattr(x, "id", x)) for o, x in ev])

    with_discovery(body, _initial)


def test_bad_token_retries_and_stop_returns() -> None:
    async def body(fake: FakeKubeAPI, disc: KubernetesDiscovery, rec: Recorder) -> None:
        for _ in range(100):
            if len(fake.requests) >= 2:
                break
            await asyncio.sleep(0.05)
        assert rec.events == [] and not disc.synced.is_set()
        assert len(fake.requests) >= 2  # retried with backoff, not given up

    with_discovery(body, _initial, token="wrong")


def test_stop_before_run_returns_at_once() -> None:
    async def main() -> None:
        async def noop(_: Any) -> None:
            return None

        disc = KubernetesDiscovery(NS, SELECTOR, noop, noop, api_url="http://127.0.0.1:9", token="t")
        disc.stop()
        await asyncio.wait_for(disc.run(), 1)

    asyncio.run(main())
