"""The fault matrix: concurrent traffic through the proxy to a P/D pair while one fault fires per scenario.

Per request: answered correctly (greedy output equals a single instance), a clear error, lost (no answer before a
deadline) or wrong. After each scenario: KV usage back to idle on both instances and no open handoff in the proxy's
ledger. Prints a table (fault x outcome counts); every row must have 0 lost, 0 wrong and 0 leaked.

Run alone: ``make faults`` (or ``pytest -m faults -s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import PDPair
from helpers import SECRET, complete, disagg_args, metric, tokens, wait_kv_idle
from test_connector_e2e import _prompt

from vllm_disagg.harness import ProxyServer, VLLMServer, free_port, start_many

pytestmark = [pytest.mark.vllm, pytest.mark.faults]

LEASE_S, LOAD_TIMEOUT_S = 8, 4
N_REQUESTS, CONCURRENCY = 8, 4


@dataclass
class Faulty:
    prefill: VLLMServer
    decode: VLLMServer
    proxy: ProxyServer
    rules: Path
    refs: dict[int, list[int]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def faulty(pd_pair: PDPair, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    rules = tmp_path_factory.mktemp("faults") / "rules.json"
    rules.write_text("[]")
    env = {"VLLM_DISAGG_FAULTS_FILE": str(rules)}
    extra = {"lease_s": LEASE_S, "load_timeout_s": LOAD_TIMEOUT_S, "verify_checksums": True}
    ps, ds = free_port(), free_port()
    p = VLLMServer(tiny_model, args=disagg_args(ps, **extra), env=env, cpu_cores="0", name="faulty-prefill")
    d = VLLMServer(tiny_model, args=disagg_args(ds, **extra), env=env, cpu_cores="1", name="faulty-decode")
    start_many([p, d])
    proxy = ProxyServer(
        "unused",
        args=[
            "--prefill", f"{p.url};side=127.0.0.1:{ps};id=prefill",
            "--decode", f"{d.url};side=127.0.0.1:{ds};id=decode",
            "--policy", "always-transfer", "--tokenizer", tiny_model, "--shared-secret", SECRET,
            "--admin-key", "k",
        ],
    )  # fmt: skip
    try:
        proxy.start().wait_healthy(60)
        f = Faulty(p, d, proxy, rules)
        for i in range(N_REQUESTS):  # references from a separate single instance
            f.refs[i] = tokens(
                complete(pd_pair.prefill, tiny_model, _prompt(600 + 50 * i, 9000 + i), max_tokens=6)
            )
        yield f
    finally:
        proxy.stop()
        p.stop()
        d.stop()


def _run(
    f: Faulty, model: str, during: Callable[[], None] | None = None, disconnect: bool = False
) -> dict[str, int]:
    def one(i: int) -> str:
        body = {"model": model, "prompt": _prompt(600 + 50 * i, 9000 + i), "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        try:
            if disconnect and i % 2:
                with httpx.stream(
                    "POST", f.proxy.url + "/v1/completions", json={**body, "stream": True}, timeout=60
                ) as r:
                    for _ in r.iter_raw():
                        break
                return "disconnected"
            r = httpx.post(f.proxy.url + "/v1/completions", json=body, timeout=60)
        except httpx.TimeoutException:
            return "lost"
        if r.status_code != 200:
            return "clear_error" if "error" in r.json() else "unclear_error"
        return "correct" if r.json()["choices"][0]["token_ids"] == f.refs[i] else "wrong"

    with cf.ThreadPoolExecutor(CONCURRENCY) as ex:
        futures = [ex.submit(one, i) for i in range(N_REQUESTS)]
        if during is not None:
            during()
        outcomes = [fu.result() for fu in futures]
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


def _leaks(f: Faulty) -> int:
    leaked = 0
    for server in (f.prefill, f.decode):
        try:
            wait_kv_idle(server, timeout=LEASE_S + 10)
        except AssertionError:
            leaked += 1
    open_handoffs = httpx.get(
        f.proxy.url + "/admin/transfers", headers={"x-admin-key": "k"}, timeout=5
    ).json()["open"]
    return leaked + len(open_handoffs)


def _stop_prefill_for(f: Faulty, seconds: float) -> Callable[[], None]:
    def fire() -> None:
        time.sleep(0.5)
        assert f.prefill.proc is not None
        os.killpg(f.prefill.proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.killpg(f.prefill.proc.pid, signal.SIGCONT)

    return fire


SCENARIOS: dict[str, list[dict[str, object]]] = {
    "none": [],
    "layer delayed 1.5 s": [{"on": "layer", "action": "delay", "delay_s": 1.5, "every": 3}],
    "layer dropped": [{"on": "layer", "action": "drop", "every": 4}],
    "layer truncated": [{"on": "layer", "action": "truncate", "every": 4}],
    "layer corrupted": [{"on": "layer", "action": "corrupt", "every": 4}],
    "register dropped": [{"on": "register", "action": "drop", "every": 2}],
    "done dropped": [{"on": "done", "action": "drop"}],
    "heartbeats dropped": [{"on": "heartbeat", "action": "drop"}],
}

TABLE: dict[str, dict[str, int]] = {}


@pytest.mark.parametrize("name", [*SCENARIOS, "prefill SIGSTOP 5 s", "clients disconnect"])
def test_fault_matrix_row(faulty: Faulty, tiny_model: str, name: str) -> None:
    failed_before = metric(faulty.decode, "vllm:disagg_loads_failed_total")
    faulty.rules.write_text(json.dumps(SCENARIOS.get(name, [])))
    time.sleep(0.3)  # the engines re-read rules at most every 0.1 s
    if name == "prefill SIGSTOP 5 s":
        counts = _run(faulty, tiny_model, during=_stop_prefill_for(faulty, 5.0))
    else:
        counts = _run(faulty, tiny_model, disconnect=name == "clients disconnect")
    faulty.rules.write_text("[]")
    counts["leaked"] = _leaks(faulty)
    counts["loads_recomputed"] = int(metric(faulty.decode, "vllm:disagg_loads_failed_total") - failed_before)
    if name in ("layer dropped", "layer truncated", "layer corrupted", "register dropped"):
        assert counts["loads_recomputed"] > 0, "the fault did not fire (or was not detected)"
    TABLE[name] = counts
    print(f"\nfault matrix | {name:<22} | " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    assert counts.get("lost", 0) == 0
    assert counts.get("wrong", 0) == 0
    assert counts.get("unclear_error", 0) == 0
    assert counts["leaked"] == 0


def test_print_fault_matrix_table() -> None:
    if not TABLE:
        pytest.skip("no scenario ran")
    cols = ["correct", "clear_error", "disconnected", "lost", "wrong", "leaked", "loads_recomputed"]
    lines = [f"{'fault':<22} " + " ".join(f"{c:>12}" for c in cols)]
    for name, counts in TABLE.items():
        lines.append(f"{name:<22} " + " ".join(f"{counts.get(c, 0):>12}" for c in cols))
    print("\n" + "\n".join(lines))
    assert all(c.get("lost", 0) == 0 and c.get("wrong", 0) == 0 and c["leaked"] == 0 for c in TABLE.values())


def _soak(f: Faulty, model: str, n: int, concurrency: int) -> dict[str, object]:
    """Mixed long/short prompts, streaming and not, a tenth aborted by the client; counts and latency tails."""
    import random

    rng = random.Random(0)
    lat: list[float] = []
    kinds: dict[str, int] = {}

    def one(i: int) -> None:
        long = rng.random() < 0.3
        body = {"model": model, "prompt": _prompt(1200 if long else 40, 20000 + i), "max_tokens": 4 if long else 16,
                "ignore_eos": True, "stream": i % 3 == 0}  # fmt: skip
        t = time.monotonic()
        try:
            if i % 10 == 7:
                with httpx.stream(
                    "POST", f.proxy.url + "/v1/completions", json={**body, "stream": True}, timeout=60
                ) as r:
                    for _ in r.iter_raw():
                        break
                kind = "aborted_by_client"
            else:
                r = httpx.post(f.proxy.url + "/v1/completions", json=body, timeout=60)
                kind = "ok" if r.status_code == 200 else f"http_{r.status_code}"
                lat.append(time.monotonic() - t)
        except httpx.TimeoutException:
            kind = "lost"
        kinds[kind] = kinds.get(kind, 0) + 1

    with cf.ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(n)))
    lat.sort()
    return {
        "requests": n,
        **kinds,
        "p50_s": round(lat[len(lat) // 2], 3),
        "p99_s": round(lat[int(len(lat) * 0.99)], 3),
        "leaked": _leaks(f),
    }


def test_bounded_soak(faulty: Faulty, tiny_model: str) -> None:
    faulty.rules.write_text("[]")
    report = _soak(
        faulty, tiny_model, n=int(os.environ.get("VLLM_DISAGG_SOAK_REQUESTS", "500")), concurrency=16
    )
    print(f"\nsoak: {report}")
    assert report.get("lost", 0) == 0 and report["leaked"] == 0
    assert set(report) <= {"requests", "ok", "aborted_by_client", "p50_s", "p99_s", "leaked"}, report


@pytest.mark.soak
def test_long_soak(faulty: Faulty, tiny_model: str) -> None:
    report = _soak(
        faulty, tiny_model, n=int(os.environ.get("VLLM_DISAGG_LONG_SOAK_REQUESTS", "5000")), concurrency=32
    )
    print(f"\nlong soak: {report}")
    assert report.get("lost", 0) == 0 and report["leaked"] == 0
