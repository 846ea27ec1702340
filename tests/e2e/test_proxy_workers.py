"""Several proxy processes in front of the same instances: ``--workers 2`` (one port, SO_REUSEPORT) and two separate
replicas (as ``replicas: 2`` behind a Kubernetes Service). Real processes, real sockets, a real ZMQ publisher speaking
vLLM's KV-event wire format: a prefix that one instance announced must route to it whichever process takes the
request, and the workers' shares and shared load must show."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import zmq
from support.proxy_harness import mock_backend

from vllm_disagg.router.shared_load import SharedLoad
from vllm_disagg.router.tokenizer import PromptTokenizer
from vllm_disagg.tools.harness import ProxyServer, free_port

BLOCK = 16
PROMPT = " ".join(f"word{i} and some more text" for i in range(60))


def test_shared_load_is_one_count_over_workers() -> None:
    table = SharedLoad.create(2)
    try:
        w0 = SharedLoad.attach(table.name, 2, 0)
        w1 = SharedLoad.attach(table.name, 2, 1)
        # Slots follow the instance id, not the order a worker met them in.
        assert w0.slot("b") == w1.slot("b") != w1.slot("a") == w0.slot("a")
        w0.add(w0.slot("a"), 2)
        w1.add(w1.slot("a"), 1)
        w1.add(w1.slot("b"), 1)
        assert w0.total(w0.slot("a")) == w1.total(w1.slot("a")) == 3
        assert w0.total(w0.slot("b")) == 1
        w1.close()
        w1 = SharedLoad.attach(table.name, 2, 1)  # a restarted worker starts from zero
        assert w0.total(w0.slot("a")) == 2 and w0.total(w0.slot("b")) == 0
        w0.close()
        w1.close()
    finally:
        table.close()


class _Publisher:
    """vLLM's KV-event PUB (multipart [topic, seq, msgpack batch]); XPUB_VERBOSE reports every subscriber."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    def wait_subscribers(self, n: int, timeout: float = 30.0) -> None:
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < n:
            left = deadline - time.monotonic()
            assert left > 0, f"{seen} of {n} proxy processes subscribed"
            if self.sock.poll(int(left * 1000)) and self.sock.recv()[:1] == b"\x01":
                seen += 1

    def stored(self, token_ids: list[int]) -> None:
        n = len(token_ids) // BLOCK
        event = ["BlockStored", list(range(1000, 1000 + n)), None, token_ids[: n * BLOCK], BLOCK, None, "GPU"]
        payload = msgspec.msgpack.encode([time.time(), [event], None])
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@contextlib.contextmanager
def _proxies(kind: str, a: str, b: str, pub_a: int, pub_b: int, tiny_model: str) -> Iterator[list[str]]:
    args = [
        "--both", f"{a};events=tcp://127.0.0.1:{pub_a};id=a",
        "--both", f"{b};events=tcp://127.0.0.1:{pub_b};id=b",
        "--tokenizer", tiny_model, "--block-size", str(BLOCK), "--log-level", "warning",
        "--prefix-pending-ttl-s", "0",  # routing by the KV events alone: the mock backends announce nothing
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        if kind == "workers":
            server = stack.enter_context(
                ProxyServer("unused", args=[*args, "--workers", "2"], name="proxy-w2")
            )
            yield [server.url]
        else:
            one = stack.enter_context(ProxyServer("unused", args=args, name="proxy-r1"))
            two = stack.enter_context(ProxyServer("unused", args=args, name="proxy-r2"))
            yield [one.url, two.url]


def _path(url: str, body: dict[str, Any]) -> str:
    # A new connection per request: with SO_REUSEPORT the kernel spreads them over the workers.
    with httpx.Client(timeout=30) as client:
        r = client.post(url + "/v1/completions", json=body, headers={"connection": "close"})
    assert r.status_code == 200, r.text
    return r.headers["x-disagg-path"]


def _instance(path: str) -> str:
    fields = dict(f.strip().split("=", 1) for f in path.split(";")[1:] if "=" in f)
    return fields.get("instance") or fields["decode"]


@pytest.mark.parametrize("kind", ["workers", "replicas"])
def test_a_kv_event_prefix_hit_routes_the_same_from_every_proxy_process(kind: str, tiny_model: str) -> None:
    tokens = PromptTokenizer(tiny_model).encode_prompt(PROMPT)
    assert len(tokens) >= 4 * BLOCK
    body = {"model": tiny_model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    ctx: zmq.Context[Any] = zmq.Context()
    pub_a, pub_b = _Publisher(ctx), _Publisher(ctx)
    try:
        with (
            mock_backend(tiny_model) as a,
            mock_backend(tiny_model) as b,
            _proxies(kind, a, b, pub_a.port, pub_b.port, tiny_model) as urls,
        ):
            pub_a.wait_subscribers(2)
            pub_b.wait_subscribers(2)
            # Before any event the two idle instances tie and the cost model takes "a".
            assert _instance(_path(urls[0], body)) == "a"
            pub_b.stored(tokens)
            workers: set[str] = set()
            paths: list[str] = []
            deadline = time.monotonic() + 30
            # Every process must have applied the event: wait until 20 requests in a row, spread over the
            # processes, all go to b.
            streak = 0
            while streak < 20:
                assert time.monotonic() < deadline, paths[-5:]
                url = urls[len(paths) % len(urls)]
                p = _path(url, body)
                paths.append(p)
                streak = streak + 1 if _instance(p) == "b" else 0
                if streak:
                    workers.add(p.rsplit("worker=", 1)[-1] if "worker=" in p else url)
            assert len(workers) == 2, paths[-20:]  # both processes took some of the 20
            if kind == "workers":
                # Each worker adds its counts to the shared files once a second (and when its /metrics is read).
                shown = time.monotonic() + 5
                while True:
                    metrics = httpx.get(urls[0] + "/metrics", timeout=10).text
                    taken = {
                        line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                        for line in metrics.splitlines()
                        if line.startswith("vllm_disagg_worker_requests_total{")
                    }
                    if sum(taken.values()) >= len(paths) + 1 or time.monotonic() > shown:
                        break
                    time.sleep(0.2)
                assert set(taken) == {"0", "1"} and all(v > 0 for v in taken.values()), taken
                assert sum(taken.values()) == len(paths) + 1  # any worker's /metrics shows every worker's
    finally:
        pub_a.sock.close()
        pub_b.sock.close()
        ctx.term()


def _proxy_process(url: str, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_disagg.cli", "proxy", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--both", f"{url};id=a", "--workers", "2", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), port


def test_a_worker_that_cannot_start_fails_the_proxy_instead_of_looping(tmp_path: Path) -> None:
    """What fails in every worker (here a policy that builds in the supervisor's check but not in a worker) fails
    ``--workers 2`` as it fails one worker: the supervisor exits non-zero, so systemd or Kubernetes see the
    failure. A policy that does not load at all is one line before any worker starts."""
    picky = tmp_path / "picky.py"
    picky.write_text(
        "import os\n"
        "from vllm_disagg.router.policies import LeastLoaded\n"
        "class Picky(LeastLoaded):\n"
        "    def __init__(self):\n"
        "        if os.environ.get('PROMETHEUS_MULTIPROC_DIR'):  # set for the workers\n"
        "            raise RuntimeError('not in a worker')\n"
    )
    with mock_backend("m") as url:
        for policy, says in (
            ("no_such_module:Nope", "error: cannot import policy module"),
            (f"{picky}:Picky", "giving up"),
        ):
            proc, _ = _proxy_process(url, "--policy", policy)
            try:
                rc = proc.wait(90)
            finally:
                proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            assert rc != 0 and says in err, err[-2000:]


def test_workers_die_with_a_killed_supervisor() -> None:
    """A supervisor killed outright (OOM, SIGKILL) leaves no worker serving the port beside its replacement."""
    with mock_backend("m") as url:
        proc, port = _proxy_process(url)
        try:
            deadline = time.monotonic() + 60
            children: list[psutil.Process] = []
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        children = psutil.Process(proc.pid).children(recursive=True)
                        if len(children) >= 2:
                            break
                time.sleep(0.2)
            assert len(children) >= 2, "workers did not start"
            proc.kill()
            proc.wait(10)
            gone, alive = psutil.wait_procs(children, timeout=40)
            assert not alive, [c.pid for c in alive]
        finally:
            proc.kill()
            for c in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    if c.ppid() == proc.pid:
                        c.kill()


def test_admin_changes_reach_every_worker(tiny_model: str) -> None:
    """An admin call lands on one worker; drain, add and remove must hold on all of them (the next request may land
    anywhere), and a removed instance's gauges leave /metrics although its workers' files keep them."""
    with (
        mock_backend(tiny_model) as a,
        mock_backend(tiny_model) as b,
        mock_backend(tiny_model) as c,
        ProxyServer(
            "unused",
            args=["--both", f"{a};id=a", "--both", f"{b};id=b", "--tokenizer", tiny_model, "--workers", "2",
                  "--admin-key", "k", "--log-level", "warning"],
            name="proxy-admin",
        ) as proxy,
    ):  # fmt: skip
        admin = {"x-admin-key": "k", "connection": "close"}
        body = {"model": tiny_model, "prompt": "hello there", "max_tokens": 2}

        def routed(n: int) -> list[tuple[str, str]]:
            out = []
            for _ in range(n):
                p = _path(proxy.url, body)
                out.append((p.rsplit("worker=", 1)[-1] if "worker=" in p else "?", _instance(p)))
            return out

        assert {w for w, _ in routed(20)} == {"0", "1"}  # both workers take requests
        r = httpx.post(proxy.url + "/admin/instances/a/drain", headers=admin, timeout=10)
        assert r.status_code == 200 and r.json()["draining"] and r.json()["workers_applied"] == 2, r.text
        after = routed(20)
        assert {w for w, _ in after} == {"0", "1"} and {i for _, i in after} == {"b"}, after
        views = {
            str(sorted((i["id"], i["draining"]) for i in httpx.get(proxy.url + "/admin/instances",
                                                                  headers=admin, timeout=10).json()["instances"]))
            for _ in range(10)
        }  # fmt: skip
        assert views == {str([("a", True), ("b", False)])}
        r = httpx.post(proxy.url + "/admin/instances", headers=admin, json={"url": c, "id": "c"}, timeout=10)
        assert r.status_code == 201 and r.json()["workers_applied"] == 2, r.text
        r = httpx.delete(proxy.url + "/admin/instances/b", headers=admin, timeout=10)
        assert r.status_code == 200 and r.json()["workers_applied"] == 2, r.text
        after = routed(20)
        assert {w for w, _ in after} == {"0", "1"} and {i for _, i in after} == {"c"}, after
        for _ in range(4):  # whichever worker answers
            metrics = httpx.get(proxy.url + "/metrics", headers={"connection": "close"}, timeout=10).text
            assert 'instance="c"' in metrics and 'instance="b"' not in metrics
        # a worker that restarts replays the changes: it joins with a drained, b removed and c added
        assert proxy.proc is not None
        workers = [
            c
            for c in psutil.Process(proxy.proc.pid).children()
            if "resource_tracker" not in " ".join(c.cmdline())
        ]
        assert len(workers) == 2
        workers[0].kill()
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        wrong: list[tuple[str, str]] = []
        while time.monotonic() < deadline and len(seen) < 2:
            with contextlib.suppress(httpx.HTTPError, AssertionError):  # the port while the worker restarts
                for w, i in routed(10):
                    seen.add(w)
                    if i != "c":
                        wrong.append((w, i))
            time.sleep(0.2)
        assert seen == {"0", "1"} and not wrong, wrong


def test_shared_slots_are_reused_once_no_worker_has_the_instance() -> None:
    """Instance ids come and go for the proxy's whole life (a pod name per rollout): a removed instance's slot goes
    to a new id once no worker holds it and nothing is in flight on it."""
    from vllm_disagg.router.shared_load import MAX_SLOTS

    table = SharedLoad.create(2)
    w0, w1 = SharedLoad.attach(table.name, 2, 0), SharedLoad.attach(table.name, 2, 1)
    try:
        busy = w0.slot("busy")
        w0.add(busy, 1)  # a request still in flight on it
        w0.release("busy")
        kept = w1.slot("kept")  # held by one worker only
        for i in range(MAX_SLOTS + 50):
            pod = f"pod-{i}"
            assert w0.slot(pod) == w1.slot(pod) not in (busy, kept)
            w0.release(pod)
            w1.release(pod)
        w0.add(busy, -1)
        assert w0._unused(busy) and not w0._unused(kept)  # ended: reusable; still held: not
    finally:
        w0.close()
        w1.close()
        table.close()
