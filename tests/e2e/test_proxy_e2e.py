"""The proxy in front of real vLLM CPU instances: OpenAI client, prefix-aware routing, bad input, aborts, policies."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.paths import ROOT
from support.pd_pair import PDPair, random_prompt
from support.vllm_servers import SECRET, complete, disagg_args, metric, wait_kv_idle

from vllm_disagg.tools.harness import ProxyServer, VLLMServer, free_port, kv_events_args

pytestmark = pytest.mark.vllm

ADMIN = "admin-key-for-tests"


@pytest.fixture(scope="module")
def decode2(tiny_model: str) -> Iterator[tuple[VLLMServer, str]]:
    """A second decode instance (so prefix affinity has a choice to make)."""
    side, ev, rp = free_port(), free_port(), free_port()
    server = VLLMServer(
        tiny_model, args=[*disagg_args(side), *kv_events_args(ev, rp)], cpu_cores="0", name="decode2"
    )
    with server:
        spec = f"{server.url};side=127.0.0.1:{side};events=tcp://127.0.0.1:{ev};replay=tcp://127.0.0.1:{rp};id=decode2"
        yield server, spec


def _proxy(pair: PDPair, extra_decode: str | None, tiny_model: str, *args: str) -> ProxyServer:
    cmd = [
        "--prefill",
        pair.spec("prefill"),
        "--decode",
        pair.spec("decode"),
        *(["--decode", extra_decode] if extra_decode else []),
        "--tokenizer",
        tiny_model,
        "--admin-key",
        ADMIN,
        "--shared-secret",
        SECRET,
        "--max-body-bytes",
        "300000",
        *args,
    ]
    return ProxyServer("unused", args=cmd, name="proxy")


@pytest.fixture(scope="module")
def proxy(pd_pair: PDPair, decode2: tuple[VLLMServer, str], tiny_model: str) -> Iterator[ProxyServer]:
    server = _proxy(pd_pair, decode2[1], tiny_model)
    with server:
        yield server


def _client(proxy: ProxyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_gets_the_same_greedy_text_as_a_single_instance(
    proxy: ProxyServer, pd_pair: PDPair, tiny_model: str
) -> None:
    client = _client(proxy)
    direct = openai.OpenAI(base_url=pd_pair.prefill.url + "/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    ref = direct.completions.create(
        model=tiny_model, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
    )
    raw = client.completions.with_raw_response.create(
        model=tiny_model, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
    )
    out = raw.parse()
    assert out.choices[0].text == ref.choices[0].text
    assert raw.headers["x-disagg-path"].split(";")[0] in ("transfer", "recompute", "colocated")
    assert out.usage is not None and out.usage.completion_tokens == 16
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=tiny_model,
            prompt=prompt + " Again.",
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        if c.choices
    )
    ref2 = direct.completions.create(
        model=tiny_model, prompt=prompt + " Again.", max_tokens=16, temperature=0, extra_body=extra
    )
    assert streamed == ref2.choices[0].text
    messages = [{"role": "user", "content": "Tell me about caches. " * 30}]
    chat_ref = direct.chat.completions.create(
        model=tiny_model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body=extra,  # type: ignore[arg-type]
    )
    chat = client.chat.completions.create(
        model=tiny_model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body=extra,  # type: ignore[arg-type]
    )
    assert chat.choices[0].message.content == chat_ref.choices[0].message.content
    chat_stream = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=tiny_model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=extra,  # type: ignore[arg-type]
        )
        if c.choices
    )
    assert chat_stream == chat_ref.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [tiny_model]


def test_proxy_tokenizes_like_the_instances(proxy: ProxyServer, pd_pair: PDPair, tiny_model: str) -> None:
    from vllm_disagg.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_model)
    text = "def main():\n    return 'Hello, world' # é ü"
    direct = complete(pd_pair.prefill, tiny_model, text, max_tokens=1)
    assert tok.encode_prompt(text) == direct["choices"][0]["prompt_token_ids"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = httpx.post(
        pd_pair.prefill.url + "/tokenize", json={"model": tiny_model, "messages": messages}, timeout=30
    )
    assert tok.encode_chat(messages) == r.json()["tokens"]


def test_chats_the_proxy_cannot_render_as_vllm_does_are_measured_by_an_instance(
    proxy: ProxyServer, pd_pair: PDPair, tiny_model: str
) -> None:
    """A content given as a list of text parts (the OpenAI SDK's form): vLLM joins the parts; rendered here as a
    Python list it once counted 4,010 tokens for vLLM's 759 and got a false 400. Such chats (and ones with tools or
    template options) are tokenized by an instance, so their length and prefix are vLLM's."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}] * 250}]
    r = httpx.post(
        pd_pair.prefill.url + "/tokenize", json={"model": tiny_model, "messages": messages}, timeout=30
    )
    n = len(r.json()["tokens"])
    assert n < 2048 - 8  # fits the context: vLLM serves it
    body = {"model": tiny_model, "messages": messages, "max_tokens": 4, "temperature": 0}
    via_proxy = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=120)
    assert via_proxy.status_code == 200, via_proxy.text
    assert via_proxy.json()["usage"]["prompt_tokens"] == n
    direct = httpx.post(pd_pair.prefill.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert via_proxy.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


def _path(resp: httpx.Response) -> str:
    return resp.headers["x-disagg-path"]


def _post(proxy: ProxyServer, body: dict[str, object], timeout: float = 120) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=timeout)


def test_prefix_aware_routing_recompute_for_short_suffix_transfer_for_long_fresh_prompt(
    proxy: ProxyServer, decode2: tuple[VLLMServer, str], tiny_model: str
) -> None:
    server2, _ = decode2
    prefix = random_prompt(6 * 128, 777)
    complete(
        server2, tiny_model, prefix, max_tokens=1
    )  # warm decode2's own cache directly; the proxy learns from events
    deadline = time.monotonic() + 30
    while True:  # until decode2's KV events reached the proxy's index
        insts = httpx.get(proxy.url + "/admin/index", headers={"x-admin-key": ADMIN}, timeout=10).json()[
            "instances"
        ]
        if max((st["blocks"] for name, st in insts.items() if "decode2" in name), default=0) >= 6:
            break
        assert time.monotonic() < deadline, insts
        time.sleep(0.1)
    paths = []
    for i in range(10):
        body = {
            "model": tiny_model,
            "prompt": prefix + random_prompt(20, 800 + i),
            "max_tokens": 4,
            "temperature": 0,
        }
        r = _post(proxy, body)
        assert r.status_code == 200, r.text
        paths.append(_path(r))
    on_decode2 = [p for p in paths if "decode2" in p and p.startswith("recompute")]
    assert len(on_decode2) >= 9, paths
    r = _post(
        proxy, {"model": tiny_model, "prompt": random_prompt(1500, 900), "max_tokens": 4, "temperature": 0}
    )
    assert r.status_code == 200
    assert _path(r).startswith("transfer"), _path(r)
    prom = httpx.get(proxy.url + "/metrics").text
    assert 'vllm_disagg_decisions_total{mode="recompute"' in prom
    assert 'vllm_disagg_decisions_total{mode="transfer"' in prom


@pytest.mark.parametrize(
    ("send", "status"),
    [
        (lambda url, m: httpx.post(url + "/v1/completions", content=b"{not json", timeout=30), 400),
        (
            lambda url, m: httpx.post(
                url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30
            ),
            404,
        ),
        (
            lambda url, m: httpx.post(
                url + "/v1/completions", json={"model": m, "prompt": [5] * 2100, "max_tokens": 4}, timeout=30
            ),
            400,
        ),
        (
            lambda url, m: httpx.post(
                url + "/v1/completions", json={"model": m, "prompt": "x" * 400_000}, timeout=30
            ),
            413,
        ),
        (
            lambda url, m: httpx.post(
                url + "/v1/chat/completions", json={"model": m, "messages": "hi"}, timeout=30
            ),
            400,
        ),
        (
            lambda url, m: httpx.get(url + "/admin/instances", headers={"x-admin-key": "wrong"}, timeout=30),
            401,
        ),
        (lambda url, m: httpx.get(url + "/admin/instances", timeout=30), 401),
        (
            lambda url, m: httpx.post(
                url + "/v1/completions", json={"model": m, "prompt": "hi", "stream": "maybe"}, timeout=30
            ),
            400,
        ),
    ],
    ids=[
        "malformed-json",
        "unknown-model",
        "too-long",
        "oversized-body",
        "bad-messages",
        "wrong-admin-key",
        "no-admin-key",
        "stream-not-a-boolean",
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_proxy_keeps_serving(
    proxy: ProxyServer, tiny_model: str, send: object, status: int
) -> None:
    r = send(proxy.url, tiny_model)  # type: ignore[operator]
    assert r.status_code == status, r.text
    assert "error" in r.json() and r.json()["error"]["message"]
    if "/admin/" not in str(r.request.url):  # an inference request, refused: still named
        assert r.headers.get("x-request-id"), r.headers
    ok = _post(proxy, {"model": tiny_model, "prompt": "still alive?", "max_tokens": 2})
    assert ok.status_code == 200


def test_stream_given_as_a_string_is_read_as_vllm_reads_it(proxy: ProxyServer, tiny_model: str) -> None:
    """vLLM reads "false"/"0"/"off" as false: a whole JSON answer, not an event stream with a JSON body inside."""
    for value, streamed in (("false", False), ("0", False), ("true", True), (None, False)):
        body = {"model": tiny_model, "prompt": "hi", "max_tokens": 2, "stream": value}
        r = _post(proxy, body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith(
            "text/event-stream" if streamed else "application/json"
        ), value
        assert r.text.rstrip().endswith("data: [DONE]") if streamed else r.json()["choices"], value


def test_ping_and_version_answer_as_on_vllm(proxy: ProxyServer, pd_pair: PDPair) -> None:
    health = httpx.get(proxy.url + "/health", timeout=10)
    for method in ("GET", "POST"):
        r = httpx.request(method, proxy.url + "/ping", timeout=10)
        assert (r.status_code, r.json()["status"]) == (health.status_code, health.json()["status"]), method
    direct = httpx.get(pd_pair.prefill.url + "/version", timeout=10).json()
    assert httpx.get(proxy.url + "/version", timeout=10).json() == direct and direct["version"]


def test_a_batch_of_one_prompt_is_served_as_that_prompt(proxy: ProxyServer, tiny_model: str) -> None:
    text = "The quick brown fox jumps over the lazy dog, " * 12
    body = {"model": tiny_model, "prompt": text, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    ref = _post(proxy, body)
    ids = ref.json()["choices"][0]["prompt_token_ids"]
    for prompt in ([text], [ids]):
        r = _post(proxy, {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_max_tokens_past_the_context_is_shortened_as_vllm_does(proxy: ProxyServer, tiny_model: str) -> None:
    """A prompt that fits with max_tokens past what is left of the context: vLLM generates what fits (the proxy
    used to refuse it with a 400 that the instance would not have given)."""
    r = _post(proxy, {"model": tiny_model, "prompt": [5] * 2040, "max_tokens": 64})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # sampled (temperature 1): EOS may come before the context is full
    assert usage["prompt_tokens"] == 2040 and 1 <= usage["completion_tokens"] <= 8


def test_errors_the_proxy_answers_itself_are_shaped_as_vllm_shapes_them(
    proxy: ProxyServer, pd_pair: PDPair, tiny_model: str
) -> None:
    """A prompt longer than the context and an unknown model, refused by the proxy before any instance sees them,
    answer as the instance would: status, type, param, code, and the phrase clients match ("maximum context
    length") to tell a context overflow."""
    for body in (
        {"model": tiny_model, "prompt": [5] * 2049, "max_tokens": 4},
        {"model": "no-such-model", "prompt": "hi", "max_tokens": 4},
    ):
        direct = httpx.post(pd_pair.decode.url + "/v1/completions", json=body, timeout=30)
        r = _post(proxy, body)
        assert r.status_code == direct.status_code, (r.text, direct.text)
        ours, theirs = r.json()["error"], direct.json()["error"]
        assert {k: ours[k] for k in ("type", "param", "code")} == {
            k: theirs[k] for k in ("type", "param", "code")
        }
        assert ours["message"].split(".")[0] == theirs["message"].split(".")[0], (ours, theirs)


def test_admin_api_lists_instances_and_decisions(proxy: ProxyServer) -> None:
    h = {"x-admin-key": ADMIN}
    inst = httpx.get(proxy.url + "/admin/instances", headers=h).json()["instances"]
    ids = {i["id"] for i in inst}
    assert ids == {"prefill", "decode", "decode2"}
    assert all(i["geometry"] and i["geometry"]["block_size"] == 128 and not i["incompatible"] for i in inst)
    decisions = httpx.get(proxy.url + "/admin/decisions", headers=h).json()["decisions"]
    assert decisions and "path" in decisions[-1]


def test_client_disconnect_mid_stream_leaves_no_blocks_held(
    proxy: ProxyServer, pd_pair: PDPair, decode2: tuple[VLLMServer, str], tiny_model: str
) -> None:
    body = {
        "model": tiny_model,
        "prompt": random_prompt(1800, 901),
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _chunk in r.iter_raw():
            break  # the client goes away after the first chunk
    for server in (pd_pair.prefill, pd_pair.decode, decode2[0]):
        wait_kv_idle(server, timeout=15)
    prom = httpx.get(proxy.url + "/metrics").text
    assert (
        "vllm_disagg_client_disconnects_total 1.0" in prom or "vllm_disagg_client_disconnects_total" in prom
    )
    assert metric(pd_pair.prefill, "vllm:num_requests_running") == 0


def test_custom_policy_from_examples_changes_routing(pd_pair: PDPair, tiny_model: str) -> None:
    # The default cost policy transfers a long fresh prompt (see the prefix test); the example policy keeps prompts
    # under its 2,048-token threshold on the decode instance with the longest cached prefix.
    example = str(ROOT / "examples" / "custom_policy.py")
    with _proxy(pd_pair, None, tiny_model, "--policy", f"{example}:PinLongPromptsPolicy") as custom:
        r = _post(custom, {"model": tiny_model, "prompt": random_prompt(1500, 950), "max_tokens": 2})
        assert r.status_code == 200
        assert _path(r) == "recompute; instance=decode; reason=longest_cached_prefix", _path(r)


def test_metrics_follow_prometheus_conventions(proxy: ProxyServer) -> None:
    text = httpx.get(proxy.url + "/metrics").text
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    assert "vllm_disagg_ttft_seconds_bucket" in names
    assert "vllm_disagg_instance_in_flight" in names
    assert all(n.startswith("vllm_disagg_") for n in names if not n.startswith(("python_", "process_")))
    assert json.loads(httpx.get(proxy.url + "/health").text)["status"] == "ok"


def test_vllm_bench_serve_runs_unchanged_against_the_proxy(
    proxy: ProxyServer, tiny_model: str, tmp_path: Path
) -> None:
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--base-url", proxy.url, "--model", tiny_model, "--dataset-name", "random",
        "--random-input-len", "256", "--random-output-len", "8", "--num-prompts", "12",
        "--request-rate", "inf", "--max-concurrency", "4", "--save-result", "--result-filename", str(out),
        "--ignore-eos",
    ]  # fmt: skip
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["completed"] == 12 and data.get("failed", 0) == 0
