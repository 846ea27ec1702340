"""Pure pieces of the proxy: the transfer ledger, instance specs, settings, vLLM metrics parsing, pairing checks."""

from __future__ import annotations

import pytest

from vllm_disagg.kv_layout import KVGeometry, kv_dtype_tag
from vllm_disagg.router.config import InstanceConfig, ProxySettings
from vllm_disagg.router.instances import _pair_diff, parse_vllm_metrics
from vllm_disagg.router.ledger import TransferLedger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_ledger_tracks_handoffs_and_reclaims_expired_ones() -> None:
    clock = Clock()
    ledger = TransferLedger(deadline_s=10.0, clock=clock)
    ledger.open("t1", "r1", "p", "d")
    ledger.open("t2", "r2", "p", "d")
    ledger.mark("t1", "prefill_done")
    assert ledger.in_flight() == 2
    ledger.mark("t1", "done")
    assert ledger.in_flight() == 1 and ledger.counts == {"done": 1}
    clock.t += 11
    expired = ledger.expired()
    assert [h.transfer_id for h in expired] == ["t2"]
    assert ledger.stranded() == 1 and ledger.in_flight() == 0
    ledger.mark("t2", "done")  # a late close of a reclaimed handoff changes nothing
    assert ledger.counts == {"done": 1, "reclaimed": 1}


def test_ledger_snapshot_shows_open_handoffs() -> None:
    clock = Clock()
    ledger = TransferLedger(clock=clock)
    ledger.open("t", "r", "p1", "d1")
    clock.t += 2.5
    (row,) = ledger.snapshot()
    assert row["prefill"] == "p1" and row["state"] == "dispatched" and row["age_s"] == 2.5


def test_instance_spec_parsing() -> None:
    c = InstanceConfig.parse("http://10.0.0.5:8000;side=5700;events=tcp://10.0.0.5:5557;id=p0", "prefill")
    assert c.role == "prefill" and c.instance_id() == "p0"
    assert c.side_channel_addr() == ("10.0.0.5", 5700)
    assert c.kv_events == "tcp://10.0.0.5:5557"
    assert InstanceConfig.parse("http://h:1", "both").instance_id() == "h:1"
    with pytest.raises(ValueError, match="unknown instance option 'sid'"):
        InstanceConfig.parse("http://h:1;sid=5", "decode")
    with pytest.raises(ValueError, match="http"):
        InstanceConfig.parse("h:1", "decode")


def test_settings_from_file_and_env(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "proxy.yaml"
    path.write_text("port: 9000\npolicy: least-loaded\ninstances:\n  - {url: 'http://a:1', role: decode}\n")
    monkeypatch.setenv("VLLM_DISAGG_PROXY_PORT", "9100")
    s = ProxySettings.load(str(path), policy="round-robin")
    assert s.port == 9100  # env beats the file
    assert s.policy == "round-robin"  # flags beat both
    assert [i.role for i in s.instances] == ["decode"]
    path.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        ProxySettings.load(str(path))


def test_vllm_metrics_parsing_sums_engines() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        "vllm:other 7\n"
        "process_start_time_seconds 1.7e9\n"
    )
    assert parse_vllm_metrics(text) == {"waiting": 3.0, "running": 5.0, "kv_usage": 0.25, "started": 1.7e9}


def test_cache_dtype_spellings_of_the_same_bytes_pair() -> None:
    """vLLM's "fp8" is E4M3, and "auto" stores the model's own type: such spellings must not refuse to pair."""
    assert kv_dtype_tag("uint8", "fp8") == kv_dtype_tag("uint8", "fp8_e4m3") == "uint8/fp8_e4m3"
    assert kv_dtype_tag("uint8", "fp8_e5m2") != kv_dtype_tag("uint8", "fp8_e4m3")
    assert (
        kv_dtype_tag("bfloat16", "auto")
        == kv_dtype_tag("bfloat16", "bfloat16")
        == kv_dtype_tag("bfloat16", "bf16")
    )
    assert kv_dtype_tag("bfloat16", "auto") != kv_dtype_tag("float16", "auto")


def test_pairs_with_different_kv_layouts_are_refused() -> None:
    base = dict(
        model="m",
        num_layers=4,
        num_kv_heads=2,
        head_size=32,
        block_size=128,
        dtype="float32",
        kv_layout="cpu",
    )
    a = KVGeometry(**base)  # type: ignore[arg-type]
    assert _pair_diff(a, KVGeometry(**base)) == ""  # type: ignore[arg-type]
    assert _pair_diff(a, KVGeometry(**{**base, "block_size": 64})) == "block_size 128 vs 64"  # type: ignore[arg-type]
    assert _pair_diff(a, KVGeometry(**{**base, "dtype": "bfloat16"})).startswith("dtype")  # type: ignore[arg-type]
    # TP rank is per worker, not a property of the pair
    assert _pair_diff(a, KVGeometry(**{**base, "tp_rank": 1})) == ""  # type: ignore[arg-type]


def test_every_proxy_setting_is_a_flag_with_its_description() -> None:
    """One declaration per setting: each scalar ProxySettings field is a `vllm-disagg proxy` flag whose help is the
    field's description, and a flag sets the field (over a config file's value)."""
    import argparse

    from vllm_disagg.router.config import ProxySettings
    from vllm_disagg.router.server import add_subcommand, settings_from_args

    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    proxy = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["proxy"]
    flags = {a.dest: a for a in proxy._actions}
    for name, field in ProxySettings.model_fields.items():
        if name == "instances":
            continue
        assert name in flags, f"ProxySettings.{name} has no flag"
        assert field.description and flags[name].help.startswith(field.description), name
    ns = proxy.parse_args(["--both", "http://a:1", "--transfer-deadline-s", "7.5", "--workers", "3"])
    settings = settings_from_args(ns)
    assert settings.transfer_deadline_s == 7.5 and settings.workers == 3
    assert settings.health_interval_s == ProxySettings().health_interval_s  # unset flags keep the defaults
    assert settings.split_ttft_gate is True
    ungated = settings_from_args(proxy.parse_args(["--both", "http://a:1", "--no-split-ttft-gate"]))
    assert ungated.split_ttft_gate is False
    assert settings_from_args(proxy.parse_args(["--split-ttft-gate"])).split_ttft_gate is True
    from vllm_disagg.router.server import build_proxy

    assert build_proxy(ungated).policy.config.split_ttft_gate is False
    assert build_proxy(settings).policy.config.split_ttft_gate is True
    share = settings_from_args(proxy.parse_args(["--split-tpot-share", "0.8"]))
    assert build_proxy(share).policy.config.split_tpot_share == 0.8
    assert build_proxy(settings).policy.config.split_tpot_share == 0.6
    hold = settings_from_args(proxy.parse_args(["--split-settle-hold-s", "0"]))
    assert build_proxy(hold).policy._regime.cfg.gate_hold_s == 0.0
    assert build_proxy(settings).policy._regime.cfg.gate_hold_s == 2.0
    floor = settings_from_args(proxy.parse_args(["--split-min-offered-share", "0.3"]))
    assert build_proxy(floor).policy.config.min_offered_share == 0.3
    assert build_proxy(settings).policy.config.min_offered_share == 0.15
    assert build_proxy(floor).index.pending_ttl_s == 10.0
    assert build_proxy(settings).policy.config.length_weighted_stall is True
    counted = settings_from_args(proxy.parse_args(["--both", "http://a:1", "--no-length-weighted-stall"]))
    assert build_proxy(counted).policy.config.length_weighted_stall is False


def test_the_tally_renders_what_direct_updates_render() -> None:
    """Counts and observations kept in the tally and flushed give the same exposition as prometheus_client's own
    updates; nothing shows before the flush, and a second flush adds nothing."""
    import random

    from prometheus_client import generate_latest

    from vllm_disagg.router.metrics import BucketCounts, ProxyMetrics

    direct, tallied = ProxyMetrics(), ProxyMetrics()
    rnd = random.Random(1)
    for _ in range(300):
        mode = rnd.choice(["colocated", "transfer"])
        ttft, e2e, n = rnd.expovariate(20), rnd.expovariate(2), rnd.randint(1, 4000)
        gaps = [rnd.expovariate(100) for _ in range(rnd.randint(0, 20))]
        direct.child(direct.ttft, mode).observe(ttft)
        direct.child(direct.e2e, mode).observe(e2e)
        direct.child(direct.requests, mode, "2xx").inc()
        direct.prompt_tokens.inc(n)
        for g in gaps:
            direct.child(direct.itl, mode).observe(g)
        by_mode, tally = tallied.of_mode(mode), tallied.tally
        tally.observe(by_mode.ttft, ttft)
        tally.observe(by_mode.e2e, e2e)
        tally.inc(by_mode.ok)
        tally.inc(tallied.prompt_tokens, n)
        stream = BucketCounts(tallied.itl_buckets)
        for g in gaps:
            stream.observe(g)
        tally.merge(by_mode.itl, stream)
    before = generate_latest(tallied.registry)
    assert b"vllm_disagg_prompt_tokens_total 0.0" in before
    tallied.tally.flush()
    tallied.tally.flush()

    def samples(m: ProxyMetrics) -> dict[str, float]:
        out = {}
        for line in generate_latest(m.registry).decode().splitlines():
            if line and not line.startswith("#") and "_created" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    want, got = samples(direct), samples(tallied)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9), k


def test_bucket_counts_put_a_value_on_a_bound_in_that_bound_s_bucket() -> None:
    """Prometheus buckets are ``le``: a gap equal to a bound counts there, one past the last finite bound in +Inf."""
    from bisect import bisect_left

    from vllm_disagg.router.metrics import BucketCounts, ProxyMetrics

    bounds = ProxyMetrics().itl_buckets
    values = [0.0, *bounds[:-1], *(b * 1.0001 for b in bounds[:-1]), 1e9, float("inf")]
    for v in values:
        counts = BucketCounts(bounds)
        counts.observe(v)
        assert counts.counts.index(1) == bisect_left(bounds, v), v
    nan = BucketCounts(bounds)
    nan.observe(float("nan"))
    assert sum(nan.counts) == 1


def test_chunk_frames_and_byte_search() -> None:
    from vllm_disagg.router.http_server import chunk_frame
    from vllm_disagg.router.legs import has

    for n in (1, 15, 16, 4095, 4096, 70000):
        data = b"x" * n
        assert chunk_frame(data) == b"%x\r\n" % n + data + b"\r\n"
    assert has(b'data: {"usage": 1}', b'"usage"') and not has(b"data: {}", b'"usage"')
    assert has(b"abc", b"") and not has(b"", b"a")


def test_a_policys_free_text_reasons_cannot_grow_the_decision_series_without_bound() -> None:
    from vllm_disagg.router.metrics import MAX_DECISION_REASONS, ProxyMetrics

    m = ProxyMetrics()
    for i in range(3 * MAX_DECISION_REASONS):
        m.tally.inc(m.decision("transfer", f"prompt_{i}_tokens"))
    m.tally.flush()
    reasons = {s.labels["reason"] for s in m.decisions.collect()[0].samples if s.name.endswith("_total")}
    assert len(reasons) == MAX_DECISION_REASONS + 1 and "other" in reasons
    m.tally.inc(
        m.decision("transfer", "policy_error", capped=False)
    )  # the proxy's own reasons keep their label
    m.tally.flush()
    assert any(s.labels["reason"] == "policy_error" for s in m.decisions.collect()[0].samples)


def test_workers_do_not_join_another_proxys_port() -> None:
    """Linux lets any process of the same user join a SO_REUSEPORT group: a second `--workers N` proxy on a taken
    port started and silently took half the clients. The supervisor's port is claimed without SO_REUSEPORT first."""
    import socket

    from vllm_disagg.router.workers import _anchor

    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another proxy's workers listen
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    try:
        with pytest.raises(OSError):
            _anchor("127.0.0.1", other.getsockname()[1])
    finally:
        other.close()
    anchor = _anchor("127.0.0.1", 0)  # a free port is held, and workers may join it
    try:
        worker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        worker.bind(("127.0.0.1", anchor.getsockname()[1]))
        worker.close()
    finally:
        anchor.close()
