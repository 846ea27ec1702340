"""The proxy configured the way vLLM's routers are: instance URLs only (no side channel, no local tokenizer).

It must still disaggregate (sequential flow first, then the parallel flow once the prefill's side channel is
learned from its answer), never let a client's ``kv_transfer_params`` reach an instance, and report usage as a
single instance would.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.pd_pair import PDPair, random_prompt
from support.vllm_servers import SECRET, metric, wait_kv_idle

from vllm_disagg.tools.harness import ProxyServer

pytestmark = pytest.mark.vllm

EXTERNAL = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')


def _url_only_proxy(pair: PDPair, *args: str) -> ProxyServer:
    cmd = ["--prefill", pair.prefill.url, "--decode", pair.decode.url, "--shared-secret", SECRET, *args]
    return ProxyServer("unused", args=cmd, name="proxy-urls")


@pytest.fixture(scope="module")
def url_proxy(pd_pair: PDPair) -> Iterator[ProxyServer]:
    server = _url_only_proxy(pd_pair, "--policy", "always-transfer", "--log-level", "info")
    with server:
        yield server


def _post(proxy: ProxyServer, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=timeout)


def _body(model: str, prompt: Any, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def _direct(pair: PDPair, model: str, prompt: Any, **kw: Any) -> dict[str, Any]:
    """The prefill instance serving the request alone (run first: decode has nothing of it cached)."""
    r = httpx.post(pair.prefill.url + "/v1/completions", json=_body(model, prompt, **kw), timeout=120)
    r.raise_for_status()
    return dict(r.json())


def test_url_only_instances_transfer_sequentially_then_in_parallel(
    url_proxy: ProxyServer, pd_pair: PDPair, tiny_model: str
) -> None:
    prompt = random_prompt(1000, 17001)
    ext0 = metric(pd_pair.decode, *EXTERNAL)
    hit0 = metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"')
    r = _post(url_proxy, _body(tiny_model, prompt))
    assert r.status_code == 200, r.text
    path = r.headers["x-disagg-path"]
    assert path.startswith("transfer") and "flow=sequential" in path, path
    # Prefill had none of it cached, so decode counts (almost) the whole prompt as transferred. (With prefill cache
    # hits, vLLM attributes them through remote_prefill_cached_tokens instead.)
    ext = metric(pd_pair.decode, *EXTERNAL) - ext0
    hit = metric(pd_pair.decode, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') - hit0
    assert ext >= 1000 - 128, (ext, hit)  # the prompt came over the wire (hit: decode's own prefix cache)
    assert r.json()["choices"][0]["text"] == _direct(pd_pair, tiny_model, prompt)["choices"][0]["text"]
    # The prefill's side channel was learned from that answer: the next transfers run in parallel.
    deadline = time.monotonic() + 30
    for attempt in range(1000):
        r = _post(
            url_proxy, _body(tiny_model, random_prompt(300, 18000 + attempt))
        )  # seeds no other test uses
        assert r.status_code == 200, r.text
        if "flow=parallel" in r.headers["x-disagg-path"]:
            break
        assert time.monotonic() < deadline, r.headers["x-disagg-path"]
        time.sleep(0.5)
    ext1 = metric(pd_pair.decode, *EXTERNAL)
    r = _post(url_proxy, _body(tiny_model, random_prompt(600, 17002)))
    assert "transfer" in r.headers["x-disagg-path"] and "flow=parallel" in r.headers["x-disagg-path"]
    assert metric(pd_pair.decode, *EXTERNAL) - ext1 >= 600 - 128
    wait_kv_idle(pd_pair.prefill)
    wait_kv_idle(pd_pair.decode)


class _Listener:
    """A TCP socket a hostile client names as its 'prefill': counts every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


def _proxy_metric(proxy: ProxyServer, name: str) -> float:
    for line in httpx.get(proxy.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_side_channels_given_without_the_secret_still_transfer_sequentially(
    pd_pair: PDPair, tiny_model: str
) -> None:
    """Instances with a shared secret, the proxy given their side channels but not the secret: the side channel
    refuses the proxy, which said so only at INFO and then turned P/D off (every request recompute, reason
    no_prefill). It now says so at WARNING and transfers by the sequential flow, which needs no secret in the
    proxy; the greedy answer is the colocated one."""
    cmd = [
        "--prefill",
        pd_pair.spec("prefill"),
        "--decode",
        pd_pair.spec("decode"),
        "--policy",
        "always-transfer",
    ]
    proxy = ProxyServer("unused", args=[*cmd, "--log-level", "info"], name="proxy-side-no-secret")
    prompt = random_prompt(900, 17501)
    with proxy:
        r = _post(proxy, _body(tiny_model, prompt))
        assert r.status_code == 200, r.text
        path = r.headers["x-disagg-path"]
        assert path.startswith("transfer") and "flow=sequential" in path, path
        assert proxy.log_path is not None
        log = proxy.log_path.read_text()
    assert "WARNING" in log and "refused the proxy's connection" in log and "--shared-secret" in log
    assert r.json()["choices"][0]["text"] == _direct(pd_pair, tiny_model, prompt)["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_client_kv_transfer_params_never_reach_an_instance(
    url_proxy: ProxyServer, pd_pair: PDPair, tiny_model: str, stream: bool
) -> None:
    trap = _Listener()
    try:
        before = _proxy_metric(url_proxy, "vllm_disagg_client_kv_transfer_params_total")
        hostile = [
            {
                "do_remote_prefill": True,
                "transfer_id": "evil",
                "remote_host": "127.0.0.1",
                "remote_port": trap.port,
            },
            {"do_remote_decode": True, "transfer_id": "pin-my-blocks"},
            {"remote_prefill_cached_tokens": 10**9, "do_remote_prefill": True},
        ]
        for params in hostile:
            r = _post(
                url_proxy,
                _body(tiny_model, random_prompt(200, 17100), kv_transfer_params=params, stream=stream),
            )
            assert r.status_code == 200, r.text
        time.sleep(1.0)
        assert trap.accepted == 0  # no instance dialled the address the client named
        assert _proxy_metric(url_proxy, "vllm_disagg_client_kv_transfer_params_total") - before == len(
            hostile
        )
        wait_kv_idle(pd_pair.prefill, timeout=10)  # nothing pinned for a phantom transfer (lease is 15 s)
        wait_kv_idle(pd_pair.decode, timeout=10)
    finally:
        trap.close()


def _usage_of_stream(text: str) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("data: {"):
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
    return usage


@pytest.mark.parametrize("stream", [False, True])
def test_usage_equals_a_single_instance(
    url_proxy: ProxyServer, pd_pair: PDPair, tiny_model: str, stream: bool
) -> None:
    seed = 17200 + int(stream)
    extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    direct = httpx.post(
        pd_pair.prefill.url + "/v1/completions",
        json=_body(tiny_model, random_prompt(400, seed), **extra),
        timeout=120,
    )
    want = _usage_of_stream(direct.text) if stream else direct.json()["usage"]
    r = _post(url_proxy, _body(tiny_model, random_prompt(400, seed), **extra))
    assert r.status_code == 200 and r.headers["x-disagg-path"].startswith("transfer"), r.headers
    got = _usage_of_stream(r.text) if stream else r.json()["usage"]
    assert got == want, (got, want)


def test_killing_a_url_only_prefill_mid_run_still_answers_every_request(
    pd_pair: PDPair, tiny_model: str
) -> None:
    """A prefill of its own (killed here), pd_pair's decode, a URL-only proxy: requests before, during and after the
    SIGKILL all get the single-instance answer (transfer, then fall-back recompute; tokenization falls over too)."""
    import concurrent.futures as cf

    from support.vllm_servers import disagg_args

    from vllm_disagg.tools.harness import VLLMServer, free_port

    prompts = [random_prompt(300 + 37 * i, 17300 + i) for i in range(12)]
    want = [_direct(pd_pair, tiny_model, p)["choices"][0]["text"] for p in prompts]
    victim = VLLMServer(tiny_model, args=disagg_args(free_port()), cpu_cores="0", name="prefill-victim")
    with victim:
        cmd = ["--prefill", victim.url, "--decode", pd_pair.decode.url, "--shared-secret", SECRET]
        with ProxyServer("unused", args=[*cmd, "--policy", "always-transfer"], name="proxy-victim") as proxy:
            first = _post(proxy, _body(tiny_model, prompts[0]))
            assert first.status_code == 200 and first.headers["x-disagg-path"].startswith("transfer")
            assert first.json()["choices"][0]["text"] == want[0]

            def ask(i: int) -> tuple[int, str, str]:
                r = _post(proxy, _body(tiny_model, prompts[i]))
                return (
                    r.status_code,
                    r.json()["choices"][0]["text"] if r.status_code == 200 else r.text,
                    r.headers.get("x-disagg-path", ""),
                )

            with cf.ThreadPoolExecutor(4) as ex:
                futures = [ex.submit(ask, i) for i in range(1, len(prompts))]
                time.sleep(1.0)
                victim.kill()
                results = [f.result() for f in futures]
        for i, (status, text, path) in enumerate(results, start=1):
            assert status == 200, (i, text, path)
            assert text == want[i], (i, path)
    wait_kv_idle(pd_pair.decode)


@pytest.mark.parametrize("plan", ["recompute", "colocated"])
def test_usage_equals_a_single_instance_on_local_plans(pd_pair: PDPair, tiny_model: str, plan: str) -> None:
    from support.paths import POLICIES

    if plan == "colocated":
        args = ["--both", pd_pair.decode.url]
    else:
        policy = f"{POLICIES}:PreferVictim"
        args = ["--prefill", pd_pair.prefill.url, "--decode", pd_pair.decode.url, "--policy", policy]
    with ProxyServer("unused", args=[*args, "--shared-secret", SECRET], name=f"proxy-{plan}") as proxy:
        for stream in (False, True):
            seed = 17400 + 2 * int(plan == "colocated") + int(stream)
            extra: dict[str, Any] = (
                {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            )
            direct = httpx.post(
                pd_pair.prefill.url + "/v1/completions",
                json=_body(tiny_model, random_prompt(350, seed), **extra),
                timeout=120,
            )
            want = _usage_of_stream(direct.text) if stream else direct.json()["usage"]
            r = _post(proxy, _body(tiny_model, random_prompt(350, seed), **extra))
            assert r.status_code == 200 and r.headers["x-disagg-path"].startswith(plan), r.headers
            got = _usage_of_stream(r.text) if stream else r.json()["usage"]
            assert got == want, (plan, stream, got, want)
