"""benchmarks/proxy.py's pieces: the fast mock backend answers what the proxy reads, the load generator counts
requests and parses chunked SSE streams, and a tiny end-to-end run reports the proxy's CPU per request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.paths import ROOT

pytest.importorskip("httptools")

sys.path.insert(0, str(ROOT / "benchmarks"))
import loadgen  # noqa: E402
import proxy as bench_proxy  # noqa: E402

from vllm_disagg.router.metrics import LAG_BUCKETS  # noqa: E402
from vllm_disagg.tools.harness import free_port  # noqa: E402


@contextlib.contextmanager
def fast_backend(*extra: str) -> Iterator[tuple[str, int]]:
    """benchmarks/fast_backend.py with a side channel; yields (base URL, side-channel port)."""
    port, side = free_port(), free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fast_backend.py"), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--side", str(side), *extra], stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "fast backend did not start"
            time.sleep(0.05)
        yield url, side
    finally:
        proc.terminate()
        proc.wait(10)


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_fast_backend_answers_what_the_proxy_reads() -> None:
    with fast_backend() as (url, side):
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "mock" and models["data"][0]["max_model_len"] >= 1_000_000
        metrics = httpx.get(url + "/metrics").text
        assert "vllm:num_requests_waiting" in metrics and "vllm:kv_cache_usage_perc" in metrics
        assert httpx.post(url + "/tokenize", json={"prompt": "x" * 40}).json()["count"] == 11

        # a stream: max_tokens chunks, the last with finish_reason, a usage chunk when asked, then [DONE]
        body = {"model": "mock", "prompt": "hi", "max_tokens": 5, "stream": True}
        r = httpx.post(url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["transfer-encoding"] == "chunked"
        ev = _events(r.text)
        assert ev[-1] == "[DONE]" and len(ev) == 5 + 2
        assert [e["choices"][0]["finish_reason"] for e in ev[:5]] == [None] * 4 + ["length"]
        assert ev[5]["usage"]["completion_tokens"] == 5
        assert ev[5]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
        )
        ev = _events(chat.text)
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant" and ev[-1] == "[DONE]" and len(ev) == 4

        # not streamed: one JSON answer with usage
        done = httpx.post(url + "/v1/completions", json={**body, "stream": False}).json()
        assert done["choices"][0]["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 5 and "prompt_tokens_details" in done["usage"]
        assert "kv_transfer_params" not in done

        # a prefill leg: one token, not streamed, kv_transfer_params naming the transfer and the side channel
        leg = {**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-1"}}
        p = httpx.post(url + "/v1/completions", json=leg)
        assert p.headers["content-type"] == "application/json"
        params = p.json()["kv_transfer_params"]
        assert params["transfer_id"] == "t-1" and params["do_remote_prefill"] is True
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", side)
        assert p.json()["usage"]["completion_tokens"] == 1

        # a decode leg streams; its usage reports the transferred prompt as cached
        d = {**body, "stream_options": {"include_usage": True}, "kv_transfer_params": {**params}}
        ev = _events(httpx.post(url + "/v1/completions", json=d).text)
        assert ev[-1] == "[DONE]" and ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        stats = httpx.get(url + "/mock/stats").json()
        assert stats["kind:prefill"] == 1 and stats["kind:decode"] == 1


def test_fast_backend_side_channel_describes_a_geometry() -> None:
    import zmq

    from vllm_disagg.wire import Description, decode, encode, make_describe

    with fast_backend() as (_, side):
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://127.0.0.1:{side}")
            sock.send_multipart(encode(make_describe(None, "test")))
            assert sock.poll(5000)
            msg, _ = decode(sock.recv_multipart())
        finally:
            sock.close()
        assert isinstance(msg, Description) and msg.geometry.num_layers == 4


def test_loadgen_counts_requests_and_parses_chunked_streams() -> None:
    with fast_backend("--gap-ms", "0.2", "--gap-min-tokens", "200") as (url, _):

        def req(max_tokens: int, stream: bool = True) -> bytes:
            body = {"model": "mock", "prompt": "hi", "max_tokens": max_tokens, "stream": stream}
            return loadgen.build_request(url, "/v1/completions", json.dumps(body).encode())

        stats = loadgen.run(lambda: loadgen.closed_loop([url], [req(5), req(7)], 3, 10, keep_body=True))
        assert len(stats.results) == 10 and not stats.errors and stats.wall_s > 0
        assert sorted(r.events for r in stats.results) == [6] * 5 + [8] * 5  # tokens + [DONE]
        for r in stats.results:
            assert r.status == 200 and 0 < r.ttft <= r.total
            assert r.body.endswith(b"data: [DONE]\n\n") and len(r.body) == r.body_bytes
            assert len(_events(r.body.decode())) == r.events

        # a long spaced stream arrives in many reads; every event is counted once; keep-alive is reused
        long = loadgen.run(lambda: loadgen.closed_loop([url], [req(300)], 2, 4))
        assert [r.events for r in long.results] == [301] * 4
        plain = loadgen.run(lambda: loadgen.closed_loop([url], [req(3, stream=False)], 1, 3))
        assert [r.status for r in plain.results] == [200] * 3 and all(r.events == 0 for r in plain.results)
        assert httpx.get(url + "/mock/stats").json()["/v1/completions"] == 10 + 4 + 3


def test_loadgen_parses_a_stream_fed_byte_by_byte() -> None:
    """An SSE event ("data:") split across reads, and chunk framing split anywhere, still counts once."""
    events = [b'data: {"a": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-disagg-path: transfer; p=a\r\n"
    raw += b"transfer-encoding: chunked\r\n\r\n"
    raw += b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def go() -> loadgen.Result:
        proto = loadgen._ClientProtocol(b"x-disagg-path", keep_body=True)
        proto.waiter = asyncio.get_running_loop().create_future()
        proto._reset(time.perf_counter())
        for i in range(len(raw)):
            proto.data_received(raw[i : i + 1])
        return await proto.waiter

    res = loadgen.run(go)
    assert res.status == 200 and res.events == 4 and res.body == b"".join(events)
    assert res.header == "transfer; p=a"


def test_bench_proxy_smoke_reports_cpu_per_request(tiny_model: str, tmp_path: Path) -> None:
    """A tiny run of benchmarks/proxy.py (no vllm-router): the proxy's CPU per request is read and positive."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "proxy.py"), "--cells", "c16", "-n", "300"]
    cmd += ["--warmup", "10", "--no-vllm-router", "--json", str(out), "--logdir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    cell = doc["results"]["stream c=16"]
    assert set(cell) == {"direct", "vllm-disagg", "vllm-disagg-w2"}
    for name in ("vllm-disagg", "vllm-disagg-w2"):
        proxy = cell[name]
        assert proxy["ok"] == proxy["requests"] == 300 and proxy["errors"] == 0
        assert proxy["cpu_us_per_req"] > 0 and proxy["sched_us_per_req"] > 0
        assert proxy["events_per_req"] == 17  # 16 tokens + [DONE], relayed whole
        assert proxy["plans"] == {"colocated": 300}
    # --workers 2: 16 keep-alive connections spread over both workers; each worker's count is in /metrics.
    shares = doc["meta"]["worker_requests"]["colo"]
    assert set(shares) == {"0", "1"} and all(v > 0 for v in shares.values()), shares
    assert cell["direct"]["ok"] == 300 and "cpu_us_per_req" not in cell["direct"]
    assert "vllm-disagg" in r.stdout and "CPU µs/req" in r.stdout


def test_the_worst_loop_lag_is_the_highest_bucket_that_gained_samples() -> None:
    """The 200 KB cell's stall check reads the proxy's lag histogram twice; only samples of the cell count."""
    before = {0.001: 100.0, 0.002: 104.0, 0.005: 105.0, 0.01: 105.0, float("inf"): 105.0}
    after = {0.001: 150.0, 0.002: 160.0, 0.005: 162.0, 0.01: 162.0, float("inf"): 162.0}
    assert bench_proxy.worst_lag_bucket(before, after) == (0.002, 0.005, 57.0)
    # a stall before the cell (in "before") is not the cell's
    assert bench_proxy.worst_lag_bucket(after, {**after, 0.001: 170.0, 0.002: 181.0, 0.005: 183.0,
                                                0.01: 183.0, float("inf"): 183.0}) == (0.001, 0.002, 21.0)  # fmt: skip
    assert bench_proxy.worst_lag_bucket(after, after) is None


def test_the_lag_canary_measures_until_its_pipe_closes_and_a_broken_one_is_reported() -> None:
    """The 200 KB cell's host floor: benchmarks/lag_canary.py counts its loop's lag in the proxy's buckets."""
    canary = bench_proxy.start_lag_canary()
    assert canary is not None
    time.sleep(0.3)
    out = bench_proxy.stop_lag_canary(canary)
    assert canary.proc.returncode == 0
    counts = out["canary_lag_counts"]
    assert list(counts) == [*(f"{1000 * b:g}" for b in LAG_BUCKETS), "inf"]
    assert sum(counts.values()) >= 5  # a timer every 10 ms for 0.3 s
    assert out["canary_lag_over_2ms"] == sum(n for b, n in counts.items() if float(b) > 2)
    # a canary that answers with no counts is reaped and reported, not raised
    broken = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); print('not json')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    out = bench_proxy.stop_lag_canary(bench_proxy.LagCanary(broken, realtime=False))
    assert "canary_error" in out and broken.returncode is not None
