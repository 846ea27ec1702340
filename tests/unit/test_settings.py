"""One declaration per setting: the transfer engine's settings come from the connector's config (defaults included),
and the proxy and the simulator share the cost model's defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_disagg.config import ConnectorConfig
from vllm_disagg.policy.cost_model import CostModelConfig
from vllm_disagg.router.config import InstanceConfig, ProxySettings, read_instances_file
from vllm_disagg.transport.engine import EngineSettings

SHARED = (
    "lease_s",
    "load_timeout_s",
    "heartbeat_s",
    "connect_timeout_s",
    "transport",
    "verify_checksums",
    "offer_batch_ms",
    "offer_hold_bytes",
)


def test_engine_defaults_are_the_connector_configs() -> None:
    engine, config = EngineSettings(), ConnectorConfig()
    for name in SHARED:
        assert getattr(engine, name) == getattr(config, name), name


def test_engine_settings_carry_every_connector_setting_they_share() -> None:
    cfg = ConnectorConfig(
        lease_s=7.0,
        load_timeout_s=8.0,
        heartbeat_s=0.5,
        connect_timeout_s=2.0,
        transport="tcp",
        verify_checksums=True,
        offer_batch_ms=5.0,
        offer_hold_bytes=4096,
        side_channel_host="10.0.0.1",
        trace_path="/tmp/t.jsonl",
    )
    s = EngineSettings.from_config(cfg, 6000)
    assert (s.bind_host, s.port, s.trace_path) == ("10.0.0.1", 6000, "/tmp/t.jsonl")
    for name in SHARED:
        assert getattr(s, name) == getattr(cfg, name), name
    fields = {f.name for f in dataclasses.fields(EngineSettings)}
    assert set(SHARED) <= fields


def test_proxy_and_simulator_share_the_cost_models_defaults() -> None:
    proxy, cost = ProxySettings(), CostModelConfig()
    assert proxy.ttft_slo_s == cost.ttft_slo_s and proxy.tpot_slo_s == cost.tpot_slo_s
    assert proxy.link_bytes_per_s == cost.link_bytes_per_s and proxy.tier_bytes_per_s == cost.tier_bytes_per_s


def test_the_proxy_refuses_a_policy_that_does_not_load_in_one_line(tmp_path: Path) -> None:
    from vllm_disagg.cli import main

    with pytest.raises(SystemExit, match=r"^error: .*no_such_policy_mod_xyz"):
        main(["proxy", "--decode", "http://127.0.0.1:9", "--policy", "no_such_policy_mod_xyz:P"])
    with pytest.raises(SystemExit, match=r"^error: --policy-args must be a JSON object"):
        main(["proxy", "--decode", "http://127.0.0.1:9", "--policy", "least-loaded", "--policy-args", "[1]"])


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--decode", "http://x;sid=1"], "error: unknown instance option 'sid'"),
        (["--decode", "http://127.0.0.1:9", "--log-level", "verbose"], "error: Unknown level"),
        (["--config", "/nonexistent/p.yaml", "--decode", "http://127.0.0.1:9"], "error: .*No such file"),
    ],
)
def test_a_proxy_flag_mistake_is_one_line(argv: list[str], error: str) -> None:
    from vllm_disagg.cli import main

    with pytest.raises(SystemExit, match=f"^{error}"):
        main(["proxy", *argv])


@pytest.mark.parametrize(
    "fields",
    [
        {"side_channel": "nohost"},  # was accepted, then every transfer through it raised (a 500 per request)
        {"side_channel": "h:abc"},
        {"side_channel": "h:99999"},
        {"url": "http://a b:8000"},
        {"url": "http://h:81OO"},
        {"url": "http://h:99999"},
        {"id": "p\nINFO all good"},  # would forge a log line
        {"kv_events": "h:5557"},
    ],
)
def test_an_instance_spec_that_cannot_be_served_is_refused_naming_the_field(fields: dict[str, str]) -> None:
    spec = {"url": "http://h:8000", "role": "prefill", **fields}
    with pytest.raises(ValueError) as err:
        InstanceConfig.model_validate(spec)
    assert next(iter(fields)) in str(err.value)


def test_an_instances_file_with_a_typo_is_an_error_not_an_empty_list(tmp_path: Path) -> None:
    """Renaming 'instances' removed every instance without a word; the watcher keeps the current ones on an error."""
    path = tmp_path / "instances.yaml"
    path.write_text("instance:\n  - url: http://h:8000\n")
    with pytest.raises(ValueError, match="expected the key 'instances'"):
        read_instances_file(str(path))
    path.write_text("instances:\n  - url: http://h:8000\n    side_channel: nohost\n")
    with pytest.raises(ValueError, match="instance 1: .*side_channel"):
        read_instances_file(str(path))
    path.write_text(
        "instances:\n  - http://p:8000;side=5600;role=prefill\n  - url: http://d:8000\n    role: decode\n"
    )
    p, d = read_instances_file(str(path))
    assert (p.role, p.side_channel_addr(), d.role) == ("prefill", ("p", 5600), "decode")
    path.write_text("instances: []\n")  # said explicitly: no instances
    assert read_instances_file(str(path)) == []
