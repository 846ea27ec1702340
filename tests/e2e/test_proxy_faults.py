"""The proxy's fallback ladder with real processes dying: a prefill killed mid-run, a decode killed."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from support.paths import POLICIES
from support.pd_pair import PDPair, random_prompt
from support.vllm_servers import SECRET, complete, disagg_args, metric, tokens, wait_kv_idle

from vllm_disagg.tools.harness import ProxyServer, VLLMServer, free_port, start_many

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def victims(tiny_model: str) -> Iterator[tuple[VLLMServer, int, VLLMServer, int]]:
    """A prefill and a decode instance that the tests kill."""
    p_side, d_side = free_port(), free_port()
    p = VLLMServer(tiny_model, args=disagg_args(p_side), cpu_cores="0", name="victim-prefill")
    d = VLLMServer(tiny_model, args=disagg_args(d_side), cpu_cores="1", name="victim-decode")
    start_many([p, d])
    try:
        yield p, p_side, d, d_side
    finally:
        p.stop()
        d.stop()


def _proxy(*args: str, tiny_model: str, env: dict[str, str] | None = None) -> ProxyServer:
    return ProxyServer(
        "unused",
        args=[*args, "--tokenizer", tiny_model, "--shared-secret", SECRET, "--log-level", "info"],
        env=env or {},
    )


def _ask(proxy: ProxyServer, model: str, prompt: list[int]) -> tuple[int, list[int], str]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
    toks = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else []
    return r.status_code, toks, r.headers.get("x-disagg-path", "")


def test_killing_the_prefill_mid_run_loses_no_request(
    pd_pair: PDPair, victims: tuple[VLLMServer, int, VLLMServer, int], tiny_model: str
) -> None:
    victim_p, p_side, _, _ = victims
    prompts = [random_prompt(900, 7000 + i) for i in range(64)]
    refs = [tokens(complete(pd_pair.prefill, tiny_model, p, max_tokens=8)) for p in prompts]
    proxy = _proxy(
        "--prefill", f"{victim_p.url};side=127.0.0.1:{p_side};id=victim-prefill",
        "--decode", pd_pair.spec("decode"),
        "--policy", "always-transfer",
        tiny_model=tiny_model,
    )  # fmt: skip
    with proxy, cf.ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(_ask, proxy, tiny_model, p) for p in prompts]
        time.sleep(1.5)  # some requests done, some mid-transfer, some not yet sent
        victim_p.kill()
        results = [f.result() for f in futures]
    for (status, out, path), ref in zip(results, refs, strict=True):
        assert status == 200, path
        assert out == ref, path
    # Requests after the kill fell back (prefill leg failed -> recompute on decode), visibly.
    assert any("fallback=prefill_failed" in path or path.startswith("recompute") for _, _, path in results), (
        results
    )
    wait_kv_idle(pd_pair.decode)


def test_a_dead_decode_is_retried_elsewhere_before_the_first_token(
    pd_pair: PDPair, victims: tuple[VLLMServer, int, VLLMServer, int], tiny_model: str
) -> None:
    _, _, victim_d, d_side = victims
    proxy = _proxy(
        "--prefill", pd_pair.spec("prefill"),
        "--decode", f"{victim_d.url};side=127.0.0.1:{d_side};id=victim-decode",
        "--decode", pd_pair.spec("decode"),
        "--policy", f"{POLICIES}:PreferVictim",
        tiny_model=tiny_model,
        env={"VLLM_DISAGG_PROXY_HEALTH_INTERVAL_S": "60"},  # only passive health can notice the death
    )  # fmt: skip
    expired = metric(pd_pair.prefill, "vllm:disagg_leases_expired_total")
    with proxy:
        victim_d.kill()  # dies after registration: the proxy still believes it healthy
        outcomes = [_ask(proxy, tiny_model, random_prompt(400, 7100 + i)) for i in range(6)]
        prom = httpx.get(proxy.url + "/metrics").text
        # what prefill held for the dead decode is freed (its leg aborted, or released), not left to the lease
        wait_kv_idle(pd_pair.prefill, timeout=10)
    assert all(status == 200 for status, _, _ in outcomes), outcomes
    assert all("decode=decode" in path or "instance=decode" in path for _, _, path in outcomes), outcomes
    assert 'reason="decode_unreachable"' in prom  # at least one request hit the dead decode and was retried
    assert metric(pd_pair.prefill, "vllm:disagg_leases_expired_total") == expired


class _FailingDecode(BaseHTTPRequestHandler):
    """A decode that is healthy to probes but answers every completion with HTTP 503 after a second (overloaded,
    draining): by then prefill has finished its leg and holds the prompt's KV for a decode that will not load it."""

    protocol_version = "HTTP/1.1"
    model = ""

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            self._send(200, json.dumps({"data": [{"id": self.model, "max_model_len": 2048}]}).encode())
        else:
            self._send(200, b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(1.0)
        self._send(
            503, b'{"error": {"message": "overloaded", "type": "ServiceUnavailableError", "code": 503}}'
        )


def test_a_hand_off_whose_decode_fails_after_prefill_finished_frees_prefill_at_once(
    pd_pair: PDPair, tiny_model: str
) -> None:
    """Closing the prefill leg's connection frees nothing once prefill's request has finished; the proxy's release
    on prefill's side channel does, instead of the lease (15 s here) running out."""
    handler = type("Handler", (_FailingDecode,), {"model": tiny_model})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    decode_url = f"http://127.0.0.1:{server.server_address[1]}"
    abandoned = metric(pd_pair.prefill, "vllm:disagg_sends_abandoned_total")
    expired = metric(pd_pair.prefill, "vllm:disagg_leases_expired_total")
    proxy = _proxy(
        "--prefill", pd_pair.spec("prefill"),
        "--decode", f"{decode_url};id=failing-decode",
        "--policy", "always-transfer",
        tiny_model=tiny_model,
    )  # fmt: skip
    try:
        with proxy:
            status, _, path = _ask(proxy, tiny_model, random_prompt(600, 7200))
            assert status == 503 and "fallback=decode_http_503" in path, (status, path)
            wait_kv_idle(pd_pair.prefill, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert metric(pd_pair.prefill, "vllm:disagg_sends_abandoned_total") == abandoned + 1
    assert metric(pd_pair.prefill, "vllm:disagg_leases_expired_total") == expired
